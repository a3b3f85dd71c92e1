"""Submit, watch, read logs and delete training runs through the Kubernetes API (no kubectl).

Every function takes an optional ``api_client`` (a ``kubernetes.client.ApiClient``); without
one, the in-cluster configuration is used when running in a pod (a JupyterHub server), else the
local kubeconfig (``gcloud container clusters get-credentials`` writes it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

from kubernetes import client

from gemmalab.errors import ConfigError
from gemmalab.k8s.kueue import KUEUE_API_VERSION, QUEUE_LABEL
from gemmalab.k8s.manifests import CONTAINER, INSTANCE_LABEL, JOBSET_API_VERSION
from gemmalab.k8s.render import to_dict

JOBSET_GROUP, JOBSET_VERSION = JOBSET_API_VERSION.split("/")
JOBSET_PLURAL = "jobsets"
NOT_FOUND = 404


def connect(api_client: client.ApiClient | None = None) -> client.ApiClient:
    """``api_client``, or one configured from the pod's service account or ~/.kube/config."""
    if api_client is not None:
        return api_client
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        # $KUBECONFIG read now, not when `kubernetes` was imported; None = ~/.kube/config.
        path = os.environ.get("KUBECONFIG")
        try:
            config.load_kube_config(config_file=path)
        except (config.ConfigException, OSError) as e:
            raise ConfigError("KUBECONFIG", f"no cluster credentials in {path or '~/.kube/config'}"
                              f" ({' '.join(str(e).split())[:200]})",
                              "export KUBECONFIG=... as `make cluster` prints it, or run `gcloud "
                              "container clusters get-credentials CLUSTER`") from None
    return client.ApiClient()


def unreachable_message(error: Exception) -> str:
    """One line for urllib3's MaxRetryError: no API server answered where KUBECONFIG says."""
    host = getattr(getattr(error, "pool", None), "host", None)
    port = getattr(getattr(error, "pool", None), "port", None)
    where = f"{host}:{port}" if host else "the API server"
    return (f"KUBECONFIG: nothing answers at {where} (the cluster is down?). Fix: start it "
            "(make cluster) or point KUBECONFIG at a running one")


def submit(objects: Iterable[Any], namespace: str | None = None, *,
           api_client: client.ApiClient | None = None) -> list[str]:
    """Create each Job/JobSet; returns ``["JobSet/name", ...]``. Namespace: argument, else the
    object's, else ``default``.

    Nothing is created unless all are accepted: every object first goes through the API
    server's dry run (its schemas and the JobSet and Kueue admission webhooks), and a queued run
    whose Kueue LocalQueue does not exist is refused (Kueue would leave it pending forever). A
    refusal is a one-line ``ConfigError`` naming the object and the field the server names.
    """
    api = connect(api_client)
    bodies = []
    for obj in objects:
        body = to_dict(obj)
        if body.get("kind") not in ("Job", "JobSet"):
            raise ValueError(f"cannot submit a {body.get('kind')}: only Job and JobSet")
        body["metadata"]["namespace"] = (namespace or body["metadata"].get("namespace")
                                         or "default")
        bodies.append(body)
    for body in bodies:
        _require_queue(body, api)
        _create(body, api, dry_run=True)
    return [_create(body, api, dry_run=False) for body in bodies]


def _create(body: dict[str, Any], api: client.ApiClient, *, dry_run: bool) -> str:
    kind, name, ns = body["kind"], body["metadata"]["name"], body["metadata"]["namespace"]
    # Strict: a misspelt field is refused, not dropped silently (the API's default only warns).
    extra = {"field_validation": "Strict", **({"dry_run": "All"} if dry_run else {})}
    try:
        if kind == "Job":
            client.BatchV1Api(api).create_namespaced_job(ns, body, **extra)
        else:
            client.CustomObjectsApi(api).create_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, ns, JOBSET_PLURAL, body, **extra)
    except client.ApiException as e:
        if e.status == NOT_FOUND and kind == "JobSet":
            raise ConfigError(f"JobSet/{name}", "the cluster has no JobSet API",
                              "install JobSet (scripts/gke/install-jobset.sh; make cluster "
                              "has it)") from None
        if e.status is None or not 400 <= e.status < 500:
            raise
        raise ConfigError(f"{kind}/{name}", f"the API server refused it: {refusal(e)}",
                          "change the field it names (in the ClusterConfig or manifest that "
                          "renders it) and submit again") from None
    return f"{kind}/{name}"


