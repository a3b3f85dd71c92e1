"""TPU and GPU shapes on GKE, and the local cluster's CPU node: what a generation and topology
mean in chips, hosts and labels.

The chips' own facts (their slices, the chips a host holds) are the catalogue's
(``gemmalab.accelerators``); this module adds GKE's: node labels, machine types and what a pod
may ask of a host. Everything here is a pure function of a few strings; nothing imports
``kubernetes``.
"""

from __future__ import annotations

import dataclasses

from gemmalab.accelerators import CHIPS, SLICE_HOST_CHIPS, Chip, topology_chips
from gemmalab.errors import ConfigError, require

TPU_RESOURCE = "google.com/tpu"
GPU_RESOURCE = "nvidia.com/gpu"
TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
GPU_ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"


@dataclasses.dataclass(frozen=True)
class HostResources:
    """CPU and memory the training container asks for on one host (requests = limits).

    About three quarters of the machine: the rest is left to the kubelet's reservation, the
    GKE daemons (metadata server, logging, the TPU/GPU device plugin) and the GCS FUSE sidecar.
    """

    cpu: str
    memory: str


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    """GKE's facts of one TPU generation; the chip's (``chip``: slices, chips a host holds) are
    the catalogue's."""

    name: str  # a key of gemmalab.accelerators.CHIPS
    accelerator: str  # value of the cloud.google.com/gke-tpu-accelerator node label
    machine_family: str  # machine type without the "-<chips>t" suffix
    resources: dict[int, HostResources]  # keyed by chips per host (the chip's host_chips)

    @property
    def chip(self) -> Chip:
        return CHIPS[self.name]

    @property
    def topologies(self) -> tuple[str, ...]:
        return self.chip.slices


TPU_GENERATIONS: dict[str, TpuGeneration] = {generation.name: generation for generation in (
    TpuGeneration(
        name="v5e",
        accelerator="tpu-v5-lite-podslice",
        machine_family="ct5lp-hightpu",
        # ct5lp-hightpu-1t: 24 vCPU / 48 GB; -4t: 112 / 192 GB; -8t: 224 / 384 GB.
        resources={1: HostResources("18", "34Gi"), 4: HostResources("84", "140Gi"),
                   8: HostResources("168", "280Gi")},
    ),
    TpuGeneration(
        name="v5p",
        accelerator="tpu-v5p-slice",
        machine_family="ct5p-hightpu",
        # ct5p-hightpu-4t: 208 vCPU / 448 GB.
        resources={4: HostResources("156", "330Gi")},
    ),
    TpuGeneration(
        name="v6e",
        accelerator="tpu-v6e-slice",
        machine_family="ct6e-standard",
        # ct6e-standard-1t: 44 vCPU / 448 GB; -4t: 180 / 720 GB; -8t: 180 / 1440 GB.
        resources={1: HostResources("32", "320Gi"), 4: HostResources("135", "520Gi"),
                   8: HostResources("135", "1040Gi")},
    ),
)}


@dataclasses.dataclass(frozen=True)
class GpuType:
    name: str
    accelerator: str  # value of the cloud.google.com/gke-accelerator node label
    machine_type: str  # the 8-GPU machine type
    per_gpu: HostResources  # scaled by the GPUs a pod asks for


GPU_TYPES: dict[str, GpuType] = {
    # a3-highgpu-8g: 208 vCPU / 1872 GB for 8 H100s.
    "h100": GpuType("h100", "nvidia-h100-80gb", "a3-highgpu-8g", HostResources("19", "170Gi")),
    # a3-ultragpu-8g: 224 vCPU / 2952 GB for 8 H200s.
    "h200": GpuType("h200", "nvidia-h200-141gb", "a3-ultragpu-8g", HostResources("21", "270Gi")),
}
# The GPUs of one node: the a3 machine types' (the catalogue's host_chips).
MAX_GPUS_PER_NODE = max(max(CHIPS[name].host_chips) for name in GPU_TYPES)

