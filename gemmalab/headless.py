"""``python -m gemmalab.headless IN.ipynb OUT.ipynb [papermill options]``: papermill's own command
line for one-process runs on this machine (``make demo``), with the kernel stopped at once after
the last cell.

papermill asks the kernel to shut down gracefully, and ipykernel 7 can then leave a control
message pending as its event loop stops: the kernel's last act is a ``Task was destroyed but it
is pending!`` traceback, printed after the notebook has succeeded (seen once in three demo runs).
Every cell has finished by then, outputs included, so nothing is lost by ending the kernel (and
its process group) straight away, which never runs that teardown. papermill's CLI has no option
for it; nbclient's ``shutdown_kernel`` passes through ``execute_notebook``.

Multi-host pods keep the graceful shutdown (``gemmalab.k8s.run_notebook``): there the kernel's
exit runs ``jax.distributed``'s shutdown barrier, which other hosts may still be waiting on.

The kernel starts with glibc's malloc asking for transparent huge pages (``HUGE_PAGES``, unless
``GLIBC_TUNABLES`` is set already): XLA's CPU runtime maps a step's large buffers afresh each
step, and the kernel faulting them in 4 KiB pages took 1.8 of the ~7.9 CPU-seconds of the
270M's LoRA step on 2 cores (0.7 with huge pages; the step 1.14x faster, ``bench/huge_pages.py``).
glibc reads the variable only as a process starts: it is set here, for the kernel, and in the
Makefile.
"""

from __future__ import annotations

import functools
import os
import sys

HUGE_PAGES = "glibc.malloc.hugetlb=1"


def main(argv: list[str] | None = None) -> None:
    from papermill import cli
    from papermill.execute import execute_notebook

    os.environ.setdefault("GLIBC_TUNABLES", HUGE_PAGES)  # inherited by the kernel
    cli.execute_notebook = functools.partial(execute_notebook, shutdown_kernel="immediate")
    cli.papermill.main(args=sys.argv[1:] if argv is None else argv, prog_name="gemmalab.headless")


if __name__ == "__main__":
    main()
