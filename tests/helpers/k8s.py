"""Shared by tests/k8s/ (``from tests.helpers.k8s import ...``): the committed manifests,
offline schemas, pod-spec accessors."""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
FIXTURES = ROOT / "tests" / "k8s" / "fixtures"
KUBERNETES_VERSION = "1.33"  # validated offline by kubernetes-validate (it ships 1.28-1.37)
TRAINING_FILES = ("single-host-v6e-1x1.yaml", "multihost-v6e-2x4.yaml",
                  "multislice-2x-v6e-2x4.yaml", "gpu-h200.yaml")
HUB_FILE = "jupyterhub-values.yaml"
KUEUE_FILES = ("kueue-v6e.yaml", "kueue-v6e-flex-start.yaml")
KUEUE_KINDS = ("ResourceFlavor", "ClusterQueue", "LocalQueue", "AdmissionCheck",
               "ProvisioningRequestConfig")


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def committed_training_docs() -> list[tuple[str, dict[str, Any]]]:
    return [(name, doc) for name in TRAINING_FILES for doc in load_docs(K8S / name)]


def _strict(schema: Any) -> Any:
    """CRD schemas prune unknown fields silently; make a misspelt field an error instead."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def jobset_validator():
    import jsonschema

    schema = json.loads((FIXTURES / "jobset-v0.11.1-v1alpha2.schema.json").read_text())
    return jsonschema.Draft7Validator(_strict(schema))


@functools.cache
def kueue_validator(kind: str):
    """Kueue's own CRD schema of ``kind`` (v1beta2) from the release install-kueue.sh pins."""
    import jsonschema

    from gemmalab.k8s.kueue import KUEUE_VERSION

    path = FIXTURES / f"kueue-{KUEUE_VERSION}-v1beta2-{kind.lower()}.schema.json"
    return jsonschema.Draft7Validator(_strict(json.loads(path.read_text())))


@functools.cache
def hub_validator():
    import jsonschema

    schema = json.loads((FIXTURES / "z2jh-4.4.0-values.schema.json").read_text())
    return jsonschema.Draft7Validator(schema)


def helm_merge(defaults: Any, values: Any) -> Any:
    """Helm's coalescing of user values onto chart defaults: maps merge, the rest is replaced."""
    if isinstance(defaults, dict) and isinstance(values, dict):
        merged = dict(defaults)
        for key, value in values.items():
            merged[key] = helm_merge(defaults.get(key), value)
        return merged
    return values


def chart_defaults() -> dict[str, Any]:
    return yaml.safe_load((FIXTURES / "z2jh-4.4.0-values.yaml").read_text(encoding="utf-8"))


def child_jobs(doc: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(replicas, batch/v1 JobSpec) of a Job or JobSet document."""
    if doc["kind"] == "Job":
        return [(1, doc["spec"])]
    return [(rj["replicas"], rj["template"]["spec"]) for rj in doc["spec"]["replicatedJobs"]]


def as_job(doc: dict[str, Any], job_spec: dict[str, Any]) -> dict[str, Any]:
    """A JobSet's child-Job template as a standalone batch/v1 Job, for schema validation."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": doc["metadata"]["name"]}, "spec": job_spec}


def pods(doc: dict[str, Any]) -> int:
    return sum(replicas * spec.get("parallelism", 1) for replicas, spec in child_jobs(doc))


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [spec["template"]["spec"] for _, spec in child_jobs(doc)]


def pod_metadata(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [spec["template"]["metadata"] for _, spec in child_jobs(doc)]


def topology_chips(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def wait_for(what: str, condition: Callable[[], Any], timeout_s: float = 90,
             poll_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        if value := condition():
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


def with_pods(objects: list[Any], annotations: dict[str, str] | None = None,
              labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The objects with these annotations/labels on every pod template (kwok's instructions)."""
    out = []
    from gemmalab.k8s.render import to_dict

    for obj in objects:
        body = to_dict(obj)
        specs = ([body["spec"]] if body["kind"] == "Job" else
                 [rj["template"]["spec"] for rj in body["spec"]["replicatedJobs"]])
        for spec in specs:
            meta = spec["template"].setdefault("metadata", {})
            meta.setdefault("annotations", {}).update(annotations or {})
            meta.setdefault("labels", {}).update(labels or {})
        out.append(body)
    return out


def make_queue(cluster, namespace: str, quota: dict[str, int], **fields: Any) -> str:
    """A ClusterQueue (labelled for the namespace fixture's cleanup) and its LocalQueue."""
    from gemmalab.k8s import ClusterConfig, kueue

    config = ClusterConfig(namespace=namespace, queue=f"q-{namespace}", queue_quota=quota,
                           **fields)
    objects = kueue.queue_objects(config)
    for obj in objects:
        if obj["kind"] == "ClusterQueue":
            obj["metadata"]["labels"] = {"gemmalab-test": namespace}
            # Only this test's namespace: another test's runs never take this quota.
            obj["spec"]["namespaceSelector"] = {"matchLabels": {
                "kubernetes.io/metadata.name": namespace}}
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))
    return config.queue


def workload_admitted(cluster, namespace: str, run: str) -> bool | None:
    """Whether Kueue admitted the run's Workload (None: no Workload yet)."""
    from kubernetes import client as k8s

    workloads = k8s.CustomObjectsApi(cluster.api).list_namespaced_custom_object(
        "kueue.x-k8s.io", "v1beta2", namespace, "workloads")["items"]
    mine = [w for w in workloads
            if any(ref.get("name") == run for ref in w["metadata"].get("ownerReferences", []))]
    if not mine:
        return None
    return any(c["type"] == "Admitted" and c["status"] == "True"
               for w in mine for c in (w.get("status") or {}).get("conditions", []))
