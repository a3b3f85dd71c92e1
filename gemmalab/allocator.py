"""Which malloc a training process runs on (Linux): glibc's with huge pages, or mimalloc.

XLA's CPU runtime allocates a step's large buffers (the logits, activations, gradients) as each
step starts and frees them as it ends. glibc's malloc hands every block above 32 MiB back to the
kernel when it is freed, and maps it afresh the next step. mimalloc (``MIMALLOC_PURGE_DELAY=-1``,
2 MiB pages) keeps freed memory for the next step instead, at the price of a higher high-water
mark that a process keeps until it exits. What that buys depends on the host (the 270M at
8 x 128 on 2 cores, ``bench/allocator.py``, docs/benchmarks/page-reporting.md):

- **An ordinary host** (bare metal, most VMs): mapping a block afresh only costs the kernel's
  page zeroing, ~0.4 s of CPU a LoRA step. mimalloc's steady LoRA step is 1.04x glibc's, for
  +3.7 GB of peak RSS (8.5 against 4.8 GB). Not worth it: glibc with huge pages.
- **A VM that hands the guest's free pages back to its hypervisor** (a virtio balloon with free
  page reporting, e.g. Firecracker's microVMs): every block glibc frees goes back to the host at
  once, and touching it again costs the host's page faults too, ~7 s a GiB measured. There the
  kernel's share of the LoRA step was 2.3-2.8 CPU-seconds of ~11, and mimalloc, which frees
  nothing, made the step 1.37x faster (full fine-tuning 1.11x). mimalloc.

``GEMMALAB_MALLOC`` overrides the choice: ``auto`` (the default: by the host, as above),
``mimalloc``, or ``system`` (glibc with ``HUGE_PAGES``). Without the ``cmeel-mimalloc`` wheel
(not Linux), glibc. The numbers computed are the same either way: only where buffers live
changes.

A preloaded allocator must be in place as a process starts, so it is set in the environment of
the processes that train: ``gemmalab.headless``'s notebook kernel (``make demo``), the kernels of
``scripts/lab``, the CPU image's command. ``python -m gemmalab.allocator`` prints the variables,
one ``NAME=value`` a line, for shell scripts; ``python -m gemmalab.allocator COMMAND ...`` runs
COMMAND with them.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from gemmalab.errors import ConfigError

DISTRIBUTION = "cmeel-mimalloc"
LIBRARY = "cmeel.prefix/lib/libmimalloc.so.3"  # where the wheel puts it, from site-packages
OPTIONS = {
    "MIMALLOC_PURGE_DELAY": "-1",  # never hand freed memory back: the next step reuses it
    "MIMALLOC_ALLOW_LARGE_OS_PAGES": "1",  # 2 MiB pages (transparent huge pages)
    # One arena (mimalloc's largest; address space only, pages are touched as used) instead of
    # 1 GiB ones: each thread searches the arenas from its own start, so a step's block, freed
    # and allocated again by another thread, could land in a fresh arena and fault it in. In
    # one, blocks are placed first-fit (docs/benchmarks/arena-reserve.md).
    "MIMALLOC_ARENA_RESERVE": "16GiB",
}
CHOICE = "GEMMALAB_MALLOC"  # "auto" (default), "mimalloc" or "system"
CHOICES = ("auto", "mimalloc", "system")
# The kernel's largest free-page block order (MAX_PAGE_ORDER, 4 MiB with 4 KiB pages): free page
# reporting set to a larger order never reports a page.
MAX_PAGE_ORDER = 10
VIRTIO_BALLOON = 5  # the virtio device id of a memory balloon
BALLOON_FREE_PAGE_REPORTING = 5  # its feature bit VIRTIO_BALLOON_F_REPORTING
# glibc's malloc without mimalloc: huge pages for its large blocks (1.24x the 270M's LoRA step on
# a host that keeps its memory, bench/huge_pages.py).
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
    return path if path.is_file() and preloads(path) else None


def preloads(library: Path) -> bool:
    """Whether a process starts with ``library`` preloaded: the dynamic loader only warns about
    a preload it cannot load (a slim image without a library it links, e.g. libatomic), and the
    process would then run on glibc's malloc anyway while the environment says mimalloc."""
    probe = subprocess.run([sys.executable, "-S", "-c", ""], capture_output=True, text=True,
                           env={**os.environ, "LD_PRELOAD": str(library)})
    return probe.returncode == 0 and not probe.stderr.strip()


def hypervisor_takes_freed_pages(sys_root: Path = Path("/sys")) -> bool:
    """Whether this Linux guest hands the pages it frees back to its hypervisor: a virtio memory
    balloon that negotiated free page reporting, with reporting on (an order the kernel's free
    lists reach). Reads sysfs only; False wherever a file is missing (bare metal, not Linux)."""
    try:
        order = int((sys_root / "module/page_reporting/parameters/page_reporting_order")
                    .read_text())
    except (OSError, ValueError):
        return False
    if order > MAX_PAGE_ORDER:
        return False
    for device in sorted((sys_root / "bus/virtio/devices").glob("*")):
        try:
            if int((device / "device").read_text(), 16) != VIRTIO_BALLOON:
                continue
            if not (device / "driver").exists():
                continue  # no driver bound: nothing reports
            features = (device / "features").read_text().strip()
        except (OSError, ValueError):
            continue
        if features[BALLOON_FREE_PAGE_REPORTING:BALLOON_FREE_PAGE_REPORTING + 1] == "1":
            return True
    return False


def wants_mimalloc(base: Mapping[str, str]) -> bool:
    """``GEMMALAB_MALLOC`` in ``base``, or for ``auto`` the host: see the module's docstring."""
    choice = base.get(CHOICE, "auto") or "auto"
    if choice not in CHOICES:
        raise ConfigError(CHOICE, f"unknown malloc {choice!r}", f"set it to one of {CHOICES}")
    return choice == "mimalloc" or (choice == "auto" and hypervisor_takes_freed_pages())


def environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to add to ``base`` (default ``os.environ``) so that a process started with
    them allocates as ``GEMMALAB_MALLOC`` chooses (the module's docstring); values already set in
    ``base`` win. glibc: only its ``HUGE_PAGES``; mimalloc: that, the preload and its options."""
    base = os.environ if base is None else base
    added = {} if "GLIBC_TUNABLES" in base else {"GLIBC_TUNABLES": HUGE_PAGES}
    library = library_path() if wants_mimalloc(base) else None
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
            if name not in ("LD_PRELOAD", CHOICE) and not name.startswith("MIMALLOC_")}


def main(argv: list[str] | None = None) -> None:
    """No arguments: print the variables. ``COMMAND ...``: run it with them (``exec``)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        added = environment()
    except ConfigError as error:
        raise SystemExit(str(error)) from None
    if not argv:
        for name, value in added.items():
            print(f"{name}={value}")
        return
    os.execvpe(argv[0], argv, {**os.environ, **added})


if __name__ == "__main__":
    main()
