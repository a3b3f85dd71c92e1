"""Capture a JAX profiler trace of training steps (profile.ipynb); read it with trace_analysis."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax

from gemmalab.train import tensorboard_log

DEFAULT_SERVER_PORT = 9002
_server_port: int | None = None


def start_server(port: int = DEFAULT_SERVER_PORT) -> int:
    """Start ``jax.profiler``'s server once per process, for capture from the XProf UI."""
    global _server_port
    if _server_port is None:
        jax.profiler.start_server(port)
        _server_port = port
    return _server_port


def serve_if_requested() -> int | None:
    """Start the server when the pod asks for it (``GEMMALAB_PROFILER_PORT``, set by the GKE
    manifests when profiling is on), so XProf can capture a running training job."""
    port = os.environ.get("GEMMALAB_PROFILER_PORT")
    return start_server(int(port)) if port else None


@dataclasses.dataclass(frozen=True)
class Capture:
    logdir: str  # where the trace went: its plugins/profile/<run>/ (trace_analysis.find_xplane)
    first_step_s: float  # includes compilation
    steps: list[dict[str, float]]  # per traced step: host-measured data wait and step time

    def table(self) -> Any:
        import pandas as pd

        return pd.DataFrame(self.steps).set_index("step")


def capture(experiment: Any, *, logdir: str | None = None, warmup_steps: int = 3,
            profile_steps: int = 5) -> Capture:
    """Run ``warmup_steps`` untraced (the first compiles), then trace ``profile_steps`` steps.

    ``logdir`` (None: the run's TensorBoard directory, ``output_dir/tensorboard``, so
    TensorBoard's profile plugin and ``xprof`` show the trace beside the run's curves): the
    trace goes to its ``plugins/profile/<run>/``.

    Each traced step is wrapped in ``StepTraceAnnotation("train")`` so XProf sees step
    boundaries; it waits for the device, so host-side times split into data wait and step.
    """
    if logdir is None:
        logdir = tensorboard_log.logdir(experiment.config.runtime.output_dir)
    started = time.perf_counter()
    train_step = experiment.compile()
    state, frozen = experiment.weights.state, experiment.weights.frozen
    first_step_s = 0.0
    for i in range(max(warmup_steps, 1)):
        state, metrics = train_step(state, experiment.next_batch(), frozen)
        jax.block_until_ready(metrics)
        if i == 0:
            first_step_s = time.perf_counter() - started
    steps = []
    jax.profiler.start_trace(logdir)
    try:
        for i in range(profile_steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                t0 = time.perf_counter()
                batch = experiment.next_batch()
                t1 = time.perf_counter()
                state, metrics = train_step(state, batch, frozen)
                jax.block_until_ready(metrics)
                t2 = time.perf_counter()
            steps.append({"step": i, "data_wait_s": t1 - t0, "step_s": t2 - t1,
                          "loss": float(metrics["loss"])})
    finally:
        jax.profiler.stop_trace()
    experiment.weights.state = state
    return Capture(logdir=logdir, first_step_s=first_step_s, steps=steps)
