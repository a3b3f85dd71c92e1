"""SIGTERM — GKE's notice before a preemption or a JobSet restart — as a request the training
loop honours between steps: finish the step, save a checkpoint, stop."""

from __future__ import annotations

import signal
import threading
from typing import Any


class Preempted(RuntimeError):
    """Training stopped on request after saving; the same command resumes it."""

    def __init__(self, step: int, checkpoint: str):
        self.step = step
        super().__init__(f"stopped by SIGTERM after step {step}; checkpoint saved to "
                         f"{checkpoint}: run the same command again to resume")

    def _render_traceback_(self) -> list[str]:  # one line in Jupyter, not a stack
        return [f"Preempted: {self}"]


class StopRequest:
    """While active (``with``), SIGTERM sets ``requested`` instead of ending the process.

    Only the main thread can own signal handlers; elsewhere this never triggers. With several
    processes ``agreed()`` makes them all stop after the same step (a collective, so call it on
    every process at the same steps).
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def agreed(self) -> bool:
        """Whether any process was asked to stop."""
        import jax

        if jax.process_count() == 1:
            return self.requested
        import numpy as np
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.requested))
        return bool(np.any(flags))
