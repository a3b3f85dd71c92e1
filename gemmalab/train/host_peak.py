"""This host's dense matmul rate: what a CPU run's ``cpu_mfu`` is measured against.

CPUs list no peak (``Accelerator.peak_flops`` is None there), so a CPU run measures one: the
best rate of a jitted square ``jnp.dot`` (``SIZE`` x ``SIZE``, 2 n^3 FLOPs) in the run's compute
dtype on one CPU device (XLA's CPU backend runs one device's matmul on every core), compiled and
warmed up first; a few seconds. Kept once per machine in the machine's own cache
(``$GEMMALAB_CACHE_DIR``, else ``~/.cache/gemmalab``; ``host_peak/``), whatever a run's
``cache_dir``: it is a fact of the host, not of a run's data, and a run with a fresh
``cache_dir`` should not pay for it again. Keyed by what moves the figure (``host_key``): the
CPU, the cores this process may use, jax's version, the dtype, the size and ``XLA_FLAGS``
(``--xla_cpu_max_isa`` picks other kernels).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

from gemmalab import storage

SIZE = 2048
REPEATS = 5  # timed multiplications at most, after the warm-up,
BUDGET_S = 2.0  # and no more once this much time went into them (at least two are timed)
DIRECTORY = "host_peak"
BUSY_LOAD_PER_CPU = 0.5  # above this load a measurement is used once, not cached,
BUSY_ELSEWHERE = 0.15  # nor when other processes held this share of the CPUs while it ran


def of_run(devices: Any, dtype: Any, cache_dir: str | os.PathLike | None = None
           ) -> float | None:
    """The peak a run on ``devices`` (``Accelerator``) reports ``cpu_mfu`` against: the
    host's rate on CPUs, None elsewhere (accelerators have a listed peak: ``mfu``).

    The host's rate, not times the device count: CPU devices, simulated ones
    (``--xla_force_host_platform_device_count``) included, share the host's cores, and one
    device's matmul already uses all of them. None for runs of several processes too: on one
    host they would share its cores and time each other's measurement, on several the peak is
    the sum of theirs; neither is known from here.
    """
    import jax

    if devices.platform != "cpu" or jax.process_count() > 1:
        return None
    from gemmalab.config import default_cache_dir

    return matmul_flops_per_s(dtype, cache_dir or default_cache_dir())


def matmul_flops_per_s(dtype: Any, cache_dir: str | os.PathLike, *, size: int = SIZE) -> float:
    """This host's ``size`` x ``size`` matmul rate in ``dtype`` (FLOP/s): read from
    ``cache_dir/host_peak/`` when measured before under the same ``host_key``, else measured and
    written there (only on a quiet host: ``BUSY_LOAD_PER_CPU``, ``BUSY_ELSEWHERE``)."""
    key = host_key(dtype, size)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / DIRECTORY / f"{key['dtype']}-{size}-{digest}.json"
    cached = _read(path, key)
    if cached is not None:
        return cached
    started, cpus_before = time.perf_counter(), cpu_seconds()
    load = host_load()
    rate = measure(dtype, size)
    seconds = time.perf_counter() - started
    elsewhere = busy_elsewhere(cpus_before, seconds)
    record = {"flops_per_s": rate, "key": key, "measuring_s": seconds, "load_per_cpu": load,
              "busy_elsewhere": elsewhere,
              "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    # A figure taken while other work held the cores is low, and every later run's cpu_mfu would
    # be too high: this run uses it, but it is kept only when measured on a quiet host: by the
    # load average (which lags a minute: other work that just started passes it) and by what
    # other processes ran during the measurement itself. An unwritable cache costs the next run
    # a measurement, not this run its figure.
    if load <= BUSY_LOAD_PER_CPU and elsewhere <= BUSY_ELSEWHERE:
        with contextlib.suppress(OSError):
            storage.write_bytes(path, json.dumps(record, indent=1).encode())
    return rate


def host_load() -> float:
    """The 1-minute load average per usable CPU (0 where the OS does not report it)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 0.0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return load / max(usable or 1, 1)


def cpu_seconds() -> tuple[float, float] | None:
    """``(seconds every CPU of the host spent busy, seconds this process ran)`` so far (busy:
    all but idle and I/O wait, a hypervisor's steal included); None without ``/proc/stat``."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    own = os.times()
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def busy_elsewhere(since: tuple[float, float] | None, seconds: float) -> float:
    """The share of the host's CPUs that other processes kept busy over the last ``seconds``
    (from ``since``, a ``cpu_seconds()``); 0 where that is not known."""
    now = cpu_seconds()
    if since is None or now is None or seconds <= 0:
        return 0.0
    others = (now[0] - since[0]) - (now[1] - since[1])
    return max(0.0, others) / (seconds * (os.cpu_count() or 1))


def measure(dtype: Any, size: int = SIZE, *, repeats: int = REPEATS,
            budget_s: float = BUDGET_S) -> float:
    """The best FLOP/s of ``repeats`` timed ``size`` x ``size`` ``jnp.dot``s on the first CPU
    device, after a compile and a warm-up (not timed); stops early once ``budget_s`` went into
    at least two."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    device = jax.devices("cpu")[0]
    values = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    x = jax.device_put(values.astype(jnp.dtype(dtype)), device)
    dot = jax.jit(jnp.dot).lower(x, x).compile()
    dot(x, x).block_until_ready()
    best, started = math.inf, time.perf_counter()
    for done in range(1, repeats + 1):
        begin = time.perf_counter()
        dot(x, x).block_until_ready()
        best = min(best, time.perf_counter() - begin)
        if done >= 2 and time.perf_counter() - started > budget_s:
            break
    return 2 * size**3 / best


def host_key(dtype: Any, size: int = SIZE) -> dict[str, Any]:
    """What the measured rate depends on; a cached figure is used only under an equal key."""
    import jax
    import jax.numpy as jnp
    import jaxlib

    usable = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
              else os.cpu_count())
    return {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "usable_cpus": usable,
            "cpu_quota": _cpu_quota(), "machine": platform.machine(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "dtype": jnp.dtype(dtype).name, "size": size,
            "xla_flags": os.environ.get("XLA_FLAGS", "").strip()}


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor()


def _cpu_quota() -> str:
    """A container's CPU limit (cgroup v2 ``cpu.max``, e.g. ``"200000 100000"``: two cores),
    which caps the rate without changing the affinity; "" without one."""
    try:
        return Path("/sys/fs/cgroup/cpu.max").read_text().strip()
    except OSError:
        return ""


def _read(path: Path, key: dict[str, Any]) -> float | None:
    """The cached rate, or None: no file, an unreadable one, or one written under another key
    (a hash collision, a hand edit)."""
    try:
        record = json.loads(path.read_text())
        rate = float(record["flops_per_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rate if record.get("key") == key and rate > 0 and math.isfinite(rate) else None
