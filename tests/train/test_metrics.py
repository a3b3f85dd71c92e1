"""The training loop's records: one row per step, MFU where the devices' peak is known."""

import json

import numpy as np
import pytest

from gemmalab.train import metrics


def never_called(step, values):
    raise AssertionError("a finite step was reported as non-finite")


def one_step(tmp_path, **flops):
    sink = metrics.MetricsSink(str(tmp_path), enabled=True)
    log = metrics.StepLog(sink, total_steps=2, start_step=0, steps_per_epoch=2,
                          tokens_per_step=1024, log_every=1, show=False,
                          nonfinite=never_called, **flops)
    log.step(1, {"loss": np.float32(2.0), "grad_norm": np.float32(0.5),
                 "useful_tokens": np.float32(1000.0), "learning_rate": np.float32(1e-3)},
             data_wait=0.001, batch_digest=7)
    log.settle()
    log.close()
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_a_step_with_a_known_peak_reports_its_mfu(tmp_path):
    (record,) = one_step(tmp_path, flops_per_step=6e12, peak_flops_per_s=1e15)
    assert record["model_flops_per_s"] == pytest.approx(6e12 / record["step_time_s"], rel=1e-9)
    assert record["mfu"] == pytest.approx(record["model_flops_per_s"] / 1e15, rel=1e-9)
    assert record["time"] > 1.7e9  # wall clock, for time-to-quality plots


def test_without_a_peak_there_is_no_mfu(tmp_path):
    (record,) = one_step(tmp_path, flops_per_step=6e12)
    assert "model_flops_per_s" in record and "mfu" not in record
    (record,) = one_step(tmp_path)
    assert "model_flops_per_s" not in record


def test_a_step_on_a_cpu_with_a_measured_host_peak_reports_its_cpu_mfu(tmp_path):
    (record,) = one_step(tmp_path, flops_per_step=6e10, host_peak_flops_per_s=3e10)
    assert record["cpu_mfu"] == pytest.approx(record["model_flops_per_s"] / 3e10, rel=1e-9)
    assert "mfu" not in record  # MFU means against the accelerator's listed peak


def test_the_summary_reports_the_share_of_the_host_peak():
    accounting = metrics.FlopAccounting(model_flops_per_step=6e10, peak_flops_per_s=None,
                                        host_peak_flops_per_s=3e10)
    summary = accounting.summary(steps=4, seconds=10.0)
    assert summary["model_flops_per_s"] == pytest.approx(2.4e10)
    assert summary["host_matmul_flops_per_s"] == 3e10
    assert summary["cpu_mfu"] == pytest.approx(0.8)
    assert summary["mfu"] is None
    without = metrics.FlopAccounting(model_flops_per_step=6e10, peak_flops_per_s=1e15)
    summary = without.summary(steps=4, seconds=10.0)
    assert summary["cpu_mfu"] is None and summary["host_matmul_flops_per_s"] is None
    assert summary["mfu"] == pytest.approx(2.4e-5)


def test_a_step_followed_by_an_evaluation_is_timed_without_it(tmp_path):
    """The loop hands the evaluation over uncalled: the pending step is read (and timed) first,
    so the last step's row, and the run's useful tokens/s, leave the final evaluation out."""
    import time

    sink = metrics.MetricsSink(str(tmp_path), enabled=True)
    log = metrics.StepLog(sink, total_steps=1, start_step=0, steps_per_epoch=1,
                          tokens_per_step=1024, log_every=1, show=False, nonfinite=never_called)
    log.step(1, {"loss": np.float32(2.0), "grad_norm": np.float32(0.5),
                 "useful_tokens": np.float32(1000.0)}, data_wait=0.0, batch_digest=7)

    def slow_evaluation():
        time.sleep(0.5)
        return {"eval_loss": 1.0, "eval_perplexity": 2.7}

    started = time.perf_counter()
    log.evaluation(1, slow_evaluation)
    assert time.perf_counter() - started >= 0.5
    (record,) = log.history
    assert record["step_time_s"] < 0.25, record["step_time_s"]
    assert log.steps_ended < started + 0.25
    assert log.eval_history == [{"step": 1, "eval_loss": 1.0, "eval_perplexity": 2.7}]
    log.close()


@pytest.mark.parametrize("wait", [False, True])
def test_a_step_is_read_one_step_late_unless_the_loop_waits_for_each(tmp_path, wait):
    """On an accelerator the next step is dispatched before this one is read; on a CPU the loop
    waits for each step (``wait_for_each_step``), so its row is written as ``step`` returns."""
    sink = metrics.MetricsSink(str(tmp_path), enabled=True)
    log = metrics.StepLog(sink, total_steps=2, start_step=0, steps_per_epoch=2,
                          tokens_per_step=1024, log_every=1, show=False, nonfinite=never_called,
                          wait_for_each_step=wait)
    values = {"loss": np.float32(2.0), "grad_norm": np.float32(0.5),
              "useful_tokens": np.float32(1000.0)}
    log.step(1, values, data_wait=0.0, batch_digest=7)
    assert [r["step"] for r in log.history] == ([1] if wait else [])
    log.step(2, values, data_wait=0.0, batch_digest=8)
    assert [r["step"] for r in log.history] == ([1, 2] if wait else [1])
    log.close()
    assert [r["step"] for r in log.history] == [1, 2]
