"""mimalloc against glibc's malloc (with huge pages) under XLA's CPU runtime: the embedded 270M's
training step in alternating processes.

    .venv/bin/python bench/allocator.py                      # LoRA r8 and full, 8 x 128
    .venv/bin/python bench/allocator.py --modes lora --maxlens 512 --steps 3

XLA's CPU runtime allocates a step's large buffers as the step starts and frees them as it ends.
glibc hands every block above 32 MiB back to the kernel when it is freed, so each step the kernel
maps them anew and zeroes each page as it is first touched (the system CPU time below).
mimalloc keeps freed memory for reuse (``gemmalab.allocator``). A preloaded allocator is set as a
process starts, so each setting runs in processes of its own, ``--pairs`` of them, turn about;
each process times ``--steps`` steps after a compiling one (bench/huge_pages.py's ``child``).

Reports per setting the median step (the median of each process's median), the page faults and
system CPU seconds a step, the peak RSS, and the last loss (the same in both: where buffers live
moves no number).
"""

from __future__ import annotations

import os
import sys

from gemmalab import allocator

sys.path.insert(0, os.path.dirname(__file__))
import huge_pages  # noqa: E402  (bench/huge_pages.py: its child times the steps)


def settings() -> dict[str, dict[str, str]]:
    """Each setting's environment: glibc's malloc with huge pages (what the tests, and training
    on ordinary hosts, run on), and mimalloc as ``gemmalab.allocator`` sets it (what training
    runs on in VMs that hand freed pages to their hypervisor)."""
    glibc = {**allocator.without_allocator(os.environ), "GLIBC_TUNABLES": allocator.HUGE_PAGES}
    if allocator.library_path() is None:
        raise SystemExit("mimalloc is not installed here (Linux, `make env`)")
    mimalloc = allocator.environment({**glibc, allocator.CHOICE: "mimalloc"})
    return {"glibc, huge pages": glibc, "mimalloc": {**glibc, **mimalloc}}


def main() -> None:
    args = huge_pages.arguments(__doc__.splitlines()[0])
    print(f"{args.pairs} pairs of processes, turn about; {args.steps} timed steps each; "
          f"freed pages go to a hypervisor: {allocator.hypervisor_takes_freed_pages()}")
    huge_pages.compare(settings(), "malloc", args)


if __name__ == "__main__":
    main()