def refusal(error: client.ApiException) -> str:
    """The API server's reason for a refusal as one line: its message, which names the field
    (``spec.failurePolicy.rules[0].name: Invalid value: ...``)."""
    try:
        message = json.loads(error.body or "{}").get("message") or ""
    except ValueError:
        message = ""
    message = message or error.reason or f"HTTP {error.status}"
    return " ".join(message.split())


def _require_queue(body: dict[str, Any], api: client.ApiClient) -> None:
    queue = (body["metadata"].get("labels") or {}).get(QUEUE_LABEL)
    if not queue:
        return
    ns = body["metadata"]["namespace"]
    group, version = KUEUE_API_VERSION.split("/")
    try:
        client.CustomObjectsApi(api).get_namespaced_custom_object(
            group, version, ns, "localqueues", queue)
    except client.ApiException as e:
        if e.status != NOT_FOUND:
            raise
        raise ConfigError("queue", f"there is no Kueue LocalQueue {queue!r} in namespace {ns} "
                          f"({refusal(e)}), so the run would wait forever",
                          f"create it (kubectl apply -f k8s/kueue-v6e.yaml, or "
                          f"scripts/gke/install-kueue.sh) or name an existing one: kubectl get "
                          f"localqueues -n {ns}") from None


def _pods(job_name: str, namespace: str, api: client.ApiClient) -> list[client.V1Pod]:
    pods = client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"{INSTANCE_LABEL}={job_name}").items
    return sorted(pods, key=lambda pod: pod.metadata.name)


def pod_phases(job_name: str, namespace: str = "default", *,
               api_client: client.ApiClient | None = None) -> dict[str, str]:
    """``{pod name: phase}`` (Pending, Running, Succeeded, Failed) for every pod of the run."""
    api = connect(api_client)
    return {pod.metadata.name: pod.status.phase if pod.status else "Unknown"
            for pod in _pods(job_name, namespace, api)}


# The terminal conditions of a JobSet (jobset.x-k8s.io) and of a batch/v1 Job.
JOBSET_OUTCOMES = {"Completed": "Succeeded", "Failed": "Failed"}
JOB_OUTCOMES = {"Complete": "Succeeded", "Failed": "Failed"}


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """How a run ended (``state``: Succeeded, Failed, NotFound; ``launch.watch`` adds Running at
    its deadline) and why, as its JobSet's or Job's condition says."""

    state: str
    reason: str = ""
    message: str = ""

    def __str__(self) -> str:
        why = ": ".join(part for part in (self.reason, self.message) if part)
        return f"{self.state} ({why})" if why else self.state


def _run_object(job_name: str, namespace: str, api: client.ApiClient) -> dict[str, Any] | None:
    """The run's JobSet, else its Job, as a dict (None: neither exists). A JobSet is asked first;
    its 404 also means that the cluster has no JobSet API."""
    try:
        return client.CustomObjectsApi(api).get_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, job_name)
    except client.ApiException as e:
        if e.status != NOT_FOUND:
            raise
    try:
        job = client.BatchV1Api(api).read_namespaced_job(job_name, namespace)
    except client.ApiException as e:
        if e.status != NOT_FOUND:
            raise
        return None
    return {**api.sanitize_for_serialization(job), "kind": "Job"}


def _outcome(run: dict[str, Any] | None) -> RunOutcome | None:
    if run is None:
        return RunOutcome("NotFound")
    outcomes = JOBSET_OUTCOMES if run.get("kind") == "JobSet" else JOB_OUTCOMES
    return next((RunOutcome(outcomes[c["type"]], c.get("reason") or "",
                            " ".join((c.get("message") or "").split()))
                 for c in (run.get("status") or {}).get("conditions") or []
                 if c.get("status") == "True" and c.get("type") in outcomes), None)


