"""What a run records as it goes: ``metrics.jsonl``/``eval.jsonl`` (``MetricsSink``) and the
per-step rows, progress bar and log lines the training loop hands over (``StepLog``)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


class MetricsSink:
    """``metrics.jsonl`` and ``eval.jsonl`` in ``output_dir``; only process 0 writes.

    Resuming at step N keeps every row up to N (read back into ``kept``) and drops the later
    ones, which the resumed run computes again.
    """

    def __init__(self, output_dir: str, enabled: bool, *, resume_step: int | None = None):
        from etils import epath

        self.enabled = enabled
        self.output_dir = output_dir
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

    def write(self, name: str, record: dict[str, Any]) -> None:
        if self.enabled:
            self._files[name].write(json.dumps(record) + "\n")

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()

    def write_json(self, filename: str, payload: dict[str, Any]) -> None:
        if self.enabled:
            from etils import epath

            (epath.Path(self.output_dir) / filename).write_text(json.dumps(payload, indent=1))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class StepLog:
    """The training loop's record keeper.

    A step's metrics are read one step late (``step`` settles the previous one while the new one
    runs), so the device never waits for the host; ``settle`` reads the last one now, e.g. before
    a checkpoint claims it. ``nonfinite`` builds the error raised for a non-finite loss or
    gradient norm in a step that was not skipped.

    Each step's record carries its wall-clock ``time``, and with ``flops_per_step`` (the model's
    FLOPs) the achieved ``model_flops_per_s``; with the devices' ``peak_flops_per_s`` its MFU.
    """

    def __init__(self, sink: MetricsSink, *, total_steps: int, start_step: int,
                 steps_per_epoch: int, tokens_per_step: int, log_every: int, show: bool,
                 nonfinite: Callable[[int, dict[str, float]], Exception],
                 flops_per_step: float | None = None, peak_flops_per_s: float | None = None):
        from tqdm.auto import tqdm

        self.sink = sink
        self.history = sink.kept["metrics"]
        self.eval_history = sink.kept["eval"]
        self._total, self._per_epoch, self._tokens = total_steps, steps_per_epoch, tokens_per_step
        self._log_every, self._nonfinite = log_every, nonfinite
        self._flops, self._peak = flops_per_step, peak_flops_per_s
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                         disable=not show)
        self._pending: tuple | None = None
        self._last_done = time.perf_counter()

    def step(self, step: int, metrics: Any, data_wait: float, batch_digest: int) -> None:
        self.settle()
        self._pending = (step, metrics, data_wait, batch_digest)

    def settle(self) -> None:
        if self._pending is None:
            return
        step, metrics, data_wait, digest = self._pending
        self._pending = None
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        step_time, self._last_done = now - self._last_done, now
        if not values.get("skipped") and not (math.isfinite(values["loss"])
                                              and math.isfinite(values["grad_norm"])):
            raise self._nonfinite(step, values)
        record = {"step": step, "epoch": step / self._per_epoch, **values,
                  "tokens": self._tokens, "step_time_s": step_time, "data_wait_s": data_wait,
                  "batch_crc32": digest, "tokens_per_s": self._tokens / step_time,
                  "useful_tokens_per_s": values["useful_tokens"] / step_time,
                  "time": time.time()}
        if self._flops:
            record["model_flops_per_s"] = self._flops / step_time
            if self._peak:
                record["mfu"] = record["model_flops_per_s"] / self._peak
        self.history.append(record)
        self.sink.write("metrics", record)
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{values['loss']:.3f}", refresh=False)
        if step % self._log_every == 0:
            self.sink.flush()

    def evaluation(self, step: int, loss: float, perplexity: float) -> dict[str, Any]:
        """Record an evaluation; after step 0, also a plain log line (papermill and
        ``kubectl logs`` show these, not the bar)."""
        record = {"step": step, "eval_loss": loss, "eval_perplexity": perplexity}
        self.eval_history.append(record)
        self.sink.write("eval", record)
        recent = self.history[-self._log_every:]
        if step and recent and self.sink.enabled:
            self._bar.write(f"step {step}/{self._total}: "
                            f"train loss {np.mean([r['loss'] for r in recent]):.3f}, "
                            f"eval loss {loss:.3f} (perplexity {perplexity:.2f}), "
                            f"{np.mean([r['useful_tokens_per_s'] for r in recent]):,.0f} "
                            "useful tokens/s")
        self.sink.flush()
        self._last_done = time.perf_counter()  # evaluation time is no step's time
        return record

    def close(self) -> None:
        self._bar.close()
        self.sink.close()
