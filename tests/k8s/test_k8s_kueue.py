"""Kueue: the committed queue manifests against Kueue's own CRD schemas, their quota against the
standard runs' pods, and the queue label on a queued run (no cluster needed)."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from gemmalab.errors import ConfigError
from gemmalab.k8s import kueue, manifests
from gemmalab.k8s.config import ClusterConfig
from tests.helpers.k8s import (
    K8S,
    KUBERNETES_VERSION,
    KUEUE_FILES,
    KUEUE_KINDS,
    committed_training_docs,
    kueue_validator,
    load_docs,
    pod_metadata,
    pod_specs,
    pods,
)

QUEUE_DOCS = [(name, doc) for name in KUEUE_FILES for doc in load_docs(K8S / name)]


def _by_kind(name: str) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for doc in load_docs(K8S / name):
        kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


def _quantity(value: str | int) -> float:
    text = str(value)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return float(text[:-2]) * scale
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


@pytest.mark.parametrize(("name", "doc"), QUEUE_DOCS,
                         ids=[f"{n}:{d['kind']}:{d['metadata']['name']}" for n, d in QUEUE_DOCS])
def test_queue_objects_validate_against_kueues_crd_schemas(name, doc):
    assert doc["apiVersion"] == "kueue.x-k8s.io/v1beta2" and doc["kind"] in KUEUE_KINDS
    errors = [f"{list(e.path)}: {e.message}" for e in kueue_validator(doc["kind"]).iter_errors(doc)]
    assert not errors


def test_kueue_schema_validation_catches_mistakes():
    queue = _by_kind("kueue-v6e.yaml")["ClusterQueue"][0]
    queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQouta"] = 4
    assert list(kueue_validator("ClusterQueue").iter_errors(queue))
    flavor = _by_kind("kueue-v6e.yaml")["ResourceFlavor"][0]
    flavor["spec"]["nodeSelector"] = flavor["spec"].pop("nodeLabels")  # the pod's word, not Kueue's
    assert list(kueue_validator("ResourceFlavor").iter_errors(flavor))


def test_the_standard_queue_admits_the_standard_tpu_runs():
    """Every resource the standard TPU runs' pods request is covered, on the flavor whose node
    labels are exactly the pods' node selector, and the whole run fits its quota."""
    kinds = _by_kind("kueue-v6e.yaml")
    flavors = {f["metadata"]["name"]: f["spec"]["nodeLabels"] for f in kinds["ResourceFlavor"]}
    [queue] = kinds["ClusterQueue"]
    [group] = queue["spec"]["resourceGroups"]
    quota = {f["name"]: {r["name"]: _quantity(r["nominalQuota"]) for r in f["resources"]}
             for f in group["flavors"]}
    assert set(quota) == set(flavors) == {"v6e-1x1", "v6e-2x4"}
    assert quota["v6e-1x1"]["google.com/tpu"] == 4 and quota["v6e-2x4"]["google.com/tpu"] == 16
    tpu_runs = [(n, d) for n, d in committed_training_docs() if n != "gpu-h200.yaml"]
    assert len(tpu_runs) == 3
    for name, doc in tpu_runs:
        [spec] = pod_specs(doc)
        [flavor] = [f for f, labels in flavors.items() if labels == spec["nodeSelector"]]
        requests = spec["containers"][0]["resources"]["requests"]
        assert set(requests) == set(group["coveredResources"]), name
        for resource, amount in requests.items():
            assert _quantity(amount) * pods(doc) <= quota[flavor][resource], (name, resource)
    [local] = kinds["LocalQueue"]
    assert local["spec"]["clusterQueue"] == queue["metadata"]["name"] == "gemmalab"
    assert local["metadata"]["namespace"] == "default"
    assert "admissionChecksStrategy" not in queue["spec"]


def test_flex_start_waits_for_gke_to_provision_the_nodes():
    kinds = _by_kind("kueue-v6e-flex-start.yaml")
    [check], [config] = kinds["AdmissionCheck"], kinds["ProvisioningRequestConfig"]
    assert check["spec"]["controllerName"] == "kueue.x-k8s.io/provisioning-request"
    assert check["spec"]["parameters"] == {"apiGroup": "kueue.x-k8s.io",
                                           "kind": "ProvisioningRequestConfig",
                                           "name": config["metadata"]["name"]}
    assert config["spec"] == {
        "provisioningClassName": "queued-provisioning.gke.io",
        "managedResources": ["google.com/tpu"],
        # a run's pods land on the nodes provisioned for it, not another admitted run's
        "podSetUpdates": {"nodeSelector": [{
            "key": "autoscaling.gke.io/provisioning-request",
            "valueFromProvisioningClassDetail": "ResizeRequestName"}]}}
    [queue] = kinds["ClusterQueue"]
    assert queue["spec"]["admissionChecksStrategy"] == {
        "admissionChecks": [{"name": check["metadata"]["name"]}]}
    for flavor in kinds["ResourceFlavor"]:  # Kueue hands the pods the flex-start nodes' taint
        assert flavor["spec"]["tolerations"] == [{"effect": "NoSchedule", "operator": "Exists",
                                                  "key": "cloud.google.com/gke-queued"}]


