"""launch.ipynb's helpers: watching pod phases (against a stub client) and reading metrics."""

import json

from gemmalab.k8s import launch


def test_watch_reports_changes_until_every_pod_finished(monkeypatch):
    timeline = iter([{"a": "Pending", "b": "Pending"}, {"a": "Running", "b": "Pending"},
                     {"a": "Running", "b": "Pending"}, {"a": "Succeeded", "b": "Succeeded"}])
    monkeypatch.setattr(launch.k8s_client, "pod_phases", lambda *a, **k: next(timeline))
    seen = []
    final = launch.watch("run", poll_s=0, on_change=seen.append)
    assert final == {"a": "Succeeded", "b": "Succeeded"}
    assert len(seen) == 3  # the repeated state is not reported twice


def test_watch_stops_at_the_first_failure_or_the_deadline(monkeypatch):
    monkeypatch.setattr(launch.k8s_client, "pod_phases",
                        lambda *a, **k: {"a": "Failed", "b": "Running"})
    assert launch.watch("run", poll_s=0)["a"] == "Failed"
    monkeypatch.setattr(launch.k8s_client, "pod_phases", lambda *a, **k: {"a": "Pending"})
    assert launch.watch("run", poll_s=0, timeout_s=0) == {"a": "Pending"}


def test_run_metrics_reads_what_the_trainer_writes(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "loss": 5.0 - i}) + "\n" for i in range(1, 4)))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 0, "eval_loss": 6.0}) + "\n")
    history, evals = launch.run_metrics(str(tmp_path))
    assert [r["loss"] for r in history] == [4.0, 3.0, 2.0] and evals[0]["eval_loss"] == 6.0
    assert launch.run_metrics(str(tmp_path / "not-yet")) == ([], [])
