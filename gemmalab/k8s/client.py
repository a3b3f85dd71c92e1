"""Submit, watch, read logs and delete training runs through the Kubernetes API (no kubectl).

Every function takes an optional ``api_client`` (a ``kubernetes.client.ApiClient``); without
one, the in-cluster configuration is used when running in a pod (a JupyterHub server), else the
local kubeconfig (``gcloud container clusters get-credentials`` writes it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

from kubernetes import client

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
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    return client.ApiClient()


def submit(objects: Iterable[Any], namespace: str | None = None, *,
           api_client: client.ApiClient | None = None) -> list[str]:
    """Create each Job/JobSet; returns ``["JobSet/name", ...]``. Namespace: argument, else the
    object's, else ``default``."""
    api = connect(api_client)
    created = []
    for obj in objects:
        body = to_dict(obj)
        kind, name = body.get("kind"), body["metadata"]["name"]
        ns = namespace or body["metadata"].get("namespace") or "default"
        body["metadata"]["namespace"] = ns
        if kind == "Job":
            client.BatchV1Api(api).create_namespaced_job(ns, body)
        elif kind == "JobSet":
            client.CustomObjectsApi(api).create_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, ns, JOBSET_PLURAL, body)
        else:
            raise ValueError(f"cannot submit a {kind}: only Job and JobSet")
        created.append(f"{kind}/{name}")
    return created


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


def run_outcome(job_name: str, namespace: str = "default", *,
                api_client: client.ApiClient | None = None) -> str | None:
    """How the run ended, from its JobSet's (else its Job's) conditions: ``"Succeeded"``,
    ``"Failed"``, ``"NotFound"`` (neither exists, e.g. deleted), or None while it still waits in
    a queue, runs or restarts: a pod that failed is not the end of a run its failure policy
    retries (a preempted host, a JobSet restart)."""
    api = connect(api_client)
    try:
        jobset = client.CustomObjectsApi(api).get_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, job_name)
        conditions = [(c.get("type"), c.get("status"))
                      for c in (jobset.get("status") or {}).get("conditions") or []]
        outcomes = JOBSET_OUTCOMES
    except client.ApiException as e:
        if e.status != NOT_FOUND:  # 404 too where the JobSet CRD is not installed
            raise
        try:
            job = client.BatchV1Api(api).read_namespaced_job(job_name, namespace)
        except client.ApiException as e:
            if e.status != NOT_FOUND:
                raise
            return "NotFound"
        conditions = [(c.type, c.status) for c in (job.status and job.status.conditions) or []]
        outcomes = JOB_OUTCOMES
    return next((outcomes[kind] for kind, status in conditions
                 if status == "True" and kind in outcomes), None)


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