@pytest.mark.parametrize("topology", ["1x1", "2x4"])
def test_a_queued_run_carries_the_queue_label_on_the_job_or_jobset_only(topology):
    config = ClusterConfig(job_name="queued", topology=topology, queue="gemmalab")
    doc = _plain(manifests.build(config)[0])
    assert doc["metadata"]["labels"][kueue.QUEUE_LABEL] == "gemmalab"
    assert doc["kind"] == ("Job" if topology == "1x1" else "JobSet")
    # Not on the pods (Kueue's pod integration would queue each again), not created suspended
    # (Kueue's webhook suspends it on creation and unsuspends it on admission).
    assert all(kueue.QUEUE_LABEL not in m["labels"] for m in pod_metadata(doc))
    assert "suspend" not in doc["spec"]
    if doc["kind"] == "Job":
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    unqueued = _plain(manifests.build(ClusterConfig(job_name="queued", topology=topology))[0])
    assert kueue.QUEUE_LABEL not in unqueued["metadata"]["labels"]


def _plain(obj):
    from gemmalab.k8s.render import to_dict

    return to_dict(obj)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(queue="Team_A"), "queue: 'Team_A' is not a LocalQueue name"),
    (dict(queue_quota={"3x3": 1}), "topology: '3x3' is not a v6e topology"),
    (dict(queue_quota={"2x4": 0}), "queue_quota.2x4: 0 is not a number of slices"),
    (dict(queue_quota={"2x4": 1}, accelerator="h200"), "queue_quota: is rendered for TPU"),
    (dict(flex_start="yes"), "flex_start: is not a bool"),
])
def test_bad_queue_settings_are_one_line_errors(fields, message):
    with pytest.raises(ConfigError) as raised:
        ClusterConfig(**fields)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_rendering_a_queue_needs_a_name_and_a_quota():
    with pytest.raises(ConfigError, match="^queue: is empty"):
        kueue.queue_objects(ClusterConfig(queue_quota={"1x1": 1}))
    with pytest.raises(ConfigError, match="^queue_quota: is empty"):
        kueue.queue_objects(ClusterConfig(queue="q"))
    objects = kueue.queue_objects(ClusterConfig(queue="team-a", namespace="team-a",
                                                queue_quota={"2x2": 3}, cache_size_gi=10))
    assert [o["kind"] for o in objects] == ["ResourceFlavor", "ClusterQueue", "LocalQueue"]
    [flavor] = objects[1]["spec"]["resourceGroups"][0]["flavors"]
    assert {r["name"]: r["nominalQuota"] for r in flavor["resources"]} == {
        "cpu": "405", "memory": "1560Gi", "ephemeral-storage": "45Gi", "google.com/tpu": "12"}
    assert objects[2]["metadata"] == {"name": "team-a", "namespace": "team-a"}


def test_cli_job_joins_a_queue(capsys):
    from gemmalab.k8s.cli import main

    assert main(["job", "--name", "my-run", "--topology", "2x4", "--queue", "gemmalab"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# my-run: v6e 2x4, 2 pod(s) x 4 device(s), queue gemmalab\n")
    [doc] = yaml.safe_load_all(out)
    assert doc["metadata"]["labels"][kueue.QUEUE_LABEL] == "gemmalab"
    assert main(["job", "--queue", "Bad Queue"]) == 2
    assert "ConfigError: queue: 'Bad Queue' is not a LocalQueue name" in capsys.readouterr().err


def test_a_queue_for_the_local_cpu_node_covers_what_its_pods_request():
    """The CPU profile's queue: one flavor for the local node (its label), a quota of hosts at
    once in the CPU and memory its pods request, schema-valid."""
    config = ClusterConfig(accelerator="cpu", num_nodes=2, queue="local", queue_quota={"cpu": 2},
                           params={"batch_size": 8})
    objects = kueue.queue_objects(config)
    for doc in objects:
        assert not [e.message for e in kueue_validator(doc["kind"]).iter_errors(doc)], doc
    flavor, queue = objects[0], objects[1]
    assert flavor["spec"]["nodeLabels"] == {"gemmalab.dev/node": "cpu"}
    [group] = queue["spec"]["resourceGroups"]
    assert group["coveredResources"] == ["cpu", "memory"]
    quota = {r["name"]: _quantity(r["nominalQuota"]) for r in group["flavors"][0]["resources"]}
    [jobset] = manifests.build(config)
    requests = pod_specs(jobset)[0]["containers"][0]["resources"]["requests"]
    assert set(requests) == set(quota)
    for name, value in requests.items():
        assert _quantity(value) * pods(jobset) == quota[name]
    with pytest.raises(ConfigError, match="^queue_quota: '1x1' is not the CPU node's"):
        ClusterConfig(accelerator="cpu", queue="local", queue_quota={"1x1": 1})
