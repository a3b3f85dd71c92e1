"""mimalloc under training processes on Linux: the environment that preloads it.

XLA's CPU runtime allocates a step's large buffers (the logits, activations, gradients) as each
step starts and frees them as it ends. glibc's malloc hands every block above 32 MiB back to the
kernel when it is freed, so each step the kernel maps those buffers anew and zeroes every page
as it is touched: 2.3-4.9 CPU-seconds a step in the kernel for the 270M on 2 cores (LoRA and
full fine-tuning at 8 x 128, transparent huge pages on), with ~5,000 page faults. mimalloc keeps
freed memory for reuse instead, never handing it back (``MIMALLOC_PURGE_DELAY=-1``: with a delay
of 10 s, blocks waiting out their delay were passed over for fresh ones, and the step still
faulted 2,500 pages a step, with more peak RSS than never handing back), and asks for 2 MiB pages:
the LoRA step then has almost no page faults and ~0.02-0.4 s of kernel time, and runs 1.37x
faster, full fine-tuning 1.11x (it still faults ~1,750 pages a step), for 0.6-1.6 GB more peak
RSS (``bench/allocator.py``, the 270M at 8 x 128 on 2 cores). The numbers computed are the
same: only where buffers live changes. The price: a process keeps the most memory it ever used
until it exits (a training kernel reuses it every step; an idle one holds it).

A preloaded allocator must be in place as a process starts, so it is set in the environment of
the processes that train: ``gemmalab.headless``'s notebook kernel (``make demo``), the kernels of
``scripts/lab``, the CPU image. The wheel (``cmeel-mimalloc``, Linux only) is a dependency;
without it, elsewhere, or with ``GEMMALAB_MALLOC=system``, nothing is preloaded and glibc's
malloc runs with ``HUGE_PAGES``. ``python -m gemmalab.allocator`` prints the variables, one
``NAME=value`` a line, for shell scripts.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Mapping
from pathlib import Path

DISTRIBUTION = "cmeel-mimalloc"
LIBRARY = "cmeel.prefix/lib/libmimalloc.so.3"  # where the wheel puts it, from site-packages
OPTIONS = {
    "MIMALLOC_PURGE_DELAY": "-1",  # never hand freed memory back: the next step reuses it
    "MIMALLOC_ALLOW_LARGE_OS_PAGES": "1",  # 2 MiB pages (transparent huge pages)
}
OPT_OUT = "GEMMALAB_MALLOC"  # "system": leave the process's malloc alone
# glibc's malloc without mimalloc: huge pages for its large blocks (1.14x the 270M's LoRA step,
# bench/huge_pages.py).
HUGE_PAGES = "glibc.malloc.hugetlb=1"


def library_path() -> Path | None:
    """The installed ``libmimalloc.so``, or None (not Linux, or the wheel is not installed)."""
    if sys.platform != "linux":
        return None
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(distribution.locate_file(LIBRARY)))
    return path if path.is_file() else None


def environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to add to ``base`` (default ``os.environ``) so that a process started with
    them allocates with mimalloc; values already set in ``base`` win. Without mimalloc (or with
    ``GEMMALAB_MALLOC=system``) only glibc's ``HUGE_PAGES``."""
    base = os.environ if base is None else base
    added = {} if "GLIBC_TUNABLES" in base else {"GLIBC_TUNABLES": HUGE_PAGES}
    library = None if base.get(OPT_OUT) == "system" else library_path()
    if library is None:
        return added
    preloaded = base.get("LD_PRELOAD", "")
    if "mimalloc" not in preloaded:
        added["LD_PRELOAD"] = ":".join(p for p in (str(library), preloaded) if p)
    added.update({name: value for name, value in OPTIONS.items() if name not in base})
    return added


def without_allocator(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` less every variable this module sets or reads (``GLIBC_TUNABLES`` kept): the
    starting point of a process whose malloc a caller chooses itself (the benches)."""
    return {name: value for name, value in base.items()
            if name not in ("LD_PRELOAD", OPT_OUT) and not name.startswith("MIMALLOC_")}


def main() -> None:
    for name, value in environment().items():
        print(f"{name}={value}")


if __name__ == "__main__":
    main()
