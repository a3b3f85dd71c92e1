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

The kernel's malloc is ``gemmalab.allocator``'s choice for this host (mimalloc in VMs that hand
freed pages to their hypervisor, else glibc's with huge pages; ``GEMMALAB_MALLOC`` overrides).
A preloaded allocator is read only as a process starts: the variables are set here, for the
kernel; ones already set win.
"""

from __future__ import annotations

import functools
import os
import sys

from gemmalab import allocator
from gemmalab.errors import ConfigError


def main(argv: list[str] | None = None) -> None:
    from papermill import cli
    from papermill.execute import execute_notebook

    try:
        os.environ.update(allocator.environment())  # inherited by the kernel
    except ConfigError as error:
        raise SystemExit(str(error)) from None
    cli.execute_notebook = functools.partial(execute_notebook, shutdown_kernel="immediate")
    cli.papermill.main(args=sys.argv[1:] if argv is None else argv, prog_name="gemmalab.headless")


if __name__ == "__main__":
    main()
