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

Before papermill starts, the run's output folder (``GEMMALAB_OUTPUT_DIR``, under the outputs
bucket's mount) is made and must take a file: an outputs bucket the pod cannot write ends the pod
at once with one line naming it, not after the training it would lose. That line, or the failing
cell's one-line error, is also the container's termination message (Kubernetes' default
``/dev/termination-log``), which ``client.run_outcome`` quotes for a failed run.

papermill runs in a child process (this module again, ``AS_PAPERMILL`` first): its command line
as ``gemmalab.headless`` runs it, without the notes on training parameters, but with the
kernel's graceful shutdown (its exit runs ``jax.distributed``'s shutdown barrier, which other
hosts may still wait on), on the malloc ``gemmalab.allocator`` chooses for the node, as
``gemmalab.headless`` does (the manifests' command replaces the image's entry point, which
would otherwise choose it).

    python -m gemmalab.k8s.run_notebook INPUT.ipynb OUTPUT.ipynb [papermill options...]
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from gemmalab import allocator
from gemmalab.errors import ConfigError

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, as a process ended by it would report
CONFIG_EXIT_CODE = 2  # bad input found before papermill started
AS_PAPERMILL = "--as-papermill"  # the child's first argument: run papermill itself
OUTPUT_DIR_VARIABLE = "GEMMALAB_OUTPUT_DIR"
# Where Kubernetes reads a container's termination message (its default terminationMessagePath).
TERMINATION_LOG = Path("/dev/termination-log")


def write_termination_message(line: str, path: Path | None = None) -> None:
    """``line`` as the container's termination message, where Kubernetes gave it a file."""
    path = TERMINATION_LOG if path is None else path
    if path.exists():
        with contextlib.suppress(OSError):
            path.write_text(line[:4000] + "\n")


def require_writable_output_dir(folder: str) -> None:
    """Make ``folder`` and write a file into it, or one line naming the outputs bucket."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        probe = Path(folder) / f".write-check-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            "outputs_bucket", f"this pod (uid {os.getuid()}) cannot write the run's output folder "
            f"{folder} ({error.strerror or error})",
            "give the pods' service account write access to the outputs bucket (roles/"
            "storage.objectUser); on the local cluster make local_outputs_dir writable by uid "
            "1000") from None


def _deaf_to_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the kernel papermill starts


def main(argv: list[str] | None = None) -> int:
    import psutil  # here, not in the handler: nothing to import while a preemption's clock runs

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [AS_PAPERMILL]:
        from gemmalab.headless import run_papermill

        run_papermill(argv[1:], shutdown_kernel="graceful", prog_name="papermill",
                      on_error=write_termination_message)
        return 0
    if OUTPUT_DIR_VARIABLE in os.environ:
        try:
            require_writable_output_dir(os.environ[OUTPUT_DIR_VARIABLE])
        except ConfigError as error:
            line = f"ConfigError: {error}"
            print(line, file=sys.stderr, flush=True)
            write_termination_message(line)
            return CONFIG_EXIT_CODE
    try:
        # The manifests' command replaces the image's entry point (gemmalab.allocator), so the
        # malloc is chosen here, for papermill and the kernel it starts: in pods on glibc's
        # default the 270M's LoRA step ran 4x slower (fresh pages faulted in every step).
        malloc = allocator.environment()
    except ConfigError as error:
        print(f"ConfigError: {error}", file=sys.stderr, flush=True)
        write_termination_message(f"ConfigError: {error}")
        return CONFIG_EXIT_CODE
    papermill = [sys.executable, "-m", "gemmalab.k8s.run_notebook", AS_PAPERMILL, *argv]
    process = subprocess.Popen(papermill, preexec_fn=_deaf_to_sigterm,
                               env={**os.environ, **malloc})
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
