"""JAX's persistent compilation cache, kept in the run's ``compile_cache_dir``.

A second run of the same configuration (a notebook re-run, a restarted pod, the next trial of a
sweep) loads its compiled steps from disk instead of compiling them again: on two CPU cores that
is most of the seconds between starting a notebook and its first training step.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
from pathlib import Path

# Below this a compile is cheaper than the cache's own read/write; the train and eval steps,
# the weight init and the sampler all take longer.
MIN_COMPILE_SECONDS = 0.3


def enable(root: Path) -> str:
    """Use ``root/<host key>`` unless a cache directory is already configured
    (``JAX_COMPILATION_CACHE_DIR``, or ``jax.config`` set by the user); returns the one in use.

    The host key separates machines whose CPU executables differ (instruction sets), for a
    ``root`` shared over NFS or a bucket mount (the pods' /outputs).
    """
    import jax
    from jax._src import compilation_cache

    current = jax.config.jax_compilation_cache_dir
    if current:
        return str(current)
    path = root / host_key()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    # JAX decides once per process whether a cache is in use, at its first compile; anything
    # compiled before this call (a notebook cell, a test) would otherwise leave it off.
    compilation_cache.reset_cache()
    return str(path)


def host_key() -> str:
    """The machine, the CPU's feature flags and jax's and jaxlib's versions, hashed (without
    importing jax: the test suite names its cache before jax reads its configuration)."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        lines = cpuinfo.read_text(errors="replace").splitlines()
        flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    versions = "|".join(importlib.metadata.version(name) for name in ("jax", "jaxlib"))
    text = f"{platform.machine()}|{flags}|{versions}"
    return f"{platform.machine()}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
