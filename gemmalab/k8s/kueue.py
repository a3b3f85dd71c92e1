"""Kueue objects that queue training runs on TPU slices: flavors, a ClusterQueue, a LocalQueue, and
optionally a flex-start (Dynamic Workload Scheduler) admission check.

A run joins the queue through one label on its Job or JobSet (``manifests.labels``); Kueue
suspends it on creation through its webhook, reserves ``google.com/tpu`` (and the hosts' CPU,
memory and disk) against the ClusterQueue's quota, and unsuspends it once admitted. Kueue
requires every resource a pod requests to be covered by the ClusterQueue, so the quota lists all
four, sized per slice from the same host shapes the run's pods ask for.

Everything here is plain dicts (custom resources); nothing imports ``kubernetes``.
"""

from __future__ import annotations

from typing import Any

from gemmalab.k8s import accelerators
from gemmalab.k8s.config import ClusterConfig

KUEUE_VERSION = "v0.19.2"  # what install-kueue.sh installs; the tests use its CRD schemas
KUEUE_API_VERSION = "kueue.x-k8s.io/v1beta2"  # the storage version of that release
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PROVISIONING_CONTROLLER = "kueue.x-k8s.io/provisioning-request"
# GKE's flex-start with queued provisioning: nodes come all at once, tainted so that only pods
# admitted through the ProvisioningRequest land on them.
FLEX_START_CLASS = "queued-provisioning.gke.io"
FLEX_START_TAINT = "cloud.google.com/gke-queued"
FLEX_START_CHECK = "flex-start"
PROVISIONED_NODE_LABEL = "autoscaling.gke.io/provisioning-request"  # on the nodes GKE provisions


def flavor_name(config: ClusterConfig, topology: str) -> str:
    if config.is_cpu:
        return "cpu-local"
    suffix = "-flex" if config.flex_start else ""
    return f"{config.accelerator}-{topology}{suffix}"


def resource_flavor(config: ClusterConfig, topology: str) -> dict[str, Any]:
    """Nodes of one slice shape: the same accelerator and topology labels the run's pods select,
    so Kueue assigns a run only the flavor of its own topology (the CPU profile: the local
    node)."""
    if config.is_cpu:
        spec: dict[str, Any] = {"nodeLabels": config.node_selector}
        return {"apiVersion": KUEUE_API_VERSION, "kind": "ResourceFlavor",
                "metadata": {"name": flavor_name(config, topology)}, "spec": spec}
    tpu = accelerators.tpu_slice(config.accelerator, topology)
    spec = {"nodeLabels": tpu.node_selector}
    if config.flex_start:
        # Kueue adds a flavor's tolerations to the pods it admits on it: the run's manifest
        # needs nothing flex-start specific.
        spec["tolerations"] = [{"key": FLEX_START_TAINT, "operator": "Exists",
                                "effect": "NoSchedule"}]
    return {"apiVersion": KUEUE_API_VERSION, "kind": "ResourceFlavor",
            "metadata": {"name": flavor_name(config, topology)}, "spec": spec}


def slice_quota(config: ClusterConfig, topology: str, slices: int) -> dict[str, str]:
    """What ``slices`` slices of ``topology`` request in all: chips, and each host's CPU,
    memory and ephemeral storage as the training pods ask for them (manifests.container). The
    CPU profile's "slices" are hosts: what that many of its pods request."""
    if config.is_cpu:
        host = config.host_resources
        return {"cpu": accelerators.scale_quantity(host.cpu, slices),
                "memory": accelerators.scale_quantity(host.memory, slices)}
    tpu = accelerators.tpu_slice(config.accelerator, topology)
    pods = tpu.hosts * slices
    host = tpu.host_resources
    return {
        "cpu": accelerators.scale_quantity(host.cpu, pods),
        "memory": accelerators.scale_quantity(host.memory, pods),
        "ephemeral-storage": f"{(config.cache_size_gi + 5) * pods}Gi",
        accelerators.TPU_RESOURCE: str(tpu.chips * slices),
    }


COVERED_RESOURCES = ("cpu", "memory", "ephemeral-storage", accelerators.TPU_RESOURCE)
CPU_COVERED_RESOURCES = ("cpu", "memory")  # the CPU profile's pods request only these


def cluster_queue(config: ClusterConfig) -> dict[str, Any]:
    flavors = [{"name": flavor_name(config, topology),
                "resources": [{"name": name, "nominalQuota": quantity}
                              for name, quantity in slice_quota(config, topology, slices).items()]}
               for topology, slices in config.queue_quota.items()]
    spec: dict[str, Any] = {
        "namespaceSelector": {},  # every namespace's LocalQueue may point here
        "queueingStrategy": "BestEffortFIFO",  # a run too big for the free quota lets smaller pass
        "resourceGroups": [{"coveredResources": list(CPU_COVERED_RESOURCES if config.is_cpu
                                                      else COVERED_RESOURCES),
                            "flavors": flavors}],
    }
    if config.flex_start:
        spec["admissionChecksStrategy"] = {"admissionChecks": [{"name": FLEX_START_CHECK}]}
    return {"apiVersion": KUEUE_API_VERSION, "kind": "ClusterQueue",
            "metadata": {"name": config.queue}, "spec": spec}


def local_queue(config: ClusterConfig) -> dict[str, Any]:
    return {"apiVersion": KUEUE_API_VERSION, "kind": "LocalQueue",
            "metadata": {"name": config.queue, "namespace": config.namespace},
            "spec": {"clusterQueue": config.queue}}


def flex_start_objects() -> list[dict[str, Any]]:
    """The admission check that asks GKE's Dynamic Workload Scheduler for a run's nodes all at
    once (a ProvisioningRequest per admitted run) before Kueue lets its pods start."""
    check = {"apiVersion": KUEUE_API_VERSION, "kind": "AdmissionCheck",
             "metadata": {"name": FLEX_START_CHECK},
             "spec": {"controllerName": PROVISIONING_CONTROLLER,
                      "parameters": {"apiGroup": "kueue.x-k8s.io",
                                     "kind": "ProvisioningRequestConfig",
                                     "name": FLEX_START_CHECK}}}
    # Each admitted run's pods select the nodes provisioned for its own request (the label GKE
    # puts on them), not those of another run admitted on the same flavor (as GKE's xpk does).
    provisioning = {"apiVersion": KUEUE_API_VERSION, "kind": "ProvisioningRequestConfig",
                    "metadata": {"name": FLEX_START_CHECK},
                    "spec": {"provisioningClassName": FLEX_START_CLASS,
                             "managedResources": [accelerators.TPU_RESOURCE],
                             "podSetUpdates": {"nodeSelector": [{
                                 "key": PROVISIONED_NODE_LABEL,
                                 "valueFromProvisioningClassDetail": "ResizeRequestName"}]}}}
    return [check, provisioning]


def queue_objects(config: ClusterConfig) -> list[dict[str, Any]]:
    """Flavors, ClusterQueue and LocalQueue (both named ``config.queue``) for ``queue_quota``;
    with ``flex_start`` also the admission check and its ProvisioningRequestConfig."""
    config.require_queue_setup()
    objects = [resource_flavor(config, topology) for topology in config.queue_quota]
    if config.flex_start:
        objects += flex_start_objects()
    return [*objects, cluster_queue(config), local_queue(config)]
