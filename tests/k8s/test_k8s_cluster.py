"""End to end against a real Kubernetes (``make cluster``): the real API server, its schemas and
the JobSet and Kueue admission webhooks admit what gemmalab renders, Kueue queues it against its
quota, the JobSet and Job controllers run it on kwok's fake TPU v6e nodes, and ``launch.watch``
reports how it ended. kwok's fake containers run no program: they complete after a delay, or
fail, as the test asks through pod annotations (kwok's stages, gemmalab/k8s/cluster/stack.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from kubernetes import client as k8s

from gemmalab.errors import ConfigError
from gemmalab.inspect.sweep import summary_table
from gemmalab.k8s import client, launch, manifests
from gemmalab.k8s import sweep as sweeps
from gemmalab.k8s.cluster import stack
from gemmalab.k8s.config import ClusterConfig
from gemmalab.k8s.render import to_dict
from tests.helpers.k8s import make_queue, wait_for, with_pods, workload_admitted

# The first test starts the cluster, building its programs if not yet built (7-11 min cold).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parents[2]
TRAINING_FILES = ("single-host-v6e-1x1.yaml", "multihost-v6e-2x4.yaml",
                  "multislice-2x-v6e-2x4.yaml", "gpu-h200.yaml", "kueue-v6e.yaml",
                  "kueue-v6e-flex-start.yaml")
# kwok's stages read these pod annotations and labels (kustomize/stage/pod/*).
COMPLETE_DELAY = "pod-complete.stage.kwok.x-k8s.io/delay"
COMPLETE_WEIGHT = "pod-complete.stage.kwok.x-k8s.io/weight"
FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
FAIL_EXIT_CODE = "pod-container-running-failed.stage.kwok.x-k8s.io/exit-code"


def run_config(namespace: str, name: str, *, topology: str = "1x1", slices: int = 1,
               queue: str = "", **fields: Any) -> ClusterConfig:
    # kwok runs no notebook: the tiny recipe's batch (16) only has to split over 2 x 2x4.
    fields.setdefault("params", {"recipe": "tiny"})
    return ClusterConfig(job_name=name, namespace=namespace, accelerator="v6e",
                         topology=topology, num_slices=slices, queue=queue, **fields)


def pods(cluster, namespace: str, run: str) -> list[k8s.V1Pod]:
    return k8s.CoreV1Api(cluster.api).list_namespaced_pod(
        namespace, label_selector=f"{manifests.INSTANCE_LABEL}={run}").items


def node_pool(cluster, node: str) -> str:
    return k8s.CoreV1Api(cluster.api).read_node(node).metadata.labels[
        "cloud.google.com/gke-nodepool"]


# --- the committed manifests -----------------------------------------------------------------

@pytest.mark.parametrize("filename", TRAINING_FILES)
def test_committed_manifests_are_accepted_by_the_real_api_server(local_cluster, filename):
    """Every object of k8s/ passes the API server's schemas and the JobSet and Kueue webhooks
    (a server-side dry run of `kubectl apply`: nothing changes). JobSet's webhook refused the
    hyphenated failure-policy rule names these files once had; only the real webhook proves it."""
    out = local_cluster.kubectl("apply", "--dry-run=server", "-o", "name", "-f",
                                str(ROOT / "k8s" / filename))
    assert len(out.split()) == len([d for d in yaml.safe_load_all(
        (ROOT / "k8s" / filename).read_text()) if d])


# --- the three standard runs -----------------------------------------------------------------

STANDARD_RUNS = {"single-host-1x1": ("1x1", 1), "multihost-2x4": ("2x4", 1),
                 "multislice-2x2x4": ("2x4", 2)}


@pytest.mark.parametrize("case", STANDARD_RUNS)
def test_standard_runs_are_queued_run_and_reported(local_cluster, run_namespace, case):
    topology, slices = STANDARD_RUNS[case]
    queue = make_queue(local_cluster, run_namespace, {topology: slices})
    config = run_config(run_namespace, case, topology=topology, slices=slices, queue=queue)
    assert client.submit(manifests.build(config), api_client=local_cluster.api) == [
        f"{'JobSet' if config.multi_host else 'Job'}/{case}"]
    seen: list[dict[str, str]] = []
    outcome = launch.watch(case, run_namespace, timeout_s=150, poll_s=0.5,
                           on_change=seen.append, api_client=local_cluster.api)
    assert outcome.state == "Succeeded", outcome
    assert workload_admitted(local_cluster, run_namespace, case)
    finished = pods(local_cluster, run_namespace, case)
    assert len(finished) == config.total_hosts
    assert all(pod.status.phase == "Succeeded" for pod in finished)
    assert any("Running" in phases.values() for phases in seen)
    # Each slice on a node pool (= physical slice) of its own, all its hosts in it: JobSet's
    # exclusive placement, keyed on GKE's node-pool label.
    pools = {}
    for pod in finished:
        slice_index = pod.metadata.annotations.get(manifests.JOB_INDEX_ANNOTATION, "0")
        pools.setdefault(slice_index, set()).add(node_pool(local_cluster, pod.spec.node_name))
    assert all(len(p) == 1 for p in pools.values()), pools
    assert len(set.union(*pools.values())) == slices
    logs = client.tail_logs(case, run_namespace, api_client=local_cluster.api)
    assert set(logs) == {pod.metadata.name for pod in finished}
    assert client.delete(case, run_namespace, api_client=local_cluster.api) == [
        f"{'JobSet' if config.multi_host else 'Job'}/{case}"]
    wait_for("the run's pods to go", lambda: not pods(local_cluster, run_namespace, case))
    assert client.run_outcome(case, run_namespace,
                              api_client=local_cluster.api).state == "NotFound"


# --- Kueue's quota ---------------------------------------------------------------------------

def test_a_run_waits_for_quota_then_runs(local_cluster, run_namespace):
    """A ClusterQueue of 8 chips: a second 8-chip run stays queued (its Workload not admitted,
    its JobSet suspended, no pods) until the first ends, then runs."""
    queue = make_queue(local_cluster, run_namespace, {"2x4": 1})
    first, second = (with_pods(manifests.build(run_config(
        run_namespace, name, topology="2x4", queue=queue)), {COMPLETE_DELAY: delay})
        for name, delay in (("first", "12s"), ("second", "1s")))
    client.submit(first, api_client=local_cluster.api)
    wait_for("the first run to be admitted",
             lambda: workload_admitted(local_cluster, run_namespace, "first"))
    client.submit(second, api_client=local_cluster.api)
    wait_for("the second run's Workload",
             lambda: workload_admitted(local_cluster, run_namespace, "second") is not None)
    time.sleep(2)
    assert workload_admitted(local_cluster, run_namespace, "second") is False
    assert not pods(local_cluster, run_namespace, "second")
    assert client.run_outcome("first", run_namespace, api_client=local_cluster.api) is None
    outcome = launch.watch("first", run_namespace, timeout_s=90, poll_s=0.5,
                           api_client=local_cluster.api)
    assert outcome.state == "Succeeded"
    outcome = launch.watch("second", run_namespace, timeout_s=90, poll_s=0.5,
                           api_client=local_cluster.api)
    assert outcome.state == "Succeeded"
    assert workload_admitted(local_cluster, run_namespace, "second")


def test_a_sweep_on_a_two_run_quota_runs_two_at_a_time(local_cluster, run_namespace):
    queue = make_queue(local_cluster, run_namespace, {"1x1": 2})
    fields = {"job_name": "lr", "namespace": run_namespace, "accelerator": "v6e",
              "topology": "1x1", "queue": queue}
    points = sweeps.cluster_sweep(fields, sweeps.sweep_values(
        ["learning_rate: [1e-4, 2e-4, 4e-4, 8e-4]"], ()))
    names = [p.job_name for p in points]
    assert len(names) == 4
    for point in points:
        client.submit(with_pods(manifests.build(point), {COMPLETE_DELAY: "4s"}),
                      api_client=local_cluster.api)
    most_running, states = 0, {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        states = launch.run_states(names, run_namespace, api_client=local_cluster.api)
        running = sum(state == "Running" for state in states.values())
        most_running = max(most_running, running)
        assert running <= 2, states
        if all(state == "Succeeded" for state in states.values()):
            break
        time.sleep(0.3)
    assert set(states.values()) == {"Succeeded"}, states
    assert most_running == 2
    # launch.ipynb's table: each point's figures (none: kwok runs no notebook) and state.
    table = summary_table({name: f"/nonexistent/{name}" for name in names})
    table["run_state"] = pd.Series(launch.run_states(names, run_namespace,
                                                     api_client=local_cluster.api))
    assert list(table.index) == names
    assert list(table["run_state"]) == ["Succeeded"] * 4


# --- faults ----------------------------------------------------------------------------------

def test_a_preempted_host_restarts_the_jobset_and_the_watch_goes_on(local_cluster,
                                                                    run_namespace):
    """An eviction (DisruptionTarget) fails the slice's Job by its podFailurePolicy; the JobSet's
    restartAfterDisruption rule restarts the set, without counting against maxRestarts (0); the
    watch, running meanwhile, ends only when the restarted run completes."""
    name = "preempted"
    objects = with_pods(manifests.build(run_config(run_namespace, name, topology="2x4")),
                        {COMPLETE_DELAY: "8s"})
    client.submit(objects, api_client=local_cluster.api)
    result: dict[str, Any] = {}
    watcher = threading.Thread(target=lambda: result.update(outcome=launch.watch(
        name, run_namespace, timeout_s=120, poll_s=0.5, api_client=local_cluster.api)))
    watcher.start()
    victim = wait_for("a running pod", lambda: next(
        (p for p in pods(local_cluster, run_namespace, name) if p.status.phase == "Running"),
        None))
    k8s.CoreV1Api(local_cluster.api).create_namespaced_pod_eviction(
        victim.metadata.name, run_namespace,
        {"metadata": {"name": victim.metadata.name, "namespace": run_namespace}})
    jobsets = k8s.CustomObjectsApi(local_cluster.api)

    def restarts() -> int:
        return (jobsets.get_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", run_namespace, "jobsets", name).get("status")
            or {}).get("restarts", 0)

    wait_for("the JobSet to restart", restarts, timeout_s=60)
    assert watcher.is_alive() and "outcome" not in result  # the watch did not end early
    watcher.join(timeout=120)
    assert result["outcome"].state == "Succeeded", result
    assert restarts() == 1


def test_a_failure_that_is_not_retriable_ends_the_run_failed_and_says_why(local_cluster,
                                                                          run_namespace):
    name = "crashes"
    objects = with_pods(manifests.build(run_config(run_namespace, name, topology="2x4")),
                        {FAIL_EXIT_CODE: "1", COMPLETE_WEIGHT: "0"}, {FAIL_LABEL: "true"})
    client.submit(objects, api_client=local_cluster.api)
    outcome = launch.watch(name, run_namespace, timeout_s=90, poll_s=0.5,
                           api_client=local_cluster.api)
    assert outcome.state == "Failed"
    assert outcome.reason and outcome.message, outcome
    assert "\n" not in str(outcome)
    print(outcome)


@pytest.mark.parametrize("topology", ["1x1", "2x4"])
def test_active_deadline_ends_the_run_at_its_deadline(local_cluster, run_namespace, topology):
    name = f"deadline-{topology}"
    objects = with_pods(manifests.build(run_config(run_namespace, name, topology=topology,
                                                   active_deadline_s=4)),
                        {COMPLETE_DELAY: "300s"})
    started = time.monotonic()
    client.submit(objects, api_client=local_cluster.api)
    outcome = launch.watch(name, run_namespace, timeout_s=90, poll_s=0.5,
                           api_client=local_cluster.api)
    assert outcome.state == "Failed", outcome
    assert "DeadlineExceeded" in str(outcome) or "deadline" in str(outcome).lower(), outcome
    assert time.monotonic() - started < 60  # at the deadline, not after the 300 s "training"
    if topology == "2x4":  # failAtDeadline: not restarted with a fresh deadline
        status = k8s.CustomObjectsApi(local_cluster.api).get_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", run_namespace, "jobsets", name)["status"]
        assert status.get("restarts", 0) == 0


# --- bad objects, refused by the real server before anything runs ----------------------------

def _rename(name: str):
    def change(body):
        body["metadata"]["name"] = name
        for label in ("app.kubernetes.io/instance",):
            body["metadata"]["labels"][label] = name[:63]
    return change


def _hyphenated_rule(body):
    body["spec"]["failurePolicy"]["rules"][0]["name"] = "restart-after-disruption"


def _replicas_as_text(body):
    body["spec"]["replicatedJobs"][0]["replicas"] = "two"


def _misspelt_field(body):
    body["spec"]["network"]["enableDnsHostnames"] = True  # the field is enableDNSHostnames


# What each refusal names, as the real server words it.
BAD_OBJECTS = {
    # JobSet's webhook: the names of its Jobs and pods must stay DNS labels.
    "over-long name": (_rename("a" * 60),
                       'spec.replicatedJobs[0].name: Invalid value: "aaaaaaaaaaaaaaaaaaaaaaaaaaaa'
                       'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-slice-0": JobSet name is too long'),
    "hyphenated failure-policy rule": (
        _hyphenated_rule, "invalid failure policy rule name 'restart-after-disruption'"),
    # JobSet's defaulting webhook decodes the object before the schema is applied.
    "schema: replicas as text": (_replicas_as_text, "spec.replicatedJobs.replicas of type int32"),
    "schema: a misspelt field": (_misspelt_field, "spec.network.enableDnsHostnames"),
}


@pytest.mark.parametrize("case", BAD_OBJECTS)
def test_bad_objects_are_refused_in_one_line_before_anything_runs(local_cluster, run_namespace,
                                                                  case):
    change, field = BAD_OBJECTS[case]
    good = to_dict(manifests.build(run_config(run_namespace, "good", topology="2x4"))[0])
    bad = to_dict(manifests.build(run_config(run_namespace, "bad", topology="2x4"))[0])
    change(bad)
    with pytest.raises(ConfigError) as refused:
        client.submit([good, bad], api_client=local_cluster.api)
    message = str(refused.value)
    assert "\n" not in message and field in message, message
    assert message.startswith(f"JobSet/{bad['metadata']['name']}: the API server refused it")
    # The good one before it was not created either: all are dry-run first.
    assert client.run_outcome("good", run_namespace,
                              api_client=local_cluster.api).state == "NotFound"


def test_a_queue_that_does_not_exist_is_refused(local_cluster, run_namespace):
    objects = manifests.build(run_config(run_namespace, "lost", queue="no-such-queue"))
    with pytest.raises(ConfigError, match=r"^queue: there is no Kueue LocalQueue "
                                          r"'no-such-queue' in namespace .*Fix: create it"):
        client.submit(objects, api_client=local_cluster.api)
    assert client.run_outcome("lost", run_namespace,
                              api_client=local_cluster.api).state == "NotFound"


# --- the kit's own command line and notebook, unchanged ----------------------------------------

def _env(cluster) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": str(cluster.layout.kubeconfig)}


def test_the_command_line_goes_render_submit_watch_logs_delete(local_cluster, run_namespace):
    queue = make_queue(local_cluster, run_namespace, {"1x1": 1})

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gemmalab.k8s", *args], env=_env(
            local_cluster), capture_output=True, text=True, timeout=120, cwd=ROOT)

    submitted = cli("job", "--name", "cli-run", "--namespace", run_namespace, "--queue", queue,
                    "--submit")
    assert submitted.returncode == 0, submitted.stderr
    assert "created Job/cli-run" in submitted.stderr
    watched = cli("watch", "cli-run", "--namespace", run_namespace, "--poll", "0.5")
    assert watched.returncode == 0 and "cli-run: Succeeded" in watched.stdout, watched
    logs = cli("logs", "cli-run", "--namespace", run_namespace)
    assert logs.returncode == 0 and "cli-run" in logs.stdout, logs
    deleted = cli("delete", "cli-run", "--namespace", run_namespace)
    assert deleted.returncode == 0 and "Job/cli-run" in deleted.stdout, deleted
    refused = cli("job", "--name", "cli-lost", "--namespace", run_namespace, "--queue", "nope",
                  "--submit")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith("ConfigError: queue: there is no")


def test_launch_notebook_submits_watches_and_deletes(local_cluster, run_namespace, tmp_path):
    import papermill

    queue = make_queue(local_cluster, run_namespace, {"1x1": 1})
    os.environ["KUBECONFIG"] = str(local_cluster.layout.kubeconfig)
    try:
        papermill.execute_notebook(
            str(ROOT / "notebooks" / "launch.ipynb"), str(tmp_path / "launch.ipynb"),
            parameters={"job_name": "nb-run", "namespace": run_namespace, "queue": queue,
                        "submit": True, "delete_when_done": True, "watch_minutes": 2,
                        "outputs_root": str(tmp_path / "outputs")},
            kernel_name="python3", progress_bar=False, cwd=str(ROOT / "notebooks"))
    finally:
        del os.environ["KUBECONFIG"]
    text = json.dumps(json.loads((tmp_path / "launch.ipynb").read_text())["cells"])
    assert "run: Succeeded" in text
    assert "deleted: ['Job/nb-run']" in text
    assert client.run_outcome("nb-run", run_namespace,
                              api_client=local_cluster.api).state == "NotFound"


def test_a_second_make_cluster_reuses_the_running_one(local_cluster):
    said: list[str] = []
    started = time.monotonic()
    assert stack.up(local_cluster.layout, log=said.append) == local_cluster.layout
    assert time.monotonic() - started < 10
    assert said == [f"reusing the cluster already running at {local_cluster.layout.server}"]
