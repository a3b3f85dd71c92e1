"""kwok's fake nodes, labelled, tainted and sized as GKE's TPU v6e node pools, so the committed
manifests schedule on them unchanged: their node selectors (accelerator, topology), the
``google.com/tpu`` capacity and taint, and the node-pool label that JobSet's exclusive placement
uses as its topology key (without it a multi-host leader pod stays Unschedulable)."""

from __future__ import annotations

import dataclasses
from typing import Any

from gemmalab.k8s import accelerators

KWOK_ANNOTATION = "kwok.x-k8s.io/node"  # the nodes kwok manages (--manage-nodes-with-...)
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
ZONE = "us-east5-b"
# The machines behind v6e hosts (GKE's TPU docs): vCPUs and memory, and what the kubelet and
# GKE's daemons leave allocatable (roughly: a few cores and ~5% of memory).
MACHINES = {
    "ct6e-standard-1t": {"capacity": ("44", "448Gi"), "allocatable": ("42", "420Gi")},
    "ct6e-standard-4t": {"capacity": ("180", "720Gi"), "allocatable": ("176", "690Gi")},
}


@dataclasses.dataclass(frozen=True)
class NodePool:
    """``slices`` node pools of one slice shape: a pool per slice, as GKE makes them."""

    topology: str
    slices: int
    generation: str = "v6e"

    @property
    def tpu(self) -> accelerators.TpuSlice:
        return accelerators.tpu_slice(self.generation, self.topology)

    def pool_names(self) -> list[str]:
        return [f"{self.generation}-{self.topology}-{i}" for i in range(self.slices)]


# Enough for the standard runs side by side: four 1x1 slices (the single-host Job and a sweep's
# points) and two 2x4 slices (a multi-host JobSet, or the two slices of a multislice one).
DEFAULT_POOLS = (NodePool("1x1", 4), NodePool("2x4", 2))


def node(pool: str, host: int, tpu: accelerators.TpuSlice) -> dict[str, Any]:
    machine = MACHINES[tpu.machine_type]
    name = f"gke-local-{pool}-host{host}"
    resources = {
        kind: {"cpu": cpu, "memory": memory, accelerators.TPU_RESOURCE: str(tpu.chips_per_host),
               "ephemeral-storage": "200Gi", "pods": "110"}
        for kind, (cpu, memory) in machine.items()}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                **tpu.node_selector,
                NODEPOOL_LABEL: pool,
                "cloud.google.com/machine-family": tpu.machine_type.split("-")[0],
                "node.kubernetes.io/instance-type": tpu.machine_type,
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64", "topology.kubernetes.io/zone": ZONE,
                "topology.kubernetes.io/region": ZONE.rsplit("-", 1)[0], "type": "kwok",
            },
        },
        # GKE taints TPU nodes so that only pods tolerating google.com/tpu land there.
        "spec": {"taints": [{"key": accelerators.TPU_RESOURCE, "value": "present",
                             "effect": "NoSchedule"}]},
        "status": resources,
    }


def fake_nodes(pools=DEFAULT_POOLS) -> list[dict[str, Any]]:
    return [node(pool, host, p.tpu) for p in pools for pool in p.pool_names()
            for host in range(p.tpu.hosts)]
