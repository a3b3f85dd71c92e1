"""What a run records as it goes: ``metrics.jsonl``/``eval.jsonl`` (``MetricsSink``, and
TensorBoard's event files through its ``tensorboard_log``), the per-step rows, progress bar and
log lines the training loop hands over (``StepLog``), the seconds spent before the first step
(``Startup``) and the FLOP accounting behind MFU (``FlopAccounting``)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from gemmalab.train.tensorboard_log import TensorBoardLog


# Marks the first row of each attempt (a run, or its resumption after a preemption): the step
# that warms up (compiled programs loaded, buffers first allocated) is no steady figure.
ATTEMPT_START = "attempt_start"


class MetricsSink:
    """``metrics.jsonl`` and ``eval.jsonl`` in ``output_dir``; only process 0 writes.

    Resuming at step N keeps every row up to N (read back into ``kept``) and drops the later
    ones, which the resumed run computes again.

    ``tensorboard`` (``tensorboard_log.TensorBoardLog``, the main process's; None: none) gets
    every row as scalars, is flushed and closed with the files, and is handed the kept rows its
    event files may lack.
    """

    def __init__(self, output_dir: str, enabled: bool, *, resume_step: int | None = None,
                 tensorboard: TensorBoardLog | None = None):
        from etils import epath

        self.enabled = enabled
        self.output_dir = output_dir
        self.tensorboard = tensorboard if enabled else None
        self.kept: dict[str, list[dict[str, Any]]] = {"metrics": [], "eval": []}
        self._files: dict[str, Any] = {}
        directory = epath.Path(output_dir)
        for name in self.kept:
            path = directory / f"{name}.jsonl"
            if resume_step is not None and path.exists():
                rows = [json.loads(line) for line in path.read_text().splitlines() if line]
                self.kept[name] = [r for r in rows if r["step"] <= resume_step]
        if jax.process_count() > 1:  # every process has read the rows before process 0 rewrites
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("gemmalab-metrics-read")
        if enabled:
            directory.mkdir(parents=True, exist_ok=True)
            for name, rows in self.kept.items():
                # Rewritten rather than appended to: gs:// objects cannot be appended to.
                self._files[name] = (directory / f"{name}.jsonl").open("w")
                for row in rows:
                    self._files[name].write(json.dumps(row) + "\n")
                # At once: until then the file is empty, and readers (launch.ipynb, a test
                # watching a preempted run) would see the kept rows gone.
                self._files[name].flush()
            if self.tensorboard is not None:
                self.tensorboard.fill(self.kept)

    def write(self, name: str, record: dict[str, Any]) -> None:
        if self.enabled:
            self._files[name].write(json.dumps(record) + "\n")
            if self.tensorboard is not None:
                self.tensorboard.scalars(name, record)

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def write_json(self, filename: str, payload: dict[str, Any]) -> None:
        if self.enabled:
            from etils import epath

            (epath.Path(self.output_dir) / filename).write_text(json.dumps(payload, indent=1))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self.tensorboard is not None:
            self.tensorboard.close()


class StepLog:
    """The training loop's record keeper.

    A step's metrics are read one step late (``step`` settles the previous one while the new one
    runs), so the device never waits for the host; a ``durable`` step (one a checkpoint is
    about to claim) is read and flushed at once, and an evaluation or ``close`` reads the last
    one first, so the rows stay in step order. ``wait_for_each_step`` reads every step at once,
    so the next is dispatched only when this one has ended: on a CPU, where the host and the
    device share the cores and running ahead gains nothing, the next step's temporaries then
    take the place the last one's freed, not a second one (docs/benchmarks/arena-reserve.md).
    ``nonfinite`` builds the error raised for a non-finite loss or gradient norm in a step that
    was not skipped.

    Each step's record carries its wall-clock ``time``, and with ``flops_per_step`` (the model's
    FLOPs) the achieved ``model_flops_per_s``; with the devices' ``peak_flops_per_s`` its MFU,
    with a CPU host's measured matmul rate (``host_peak_flops_per_s``) its ``cpu_mfu``.
    """

    def __init__(self, sink: MetricsSink, *, total_steps: int, start_step: int,
                 steps_per_epoch: int, tokens_per_step: int, log_every: int, show: bool,
                 nonfinite: Callable[[int, dict[str, float]], Exception],
                 flops_per_step: float | None = None, peak_flops_per_s: float | None = None,
                 host_peak_flops_per_s: float | None = None, wait_for_each_step: bool = False):
        from tqdm.auto import tqdm

        self.sink = sink
        self.history = sink.kept["metrics"]
        self.eval_history = sink.kept["eval"]
        self._total, self._per_epoch, self._tokens = total_steps, steps_per_epoch, tokens_per_step
        self._log_every, self._nonfinite = log_every, nonfinite
        self._flops, self._peak = flops_per_step, peak_flops_per_s
        self._host_peak = host_peak_flops_per_s
        self._wait_for_each_step = wait_for_each_step
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                         disable=not show)
        self._pending: tuple | None = None
        self._last_done = time.perf_counter()
        self._first = True  # this attempt's first step: it pays for warming up (ATTEMPT_START)
        self.steps_ended: float | None = None  # perf_counter when the last read step finished

    def step(self, step: int, metrics: Any, data_wait: float, batch_digest: int, *,
             durable: bool = False) -> None:
        """Record a step; ``durable``: its row is written and flushed before this returns."""
        self.settle()
        self._pending = (step, metrics, data_wait, batch_digest)
        if durable or self._wait_for_each_step:
            self.settle()
        if durable:
            self.sink.flush()

    def settle(self) -> None:
        """Read the pending step's metrics (waiting for the device) and write its row."""
        if self._pending is None:
            return
        step, metrics, data_wait, digest = self._pending
        self._pending = None
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        step_time, self._last_done = now - self._last_done, now
        self.steps_ended = now
        if not values.get("skipped") and not (math.isfinite(values["loss"])
                                              and math.isfinite(values["grad_norm"])):
            raise self._nonfinite(step, values)
        record = {"step": step, "epoch": step / self._per_epoch, **values,
                  "tokens": self._tokens, "step_time_s": step_time, "data_wait_s": data_wait,
                  "batch_crc32": digest, "tokens_per_s": self._tokens / step_time,
                  "useful_tokens_per_s": values["useful_tokens"] / step_time,
                  "time": time.time()}
        if self._first:
            record[ATTEMPT_START], self._first = True, False
        if self._flops:
            record["model_flops_per_s"] = self._flops / step_time
            if self._peak:
                record["mfu"] = record["model_flops_per_s"] / self._peak
            if self._host_peak:
                record["cpu_mfu"] = record["model_flops_per_s"] / self._host_peak
        self.history.append(record)
        self.sink.write("metrics", record)
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{values['loss']:.3f}", refresh=False)
        if step % self._log_every == 0:
            self.sink.flush()

    def evaluation(self, step: int, evaluate: Callable[[], dict[str, float]]) -> dict[str, Any]:
        """Run and record an evaluation (``evaluate``: ``optimization.evaluate``'s
        ``eval_loss``, ``eval_perplexity`` and, for DPO, the pairs' means); after step 0, also a
        plain log line (papermill and ``kubectl logs`` show these, not the bar). The pending
        step's row is written first, and ``evaluate`` runs after it: a step is timed to its own
        end, not to the end of the evaluation that follows it."""
        self.settle()
        values = evaluate()
        record = {"step": step, **values}
        loss, perplexity = values["eval_loss"], values["eval_perplexity"]
        self.eval_history.append(record)
        self.sink.write("eval", record)
        recent = self.history[-self._log_every:]
        if step and recent and self.sink.enabled:
            self._bar.write(f"step {step}/{self._total}: "
                            f"train loss {np.mean([r['loss'] for r in recent]):.3f}, "
                            f"eval loss {loss:.3f} (perplexity {perplexity:.2f}), "
                            + (f"reward accuracy {values['eval_reward_accuracy']:.3f}, "
                               if "eval_reward_accuracy" in values else "") +
                            f"{np.mean([r['useful_tokens_per_s'] for r in recent]):,.0f} "
                            "useful tokens/s")
        self.sink.flush()
        self._last_done = time.perf_counter()  # evaluation time is no step's time
        return record

    def close(self) -> None:
        self.settle()
        self._bar.close()
        self.sink.close()


