"""The accelerator catalogue: each chip kind's facts, stated once, and what a run runs on.

``CHIPS`` holds what a chip is (memory, peak FLOP/s, HBM bandwidth, how its slices are shaped and
how many a host holds); the planner (``gemmalab.plan``) reads its figures, the GKE renderer
(``gemmalab.k8s.accelerators``) its slices and hosts, adding only GKE's own labels, machine types
and resources. An ``Accelerator`` is some chips of one kind: ``parse_accelerator("v6e:2x4")``
before a run, ``attached_accelerator()`` during one.

Part of the ground: imports only ``gemmalab.errors`` (and jax, lazily, for the attached devices).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from gemmalab.errors import ConfigError

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    platform: str  # "tpu" | "gpu" | "cpu"
    memory_gib: float  # HBM per chip
    peak_tflops: float  # dense bf16 per chip
    hbm_gb_s: float  # HBM bandwidth per chip, GB/s (1e9 bytes)
    topology_dims: int = 0  # TPU: 2 (e.g. 2x4) or 3 (e.g. 2x2x2); 0 for GPUs
    device_kinds: tuple[str, ...] = ()  # jax's device_kind of the chip, attached
    slices: tuple[str, ...] = ()  # TPU: the slice topologies offered, smallest first
    host_chips: tuple[int, ...] = ()  # the chips one host holds, one entry a machine type

    @property
    def one_chip(self) -> str:
        """libtpu's topology of a single TPU chip: ``1x1`` or ``1x1x1``."""
        return "x".join(["1"] * self.topology_dims)


# Peak dense bf16 FLOP/s and HBM bandwidth as the vendors' spec sheets publish them (Google Cloud's
# TPU v4, v5e, v5p and v6e (Trillium) system-architecture pages; NVIDIA's H100 SXM and H200
# datasheets). Slices: the topologies GKE offers (docs: "Plan TPUs in GKE"; v4 as the planner
# tabulates it). Hosts: v5e and v6e machine types hold 1, 4 or 8 chips (a slice up to 2x4 fits one
# host, beyond that it is made of SLICE_HOST_CHIPS-chip hosts), v5p's 4; an a3 machine 8 GPUs.
CHIPS: dict[str, Chip] = {
    "v4": Chip("tpu", 32, 275, 1200, 3, device_kinds=("TPU v4",),
               slices=("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4")),
    "v5e": Chip("tpu", 16, 197, 819, 2, device_kinds=("TPU v5 lite", "TPU v5e"),
                slices=("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
                host_chips=(1, 4, 8)),
    "v5p": Chip("tpu", 95, 459, 2765, 3, device_kinds=("TPU v5", "TPU v5p"),
                slices=("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8",
                        "8x8x16", "8x16x16", "16x16x16", "16x16x24"),
                host_chips=(4,)),
    "v6e": Chip("tpu", 32, 918, 1640, 2, device_kinds=("TPU v6 lite", "TPU v6e"),
                slices=("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
                host_chips=(1, 4, 8)),
    # SXM; 81,559 MiB as the driver reports it
    "h100": Chip("gpu", 79.6, 989, 3350, host_chips=(8,)),
    "h200": Chip("gpu", 140.4, 989, 4800, host_chips=(8,)),  # 143,771 MiB
}
# The chips per host of every TPU slice larger than one host.
SLICE_HOST_CHIPS = 4
# jax's device_kind of attached chips.
DEVICE_KINDS = {device_kind: kind for kind, chip in CHIPS.items()
                for device_kind in chip.device_kinds}
ACCELERATOR_FIX = "use e.g. 'v6e:2x4', 'v5e:2x2', 'v5p:2x2x2', 'h100', 'h200' or 'h200:8'"


def topology_chips(topology: str) -> int:
    """The chips of a TPU topology: ``topology_chips("2x4") == 8``."""
    return math.prod(int(n) for n in topology.split("x"))


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """What the run would run on: a chip kind and how many (a TPU topology or a GPU count)."""

    kind: str
    chips: int
    memory_bytes: int  # per chip
    peak_flops: float | None  # per chip, None where unknown (CPU)
    topology: str = ""  # libtpu's topology name, TPU only
    hbm_bytes_per_s: float | None = None  # per chip, None where unknown (CPU)

    @property
    def platform(self) -> str:
        if self.kind in CHIPS:
            return CHIPS[self.kind].platform
        # Chips without a row in CHIPS keep jax's platform as their kind (an A100 is "gpu").
        return self.kind if self.kind in ("gpu", "tpu") else "cpu"

    @property
    def name(self) -> str:
        if self.topology:
            return self.topology
        return self.kind if self.chips == 1 else f"{self.kind}:{self.chips}"


def parse_accelerator(spec: str) -> Accelerator:
    """``"v6e:2x4"`` (TPU kind and topology; the kind alone is one chip) or ``"h200:8"``."""
    text = str(spec).strip().lower()
    kind, _, shape = text.partition(":")
    if kind not in CHIPS:
        raise ConfigError("accelerator", f"unknown accelerator {spec!r}", ACCELERATOR_FIX)
    chip = CHIPS[kind]
    if chip.platform == "gpu":
        if shape and not shape.isdigit() or shape == "0":
            raise ConfigError("accelerator", f"{spec!r}: a GPU count must be a positive integer",
                              f"use e.g. '{kind}:8'")
        chips, topology = int(shape or 1), ""
    else:
        shape = shape or chip.one_chip
        if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*)+", shape) or shape.count("x") + 1 != \
                chip.topology_dims:
            example = "2x4" if chip.topology_dims == 2 else "2x2x2"
            raise ConfigError("accelerator", f"{spec!r} is not a {kind} topology",
                              f"use {chip.topology_dims} chip counts, e.g. '{kind}:{example}'")
        chips, topology = topology_chips(shape), f"{kind}:{shape}"
    return Accelerator(kind, chips, int(chip.memory_gib * GIB), chip.peak_tflops * 1e12,
                       topology, chip.hbm_gb_s * 1e9)


def attached_accelerator(devices: list[Any] | None = None) -> Accelerator:
    """The devices this process trains on; their memory as the runtime reports it.

    CPU devices (simulated ones included) share the host's memory equally.
    """
    import jax

    devices = list(devices) if devices is not None else jax.devices()
    first = devices[0]
    kind = DEVICE_KINDS.get(first.device_kind, "")
    if not kind and first.platform == "gpu":
        kind = next((k for k, chip in CHIPS.items()
                     if chip.platform == "gpu" and k in first.device_kind.lower()), "")
    stats = _memory_stats(first)
    if first.platform == "cpu" or not kind:
        memory = stats or host_memory_bytes() // max(jax.local_device_count(), 1)
        return Accelerator(first.platform, len(devices), int(memory), None)
    chip = CHIPS[kind]
    return Accelerator(kind, len(devices), int(stats or chip.memory_gib * GIB),
                       chip.peak_tflops * 1e12, hbm_bytes_per_s=chip.hbm_gb_s * 1e9)


def _memory_stats(device: Any) -> int:
    try:
        return int((device.memory_stats() or {}).get("bytes_limit", 0))
    except Exception:  # CPU clients and some plugins have no memory stats
        return 0


def peak_device_bytes() -> int | None:
    """The most memory a local device has held so far, where the runtime reports it."""
    import jax

    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # CPU clients and some plugins have no memory stats
        return None
    return int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else None


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
