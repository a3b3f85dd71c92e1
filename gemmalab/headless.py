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

papermill warns of every ``-p`` name the notebook's parameters cell does not assign. The
notebooks that train read every ``TrainConfig`` field from their variables, and refuse a name
that is neither a field nor theirs (``TrainConfig.from_parameters``), so for fields the warning
is noise (a sweep's point passes a dozen): here it is dropped for them, kept for other names.

The kernel's malloc is ``gemmalab.allocator``'s choice for this host (mimalloc in VMs that hand
freed pages to their hypervisor, else glibc's with huge pages; ``GEMMALAB_MALLOC`` overrides).
A preloaded allocator is read only as a process starts: the variables are set here, for the
kernel; ones already set win.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable

from gemmalab import allocator
from gemmalab.config import FLAT_NAMES
from gemmalab.errors import ConfigError

UNKNOWN_PARAMETER = "Passed unknown parameter: "  # papermill's warning (papermill.execute)


class TrainingFieldsAreKnown(logging.Filter):
    """Drops papermill's unknown-parameter warning for ``TrainConfig`` fields only."""

    fields = frozenset(FLAT_NAMES)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith(UNKNOWN_PARAMETER)
                    and message.removeprefix(UNKNOWN_PARAMETER) in self.fields)


def run_papermill(argv: list[str], *, shutdown_kernel: str, prog_name: str,
                  on_error: Callable[[str], None] | None = None) -> None:
    """papermill's command line on ``argv``; the kernel shut down ``immediate`` or ``graceful``.
    A cell that fails: its traceback on stderr, and its error's one line (``ConfigError: ...``)
    to ``on_error``, if given."""
    from papermill import cli
    from papermill.exceptions import PapermillExecutionError
    from papermill.execute import execute_notebook

    logging.getLogger("papermill").addFilter(TrainingFieldsAreKnown())
    cli.execute_notebook = functools.partial(execute_notebook, shutdown_kernel=shutdown_kernel)
    try:
        cli.papermill.main(args=argv, prog_name=prog_name)
    except PapermillExecutionError as error:
        # The failing cell's own traceback (one line for a ConfigError), without papermill's
        # frames above it; the output notebook has the same.
        sys.stderr.write(f"{error}\n")
        if on_error is not None:
            on_error(f"{error.ename}: {error.evalue}")
        raise SystemExit(1) from None


def main(argv: list[str] | None = None) -> None:
    try:
        os.environ.update(allocator.environment())  # inherited by the kernel
    except ConfigError as error:
        raise SystemExit(str(error)) from None
    run_papermill(sys.argv[1:] if argv is None else argv, shutdown_kernel="immediate",
                  prog_name="gemmalab.headless")


if __name__ == "__main__":
    main()