class Startup:
    """Seconds by phase from the process's start to the end of the first training step
    (summary.json's "startup"): ``before_prepare_s``, then each ``phase`` as it ends."""

    def __init__(self) -> None:
        self._clock = time.perf_counter()
        self.started_at = time.time()
        self.phases: dict[str, float | None] = {"before_prepare_s": _seconds_since_process_start()}

    def phase(self, name: str) -> None:
        """``name`` took the time since the previous phase ended (or since ``Startup()``)."""
        now = time.perf_counter()
        self.phases[f"{name}_s"] = now - self._clock
        self._clock = now

    def record(self, name: str, seconds: float) -> None:
        """A phase timed apart (the step's compile, the first evaluation)."""
        self.phases[f"{name}_s"] = seconds

    def summary(self, history: list[dict[str, Any]], start_step: int) -> dict[str, float | None]:
        """The phases, and ``to_first_step_s`` once this process ran its first step."""
        out = dict(self.phases)
        first = next((r for r in history if r["step"] == start_step + 1), None)
        before = out.get("before_prepare_s")
        if first is not None and before is not None:
            out["to_first_step_s"] = before + first["time"] - self.started_at
        return out


def _seconds_since_process_start() -> float | None:
    """How long this Python process (e.g. the notebook's kernel) ran before now."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - a figure for the summary, never worth failing a run
        return None


@dataclasses.dataclass
class FlopAccounting:
    """The step's model FLOPs (6 per weight per token plus attention: ``plan.model_flops``),
    what MFU is measured against; the devices' dense bf16 peak (None where unknown: CPUs); on
    CPUs instead the host's measured matmul rate in the compute dtype (``host_peak``), which
    ``cpu_mfu`` is against; and XLA's own count of the compiled step beside them as a
    cross-check (it misses loop bodies run more than once, and counts what remat recomputes)."""

    model_flops_per_step: float
    peak_flops_per_s: float | None
    compiled_flops_per_step: float | None = None
    host_peak_flops_per_s: float | None = None

    @classmethod
    def of_run(cls, model_flops_per_step: float, devices: Any, *,
               host_peak_flops_per_s: float | None = None) -> FlopAccounting:
        """``model_flops_per_step``: ``plan.model_flops`` of the run's step; ``devices``:
        ``gemmalab.accelerators.Accelerator`` of the run's devices; ``host_peak_flops_per_s``:
        on CPUs, ``host_peak.of_run``'s measured rate (the whole host's, for every device)."""
        peak = devices.peak_flops * devices.chips if devices.peak_flops else None
        return cls(model_flops_per_step=model_flops_per_step, peak_flops_per_s=peak,
                   host_peak_flops_per_s=host_peak_flops_per_s)

    def record_compiled(self, compiled: Any) -> None:
        """XLA's FLOP count of the compiled step: one device's program, times every device."""
        from gemmalab.plan.roofline import compiled_cost

        cost = compiled_cost(compiled)
        self.compiled_flops_per_step = float(cost.get("flops", 0.0)) * jax.device_count()

    def summary(self, steps: int, seconds: float) -> dict[str, float | None]:
        """Achieved model FLOP/s over ``steps`` steps in ``seconds``, MFU and (CPUs) the share
        of the host's matmul rate, ``cpu_mfu``."""
        achieved = self.model_flops_per_step * steps / seconds
        host = self.host_peak_flops_per_s
        return {"model_flops_per_step": self.model_flops_per_step,
                "compiled_flops_per_step": self.compiled_flops_per_step,
                "model_flops_per_s": achieved,
                "peak_flops_per_s": self.peak_flops_per_s,
                "mfu": achieved / self.peak_flops_per_s if self.peak_flops_per_s else None,
                "host_matmul_flops_per_s": host,
                "cpu_mfu": achieved / host if host else None}
