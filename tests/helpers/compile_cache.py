"""The test suite's JAX compilation cache: one folder per machine kind, kept across sessions.

XLA's CPU compiles are most of the suite's CPU time (docs/benchmarks/make-test-cpu-time.md), and
the programs are the same from one run to the next: a warm `make test` reads them from disk.
JAX's cache key holds the program, the compile options, XLA_FLAGS and the versions; the folder
adds the CPU's feature flags (``compile_cache.host_key``), so no other CPU kind reads them.
"""

from __future__ import annotations

import os
from pathlib import Path

from gemmalab.train import compile_cache

# The suite writes ~1-2 GB a session; past this the least recently written files go first.
MAX_BYTES = 4 << 30


def suite_compile_cache(max_bytes: int = MAX_BYTES) -> Path:
    """``$GEMMALAB_TEST_COMPILE_CACHE`` (else ``~/.cache/gemmalab/test-jax-compile``) /
    <host key>, trimmed to ``max_bytes``."""
    named = os.environ.get("GEMMALAB_TEST_COMPILE_CACHE")
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = Path(named) if named else xdg / "gemmalab" / "test-jax-compile"
    path = root / compile_cache.host_key()
    path.mkdir(parents=True, exist_ok=True)
    trim(path, max_bytes)
    return path


def trim(folder: Path, max_bytes: int) -> list[Path]:
    """Remove the oldest files (by modification time) until ``folder`` holds at most
    ``max_bytes``; the files removed."""
    files = []
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            stat = entry.stat(follow_symlinks=False)
            files.append((stat.st_mtime, stat.st_size, Path(entry.path)))
    total = sum(size for _, size, _ in files)
    removed = []
    for _, size, path in sorted(files):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size
        removed.append(path)
    return removed
