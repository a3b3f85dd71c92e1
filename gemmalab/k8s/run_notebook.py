"""The training container's entry point: papermill, with SIGTERM delivered to the notebook.

Kubernetes announces a preemption, a node drain or a JobSet restart with SIGTERM to the
container's first process, and SIGKILLs everything ``terminationGracePeriodSeconds`` later.
papermill passes nothing on to the kernel it started, so the training loop would never hear it.
Here papermill and its kernel start with SIGTERM ignored; a SIGTERM to this process is forwarded
to all of papermill's descendants (the kernel runs in a session of its own, so a process group
would miss it), where only the training loop listens
(``gemmalab.train.preemption.StopRequest``): it finishes its step, saves a checkpoint and stops.
papermill then writes the notebook with the ``Preempted`` line, and this process exits with
``PREEMPTED_EXIT_CODE``, which the manifests' pod failure policies retry without counting it
as a failure. The next pod resumes from the checkpoint.

papermill runs in a child process (this module again, ``AS_PAPERMILL`` first): its command line
as ``gemmalab.headless`` runs it, without the notes on training parameters, but with the
kernel's graceful shutdown (its exit runs ``jax.distributed``'s shutdown barrier, which other
hosts may still wait on) and the container's own malloc.

    python -m gemmalab.k8s.run_notebook INPUT.ipynb OUTPUT.ipynb [papermill options...]
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, as a process ended by it would report
AS_PAPERMILL = "--as-papermill"  # the child's first argument: run papermill itself


def _deaf_to_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the kernel papermill starts


def main(argv: list[str] | None = None) -> int:
    import psutil  # here, not in the handler: nothing to import while a preemption's clock runs

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [AS_PAPERMILL]:
        from gemmalab.headless import run_papermill

        run_papermill(argv[1:], shutdown_kernel="graceful", prog_name="papermill")
        return 0
    papermill = [sys.executable, "-m", "gemmalab.k8s.run_notebook", AS_PAPERMILL, *argv]
    process = subprocess.Popen(papermill, preexec_fn=_deaf_to_sigterm)
    stop_requested = False

    def forward(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True
        with contextlib.suppress(psutil.Error):  # papermill already gone
            for child in psutil.Process(process.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    status = process.wait()
    return PREEMPTED_EXIT_CODE if stop_requested else status


if __name__ == "__main__":
    sys.exit(main())
