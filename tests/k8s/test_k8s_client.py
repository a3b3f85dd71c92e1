"""gemmalab.k8s.client against a stub of the Kubernetes API.

The stub is a tiny HTTP server on 127.0.0.1 (an ephemeral port, in a thread) that answers the
few Kubernetes API paths the client uses (create Job/JobSet, list pods, pod logs, delete) with
canned JSON and records every request. It is not Kubernetes: it checks the requests the client
sends, the way a real API server would receive them.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client as k8s

from gemmalab.k8s import client, manifests
from gemmalab.k8s.config import ClusterConfig

JOBSET_PATH = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets"
JOB_PATH = "/apis/batch/v1/namespaces/{ns}/jobs"
PODS = {"gemma3-v6e-2x4-slice-0-1-bbbbb": "Pending", "gemma3-v6e-2x4-slice-0-0-aaaaa": "Running"}
CONDITIONS: dict[str, list[dict]] = {}  # a Job's or JobSet's path: its status.conditions


def _pod(name: str, phase: str) -> dict:
    return {"metadata": {"name": name, "namespace": "team-a"}, "status": {"phase": phase}}


class StubKubernetesAPI(BaseHTTPRequestHandler):
    requests: list[dict]
    existing: set[str]

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def _reply(self, status: int, body: dict | str) -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type",
                         "text/plain" if isinstance(body, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> tuple[str, dict[str, list[str]], dict | None]:
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        query = urllib.parse.parse_qs(url.query)
        self.requests.append({"method": self.command, "path": url.path, "query": query,
                              "body": body})
        return url.path, query, body

    def do_POST(self) -> None:
        path, _, body = self._record()
        if path in (JOB_PATH.format(ns="team-a"), JOBSET_PATH.format(ns="team-a")):
            self._reply(201, body)
        else:
            self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

    def do_GET(self) -> None:
        path, query, _ = self._record()
        if path == "/api/v1/namespaces/team-a/pods":
            selector = query.get("labelSelector", [""])[0]
            items = ([_pod(n, p) for n, p in PODS.items()]
                     if selector == "app.kubernetes.io/instance=gemma3-v6e-2x4" else [])
            self._reply(200, {"kind": "PodList", "apiVersion": "v1", "items": items})
        elif path.startswith(JOBSET_PATH.format(ns="team-a") + "/") and path in self.existing:
            self._reply(200, {"kind": "JobSet", "metadata": {"name": path.split("/")[-1]},
                              "status": {"conditions": CONDITIONS[path]}})
        elif path.startswith(JOB_PATH.format(ns="team-a") + "/") and path in self.existing:
            self._reply(200, {"kind": "Job", "apiVersion": "batch/v1",
                              "metadata": {"name": path.split("/")[-1]},
                              "status": {"conditions": CONDITIONS[path]}})
        elif path.startswith("/api/v1/namespaces/team-a/pods/") and path.endswith("/log"):
            pod = path.split("/")[-2]
            if PODS.get(pod) != "Running":
                self._reply(400, {"kind": "Status", "code": 400, "reason": "BadRequest",
                                  "message": "container is waiting to start"})
            else:
                self._reply(200, "step 10 loss 3.1\nstep 20 loss 2.7\n")
        else:
            self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

    def do_DELETE(self) -> None:
        path, _, _ = self._record()
        if path in self.existing:
            self._reply(200, {"kind": "Status", "status": "Success"})
        else:
            self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})


@pytest.fixture
def api() -> Iterator[tuple[k8s.ApiClient, list[dict], set[str]]]:
    requests: list[dict] = []
    existing: set[str] = set()
    handler = type("Handler", (StubKubernetesAPI,), {"requests": requests, "existing": existing})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01},
                              daemon=True)
    thread.start()
    configuration = k8s.Configuration(host=f"http://127.0.0.1:{server.server_port}")
    api_client = k8s.ApiClient(configuration)
    try:
        yield api_client, requests, existing
    finally:
        api_client.close()
        server.shutdown()
        server.server_close()


def test_submit_creates_a_job_and_a_jobset(api):
    api_client, requests, _ = api
    job = manifests.build(ClusterConfig(job_name="one-host"))
    jobset = manifests.build(ClusterConfig(job_name="two-hosts", topology="2x4"))
    created = client.submit([*job, *jobset], "team-a", api_client=api_client)
    assert created == ["Job/one-host", "JobSet/two-hosts"]
    first, second = requests
    assert (first["method"], first["path"]) == ("POST", JOB_PATH.format(ns="team-a"))
    assert first["body"]["kind"] == "Job" and first["body"]["metadata"]["namespace"] == "team-a"
    assert first["body"]["spec"]["template"]["spec"]["serviceAccountName"] == "gemmalab-runner"
    assert (second["method"], second["path"]) == ("POST", JOBSET_PATH.format(ns="team-a"))
    assert second["body"]["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 2
    with pytest.raises(ValueError, match="only Job and JobSet"):
        client.submit([{"kind": "Pod", "metadata": {"name": "x"}}], api_client=api_client)


def test_run_outcome_reads_the_jobset_or_job_conditions(api, monkeypatch):
    """Succeeded/Failed from the run's own object, None while it runs or restarts, NotFound when
    it is gone; a JobSet is asked first (404 also where its CRD is not installed)."""
    api_client, requests, existing = api
    jobset = JOBSET_PATH.format(ns="team-a") + "/multi"
    job = JOB_PATH.format(ns="team-a") + "/single"
    existing.update({jobset, job})
    restarting = [{"type": "RestartingJobSet", "status": "True"}]
    for path, conditions, expected in [
            (jobset, restarting, None),
            (jobset, [*restarting, {"type": "Completed", "status": "True"}], "Succeeded"),
            (jobset, [{"type": "Failed", "status": "True"}], "Failed"),
            (job, [], None),
            (job, [{"type": "Failed", "status": "False"}], None),
            (job, [{"type": "Complete", "status": "True"}], "Succeeded"),
            (job, [{"type": "Failed", "status": "True"}], "Failed")]:
        monkeypatch.setitem(CONDITIONS, path, conditions)
        name = path.rsplit("/", 1)[-1]
        assert client.run_outcome(name, "team-a", api_client=api_client) == expected, conditions
    assert client.run_outcome("gone", "team-a", api_client=api_client) == "NotFound"
    assert [r["path"] for r in requests[-2:]] == [JOBSET_PATH.format(ns="team-a") + "/gone",
                                                  JOB_PATH.format(ns="team-a") + "/gone"]


def test_pod_phases_and_logs(api):
    api_client, requests, _ = api
    phases = client.pod_phases("gemma3-v6e-2x4", "team-a", api_client=api_client)
    assert phases == {"gemma3-v6e-2x4-slice-0-0-aaaaa": "Running",
                      "gemma3-v6e-2x4-slice-0-1-bbbbb": "Pending"}
    assert client.pod_phases("other", "team-a", api_client=api_client) == {}
    logs = client.tail_logs("gemma3-v6e-2x4", "team-a", tail_lines=2, api_client=api_client)
    assert logs["gemma3-v6e-2x4-slice-0-0-aaaaa"] == "step 10 loss 3.1\nstep 20 loss 2.7\n"
    assert logs["gemma3-v6e-2x4-slice-0-1-bbbbb"].startswith("<no logs yet: 400")
    log_requests = [r for r in requests if r["path"].endswith("/log")]
    assert all(r["query"]["container"] == ["train"] and r["query"]["tailLines"] == ["2"]
               for r in log_requests)
    lines = list(client.follow_logs("gemma3-v6e-2x4-slice-0-0-aaaaa", "team-a",
                                    api_client=api_client))
    assert lines == ["step 10 loss 3.1", "step 20 loss 2.7"]
    assert requests[-1]["query"]["follow"] == ["true"]


def test_delete_removes_pods_too_and_ignores_what_is_gone(api):
    api_client, requests, existing = api
    existing.add(JOBSET_PATH.format(ns="team-a") + "/gemma3-v6e-2x4")
    assert client.delete("gemma3-v6e-2x4", "team-a", api_client=api_client) == [
        "JobSet/gemma3-v6e-2x4"]
    assert [r["method"] for r in requests] == ["DELETE", "DELETE"]  # JobSet, then Job (404)
    assert all(r["body"]["propagationPolicy"] == "Background" for r in requests)
    assert client.delete("gemma3-v6e-2x4", "team-a", kind="Job", api_client=api_client) == []
    with pytest.raises(ValueError):
        client.delete("x", kind="Deployment", api_client=api_client)


def test_connect_falls_back_to_the_kubeconfig(api, tmp_path, monkeypatch):
    api_client, requests, _ = api
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "stub",
        "clusters": [{"name": "stub", "cluster": {"server": api_client.configuration.host}}],
        "users": [{"name": "stub", "user": {"token": "not-a-secret"}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
    }))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    default = k8s.Configuration.get_default_copy()
    try:
        assert client.pod_phases("other", "team-a") == {}
    finally:
        k8s.Configuration.set_default(default)
    assert requests[-1]["path"] == "/api/v1/namespaces/team-a/pods"
