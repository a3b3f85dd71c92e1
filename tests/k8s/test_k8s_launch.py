"""launch.ipynb's helpers: watching a run (against a stub client) and reading metrics. The same
against a real cluster: test_k8s_cluster.py."""

import json

import pytest

from gemmalab import storage
from gemmalab.errors import ConfigError
from gemmalab.k8s import launch
from gemmalab.k8s.client import RunOutcome
from gemmalab.k8s.config import ClusterConfig


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


def test_an_outputs_bucket_that_cannot_be_read_from_here_is_one_line_naming_outputs_root(
        tmp_path, monkeypatch):
    """As on a machine with no route to Google: the read that failed deep in TensorFlow
    ("Could not resolve host: www.googleapis.com") is refused before it, by name."""
    bucket = ClusterConfig(outputs_bucket="my-project-gemmalab-outputs")
    assert launch.outputs_root(str(tmp_path) + "/", bucket) == str(tmp_path)

    class Unreachable:
        def exists(self):
            raise RuntimeError("Could not resolve host: www.googleapis.com\nmore detail")

    monkeypatch.setattr(storage, "_gcs_credentials_found", lambda: True)
    monkeypatch.setattr(storage, "_gcs_path", lambda path: Unreachable())
    with pytest.raises(ConfigError) as raised:
        launch.outputs_root("", bucket)
    message = str(raised.value)
    assert message.startswith("outputs_root: cannot reach gs://my-project-gemmalab-outputs "
                              "(RuntimeError: Could not resolve host: www.googleapis.com). "
                              "Fix: set outputs_root to a folder")
    assert "\n" not in message
    monkeypatch.setattr(storage, "_gcs_credentials_found", lambda: False)
    with pytest.raises(ConfigError, match="^outputs_root: gs://b is on Google Cloud Storage but "
                       "no credentials were found"):
        launch.outputs_root("gs://b", bucket)
    # Nothing submitted, nothing read: the bucket is only named (launch.ipynb's submit=False).
    assert launch.outputs_root("", ClusterConfig(outputs_bucket="bkt"), read=False) == "gs://bkt"


def test_on_the_local_cluster_outputs_are_read_where_its_pods_write_them(tmp_path):
    config = ClusterConfig(accelerator="cpu", local_outputs_dir=str(tmp_path))
    assert launch.outputs_root("", config) == str(tmp_path)
    default = ClusterConfig(accelerator="cpu")
    assert launch.outputs_root("", default, read=False) == default.resolved_local_volumes()[1]