def run_outcome(job_name: str, namespace: str = "default", *,
                api_client: client.ApiClient | None = None) -> RunOutcome | None:
    """How the run ended, from its JobSet's (else its Job's) conditions, or None while it still
    waits in a queue, runs or restarts: a pod that failed is not the end of a run its failure
    policy retries (a preempted host, a JobSet restart). ``NotFound``: neither exists (deleted).
    A failed run's message ends with its failed pods' own last words (the kit's one-line error,
    ``gemmalab.k8s.run_notebook``'s termination message)."""
    api = connect(api_client)
    outcome = _outcome(_run_object(job_name, namespace, api))
    if outcome is None or outcome.state != "Failed":
        return outcome
    said = pod_errors(job_name, namespace, api_client=api)
    if not said:
        return outcome
    quoted = "; ".join(f"{pod}: {line}" for pod, line in said.items())
    return dataclasses.replace(outcome, message="; ".join(
        part for part in (outcome.message, quoted) if part))


def pod_errors(job_name: str, namespace: str = "default", *,
               api_client: client.ApiClient | None = None) -> dict[str, str]:
    """``{pod: message}`` of the run's pods whose training container ended with a termination
    message and a non-zero exit code (the last line of each)."""
    said = {}
    for pod in _pods(job_name, namespace, connect(api_client)):
        for status in (pod.status and pod.status.container_statuses) or []:
            ended = status.state and status.state.terminated
            if status.name == CONTAINER and ended and ended.exit_code and ended.message:
                said[pod.metadata.name] = ended.message.strip().splitlines()[-1]
    return said


def run_state(job_name: str, namespace: str = "default", *,
              api_client: client.ApiClient | None = None) -> str:
    """Where a run is now, from one read of its JobSet or Job: ``Queued`` (suspended: Kueue has
    not admitted it, so it has no pods), ``Running`` (admitted or unqueued, not ended: pods
    pending, running or restarting), or how it ended (``Succeeded``, ``Failed``, ``NotFound``)."""
    run = _run_object(job_name, namespace, connect(api_client))
    if (outcome := _outcome(run)) is not None:
        return outcome.state
    return "Queued" if (run.get("spec") or {}).get("suspend") else "Running"


def tail_logs(job_name: str, namespace: str = "default", *, tail_lines: int = 50,
              container: str = CONTAINER,
              api_client: client.ApiClient | None = None) -> dict[str, str]:
    """The last ``tail_lines`` lines of every pod of the run (a pending pod has none yet)."""
    api = connect(api_client)
    core = client.CoreV1Api(api)
    logs = {}
    for pod in _pods(job_name, namespace, api):
        try:
            logs[pod.metadata.name] = core.read_namespaced_pod_log(
                pod.metadata.name, namespace, container=container, tail_lines=tail_lines)
        except client.ApiException as e:  # e.g. 400 while the container is still creating
            logs[pod.metadata.name] = f"<no logs yet: {e.status} {e.reason}>"
    return logs


def follow_logs(pod: str, namespace: str = "default", *, container: str = CONTAINER,
                api_client: client.ApiClient | None = None) -> Iterator[str]:
    """The log lines of one pod as they come (``kubectl logs -f``)."""
    api = connect(api_client)
    response = client.CoreV1Api(api).read_namespaced_pod_log(
        pod, namespace, container=container, follow=True, _preload_content=False)
    pending = b""
    try:
        for chunk in response.stream(1024):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", errors="replace")
        if pending:
            yield pending.decode("utf-8", errors="replace")
    finally:
        response.release_conn()


def delete(job_name: str, namespace: str = "default", *, kind: str | None = None,
           api_client: client.ApiClient | None = None) -> list[str]:
    """Delete the run's JobSet and/or Job *and their pods*; returns what existed.

    ``kind``: "Job", "JobSet", or None for whichever exists. Pods are removed too
    (propagationPolicy Background): deleting a Job through the API orphans them by default.
    """
    if kind not in (None, "Job", "JobSet"):
        raise ValueError(f"kind must be 'Job', 'JobSet' or None, not {kind!r}")
    api = connect(api_client)
    options = client.V1DeleteOptions(propagation_policy="Background")
    deleted = []
    if kind in (None, "JobSet"):
        try:
            client.CustomObjectsApi(api).delete_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, job_name, body=options)
            deleted.append(f"JobSet/{job_name}")
        except client.ApiException as e:
            if e.status != NOT_FOUND:
                raise
    if kind in (None, "Job"):
        try:
            client.BatchV1Api(api).delete_namespaced_job(job_name, namespace, body=options)
            deleted.append(f"Job/{job_name}")
        except client.ApiException as e:
            if e.status != NOT_FOUND:
                raise
    return deleted
