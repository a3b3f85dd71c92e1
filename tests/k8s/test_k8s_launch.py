"""launch.ipynb's helpers: watching a run (against a stub client) and reading metrics. The same
against a real cluster: test_k8s_cluster.py."""

import json

from gemmalab.k8s import launch
from gemmalab.k8s.client import RunOutcome


def test_watch_reports_changes_until_the_run_ends(monkeypatch):
    timeline = iter([{"a": "Pending", "b": "Pending"}, {"a": "Running", "b": "Pending"},
                     {"a": "Running", "b": "Pending"}, {"a": "Succeeded", "b": "Succeeded"}])
    outcomes = iter([None, None, None, RunOutcome("Succeeded")])
    monkeypatch.setattr(launch.k8s_client, "pod_phases", lambda *a, **k: next(timeline))
    monkeypatch.setattr(launch.k8s_client, "run_outcome", lambda *a, **k: next(outcomes))
    seen = []
    assert launch.watch("run", poll_s=0, on_change=seen.append) == RunOutcome("Succeeded")
    assert seen[-1] == {"a": "Succeeded", "b": "Succeeded"}
    assert len(seen) == 3  # the repeated state is not reported twice


def test_a_failed_pod_does_not_end_the_watch_while_the_run_retries(monkeypatch):
    """A preempted host's pod fails, the failure policy replaces it: the run goes on."""
    timeline = iter([{"a": "Failed", "b": "Running"}, {"a2": "Running", "b": "Running"},
                     {"a2": "Failed", "b": "Failed"}])
    outcomes = iter([None, None, RunOutcome("Failed", "FailedJobs", "slice-0 failed")])
    monkeypatch.setattr(launch.k8s_client, "pod_phases", lambda *a, **k: next(timeline))
    monkeypatch.setattr(launch.k8s_client, "run_outcome", lambda *a, **k: next(outcomes))
    seen = []
    outcome = launch.watch("run", poll_s=0, on_change=seen.append)
    assert str(outcome) == "Failed (FailedJobs: slice-0 failed)"
    assert len(seen) == 3
    monkeypatch.setattr(launch.k8s_client, "pod_phases", lambda *a, **k: {"a": "Pending"})
    monkeypatch.setattr(launch.k8s_client, "run_outcome", lambda *a, **k: None)
    assert launch.watch("run", poll_s=0, timeout_s=0).state == "Running"


def test_run_metrics_reads_what_the_trainer_writes(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "loss": 5.0 - i}) + "\n" for i in range(1, 4)))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 0, "eval_loss": 6.0}) + "\n")
    history, evals = launch.run_metrics(str(tmp_path))
    assert [r["loss"] for r in history] == [4.0, 3.0, 2.0] and evals[0]["eval_loss"] == 6.0
    assert launch.run_metrics(str(tmp_path / "not-yet")) == ([], [])