# The CPU profile: the local cluster's real node (`make cluster`), labelled and tainted
# CPU_NODE_LABEL=CPU_NODE_VALUE so that only these runs land on it. One JAX process (one CPU
# device) a pod; requests without limits, so the pods of a 2-host run share the node's cores.
CPU_ACCELERATOR = "cpu"
CPU_NODE_LABEL = "gemmalab.dev/node"
CPU_NODE_VALUE = "cpu"
CPU_HOST_REQUESTS = HostResources("500m", "3Gi")


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """One TPU slice: its chips, how they split over hosts (= pods), and its node labels."""

    generation: str
    topology: str
    chips: int
    chips_per_host: int

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host

    @property
    def accelerator_label(self) -> str:
        return TPU_GENERATIONS[self.generation].accelerator

    @property
    def machine_type(self) -> str:
        return f"{TPU_GENERATIONS[self.generation].machine_family}-{self.chips_per_host}t"

    @property
    def node_selector(self) -> dict[str, str]:
        return {TPU_ACCELERATOR_LABEL: self.accelerator_label, TPU_TOPOLOGY_LABEL: self.topology}

    @property
    def host_resources(self) -> HostResources:
        return TPU_GENERATIONS[self.generation].resources[self.chips_per_host]


def _default_chips_per_host(generation: str, chips: int) -> int:
    # v5e/v6e: the 1- and 4-chip topologies fit one host; 2x4 and beyond use 4-chip hosts
    # (the multi-host node pools); 2x4 on one 8-chip host needs chips_per_host=8. v5p: 4.
    return min(_allowed_chips_per_host(generation, chips))


def _allowed_chips_per_host(generation: str, chips: int) -> list[int]:
    """One host holding the whole slice (a machine type of that many chips), or hosts of
    ``SLICE_HOST_CHIPS`` for a slice larger than one of them."""
    whole = [chips] if chips in CHIPS[generation].host_chips else []
    return sorted(whole + ([SLICE_HOST_CHIPS] if chips > SLICE_HOST_CHIPS else []))


def tpu_slice(generation: str, topology: str, chips_per_host: int | None = None) -> TpuSlice:
    """Validate ``generation`` and ``topology`` and derive chips and hosts."""
    require(
        generation in TPU_GENERATIONS,
        "accelerator",
        f"unknown accelerator {generation!r}",
        f"use a TPU generation ({', '.join(TPU_GENERATIONS)}) or a GPU ({', '.join(GPU_TYPES)})",
    )
    gen = TPU_GENERATIONS[generation]
    require(
        topology in gen.topologies,
        "topology",
        f"{topology!r} is not a {generation} topology",
        f"use one of {', '.join(gen.topologies)}",
    )
    chips = topology_chips(topology)
    if chips_per_host is None:
        chips_per_host = _default_chips_per_host(generation, chips)
    else:
        allowed = _allowed_chips_per_host(generation, chips)
        require(
            chips_per_host in allowed,
            "chips_per_host",
            f"{chips_per_host} chips per host cannot make a {generation} {topology} slice",
            f"use {' or '.join(map(str, allowed))}, or None for the default",
        )
    return TpuSlice(generation, topology, chips, chips_per_host)


def gpu_type(name: str) -> GpuType:
    if name not in GPU_TYPES:
        raise ConfigError("accelerator", f"unknown accelerator {name!r}",
                          f"use a TPU generation ({', '.join(TPU_GENERATIONS)}) "
                          f"or a GPU ({', '.join(GPU_TYPES)})")
    return GPU_TYPES[name]


def scale_quantity(quantity: str, factor: int) -> str:
    """``scale_quantity("170Gi", 8) == "1360Gi"`` for the integer quantities used here."""
    digits = quantity.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return f"{int(digits) * factor}{quantity[len(digits):]}"
