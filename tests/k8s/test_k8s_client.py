"""gemmalab.k8s.client against the real API server of the local cluster (``make cluster``):
pods, their logs (kwok's fake containers log cluster/fake-container.log, read through the node
as a kubelet's), deletion and the kubeconfig fallback. The runs themselves: test_k8s_cluster.py.
"""

from __future__ import annotations

import itertools

import pytest
from kubernetes import client as k8s

from gemmalab.k8s import client, manifests
from gemmalab.k8s.config import ClusterConfig
from tests.helpers.k8s import wait_for, with_pods

# The first test starts the cluster, building its programs if not yet built (7-11 min cold).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
FAKE_LOG_LAST = ("kwok: on GKE this log holds the training notebook's output "
                 "(papermill --log-output).")
DELAY = {"pod-complete.stage.kwok.x-k8s.io/delay": "60s"}  # running while the test reads it


def submitted(cluster, namespace: str, name: str, topology: str = "1x1") -> list[str]:
    config = ClusterConfig(job_name=name, namespace=namespace, topology=topology)
    return client.submit(with_pods(manifests.build(config), DELAY), api_client=cluster.api)


def test_submit_phases_logs_and_delete(local_cluster, run_namespace):
    api = local_cluster.api
    assert submitted(local_cluster, run_namespace, "one-host") == ["Job/one-host"]
    assert submitted(local_cluster, run_namespace, "two-hosts", "2x4") == ["JobSet/two-hosts"]
    job = k8s.BatchV1Api(api).read_namespaced_job("one-host", run_namespace)
    assert job.spec.template.spec.service_account_name == "gemmalab-runner"
    phases = wait_for("both hosts running", lambda: (
        p := client.pod_phases("two-hosts", run_namespace, api_client=api)) and len(p) == 2
        and set(p.values()) == {"Running"} and p)
    assert all(name.startswith("two-hosts-slice-0-") for name in phases)
    assert client.pod_phases("nothing", run_namespace, api_client=api) == {}
    assert client.run_outcome("two-hosts", run_namespace, api_client=api) is None

    logs = client.tail_logs("two-hosts", run_namespace, tail_lines=1, api_client=api)
    assert set(logs) == set(phases) and set(logs.values()) == {FAKE_LOG_LAST + "\n"}
    pod = sorted(phases)[0]
    # kwok keeps a followed stream open (a kubelet closes it when the container ends): read
    # the three lines as they come, then close it.
    stream = client.follow_logs(pod, run_namespace, api_client=api)
    lines = list(itertools.islice(stream, 3))
    stream.close()
    assert lines[-1] == FAKE_LOG_LAST

    assert client.delete("two-hosts", run_namespace, api_client=api) == ["JobSet/two-hosts"]
    assert client.delete("two-hosts", run_namespace, api_client=api) == []
    assert client.delete("one-host", run_namespace, kind="Job", api_client=api) == [
        "Job/one-host"]
    # Background propagation: the pods go too (deleting a Job through the API orphans them
    # by default).
    wait_for("the pods to go", lambda: not client.pod_phases(
        "two-hosts", run_namespace, api_client=api) and not client.pod_phases(
        "one-host", run_namespace, api_client=api), timeout_s=60)
    assert client.run_outcome("two-hosts", run_namespace, api_client=api).state == "NotFound"
    with pytest.raises(ValueError, match="only Job and JobSet"):
        client.submit([{"kind": "Pod", "metadata": {"name": "x"}}], api_client=api)
    with pytest.raises(ValueError):
        client.delete("x", kind="Deployment", api_client=api)


def test_connect_falls_back_to_the_kubeconfig(local_cluster, run_namespace, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    monkeypatch.setenv("KUBECONFIG", str(local_cluster.layout.kubeconfig))
    default = k8s.Configuration.get_default_copy()
    try:
        assert client.pod_phases("other", run_namespace) == {}
        assert client.connect().configuration.host == local_cluster.layout.server
    finally:
        k8s.Configuration.set_default(default)
