"""Will a run fit, and how long could it take? Per-device memory and a roofline time of a training
run, before renting the slice.

One description of the run (a ``TrainConfig``: model, mesh, batch, maxlen, remat, dtypes) and an
accelerator (``"v6e:2x4"``, ``"v5p:2x2x2"``, ``"h200:8"``) give a ``MemoryPlan`` two ways:

- ``estimate``, analytic and instant: weights, optimizer state and gradients from the real
  parameter shapes cut by the real sharding rules (``gemmalab.model.sharding``), activations from a
  per-token count of what the backward pass keeps for each remat policy, and the loss's logits
  chunk (with ``objective="dpo"`` also the reference model: its weights where full fine-tuning
  holds a copy, and its forward pass). It needs no accelerator and is what ``train.ipynb``
  checks before loading weights.
- ``compile_plan``, exact (TPU targets): the real train step, lowered with abstract inputs and
  compiled by libtpu for the topology, on a CPU-only machine; XLA's own memory analysis and
  FLOP count. It runs in a subprocess (``python -m gemmalab.train.aot``) with libtpu from
  ``.libtpu/`` (``make libtpu``), so the calling process never loads the TPU runtime;
  ``compile_plans`` compiles several in one such subprocess.

Either plan also carries the step's HBM traffic per device (an analytic lower bound, or XLA's
``bytes accessed``) and so a roofline (``MemoryPlan.roofline``): the step can take no less than
the larger of its FLOPs at the chip's peak and its bytes at the chip's HBM bandwidth. That is an
upper bound on speed (a floor on time), with the run's steps and, given a price per chip-hour,
its cost.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemmalab.config import AXES, DATA_AXIS, FSDP_AXIS, OBJECTIVES, REMAT_POLICIES, TrainConfig
from gemmalab.errors import ConfigError

BATCH_FIELD_COUNT = 5  # int32 rows per batch: gemmalab.data.packing.FIELDS

GIB = 1 << 30
# A run "fits" when the plan stays under this share of the device's memory: the rest is the
# runtime's own, fragmentation and the error of the estimate.
USABLE_FRACTION = 0.95
GEMMA3_VOCAB = 262_144
# A preference pair's two chat documents (prompt and reply in turn markers, each) take at least
# this many next-token targets together: what bounds DPO's segments a row before any data is read.
PAIR_MIN_TARGETS = 18


@dataclasses.dataclass(frozen=True)
class Chip:
    platform: str  # "tpu" | "gpu" | "cpu"
    memory_gib: float  # HBM per chip
    peak_tflops: float  # dense bf16 per chip
    hbm_gb_s: float  # HBM bandwidth per chip, GB/s (1e9 bytes)
    topology_dims: int = 0  # TPU: 2 (e.g. 2x4) or 3 (e.g. 2x2x2); 0 for GPUs


# Peak dense bf16 FLOP/s and HBM bandwidth as the vendors' spec sheets publish them (Google Cloud's
# TPU v4, v5e, v5p and v6e (Trillium) system-architecture pages; NVIDIA's H100 SXM and H200
# datasheets).
CHIPS: dict[str, Chip] = {
    "v4": Chip("tpu", 32, 275, 1200, 3),
    "v5e": Chip("tpu", 16, 197, 819, 2),
    "v5p": Chip("tpu", 95, 459, 2765, 3),
    "v6e": Chip("tpu", 32, 918, 1640, 2),
    "h100": Chip("gpu", 79.6, 989, 3350),  # SXM; 81,559 MiB as the driver reports it
    "h200": Chip("gpu", 140.4, 989, 4800),  # 143,771 MiB
}
# jax's device_kind of attached chips.
DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p",
                "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}
ACCELERATOR_FIX = "use e.g. 'v6e:2x4', 'v5e:2x2', 'v5p:2x2x2', 'h100', 'h200' or 'h200:8'"


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
        shape = shape or "x".join(["1"] * chip.topology_dims)
        if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*)+", shape) or shape.count("x") + 1 != \
                chip.topology_dims:
            example = "2x4" if chip.topology_dims == 2 else "2x2x2"
            raise ConfigError("accelerator", f"{spec!r} is not a {kind} topology",
                              f"use {chip.topology_dims} chip counts, e.g. '{kind}:{example}'")
        chips, topology = math.prod(int(n) for n in shape.split("x")), f"{kind}:{shape}"
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
        kind = next((k for k in ("h200", "h100") if k in first.device_kind.lower()), "")
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


# ---------------------------------------------------------------------------------------------
# The plan.

ROOFLINE_NOTE = ("an upper bound on speed (a floor on time): the step's FLOPs at 100% of the "
                 "chips' dense bf16 peak or its HBM bytes at 100% of their bandwidth, whichever "
                 "takes longer; no communication, no host time, no overlap lost, so a real run "
                 "is slower")


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The fastest a step (and the run) can go on these chips: ``MemoryPlan.roofline``."""

    compute_seconds: float  # the step's model FLOPs per device at the chip's peak
    memory_seconds: float  # its HBM bytes per device at the chip's bandwidth
    tokens_per_step: int  # batch_size x maxlen (padding included), every micro-batch
    chips: int
    run_steps: int | None  # None: the run's length is unknown (no datacount nor max_steps)
    price_per_chip_hour: float | None = None
    bytes_source: str = "analytic lower bound"

    @property
    def step_seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_seconds if self.step_seconds else math.inf

    @property
    def run_seconds(self) -> float | None:
        return None if self.run_steps is None else self.run_steps * self.step_seconds

    @property
    def cost(self) -> float | None:
        """The run's price: its hours x chips x the price per chip-hour."""
        if self.run_seconds is None or self.price_per_chip_hour is None:
            return None
        return self.run_seconds / 3600 * self.chips * self.price_per_chip_hour

    def to_dict(self) -> dict[str, Any]:
        return {"step_seconds": self.step_seconds, "bound": self.bound,
                "compute_seconds": self.compute_seconds, "memory_seconds": self.memory_seconds,
                "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s,
                "run_steps": self.run_steps, "run_seconds": self.run_seconds,
                "price_per_chip_hour": self.price_per_chip_hour, "cost": self.cost,
                "bytes_source": self.bytes_source,
                "note": ROOFLINE_NOTE + ("" if self.run_steps is not None else
                                         "; run length unknown: set datacount or max_steps")}


def check_price(price: Any) -> float | None:
    """A price per chip-hour: None, or a finite number >= 0; else a one-line ``ConfigError``."""
    if price is None:
        return None
    if isinstance(price, bool) or not isinstance(price, numbers.Real) or not math.isfinite(price):
        raise ConfigError("price_per_chip_hour", f"{price!r} is not a number",
                          "give what one chip costs for an hour, e.g. 2.7, or None for no cost")
    if price < 0:
        raise ConfigError("price_per_chip_hour", f"{price!r} is negative",
                          "give a price >= 0 per chip-hour, or None for no cost")
    return float(price)


def run_steps(config: TrainConfig) -> int | None:
    """The run's steps: ``max_steps``, else ``num_epochs`` epochs of ``datacount`` examples one
    a row (the tutorial's layout); None when ``datacount`` is None (unknown until the data is read).

    A gemmalab run takes fewer: it holds out ``eval_fraction`` of the examples, and packing puts
    several short ones in a row.
    """
    if config.trainer.max_steps is not None:
        return config.trainer.max_steps
    if config.data.datacount is None:
        return None
    return config.trainer.num_epochs * math.ceil(config.data.datacount / config.trainer.batch_size)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one training step, by part, against the device's memory; and the
    step's HBM traffic and FLOPs against the chips' bandwidth and peak (``roofline``)."""

    method: str  # "analytic" | "compiled"
    model: str
    accelerator: Accelerator
    mesh: dict[str, int]
    batch_size: int
    maxlen: int
    grad_accum_steps: int
    remat: str
    param_dtype: str
    compute_dtype: str
    breakdown: dict[str, int]  # part -> bytes per device
    flops_per_step: float  # model FLOPs of the whole step, all devices
    num_params: int
    compile_seconds: float | None = None
    analytic: MemoryPlan | None = None  # the estimate, beside a compiled plan
    lora_rank: int = 0  # > 0: LoRA adapters train, the base is frozen in the compute dtype
    trainable_params: int = 0  # what has gradients and optimizer state (LoRA: the adapters)
    # part -> HBM bytes one device reads and writes in a step: the analytic lower bound by part,
    # or {"xla_bytes_accessed": ...} from the compiled step's cost analysis.
    traffic: dict[str, int] = dataclasses.field(default_factory=dict)
    run_steps: int | None = None  # the whole run's (``run_steps``); None: unknown
    price_per_chip_hour: float | None = None
    # "sft" | "dpo": DPO adds the reference model's forward pass (and, in full fine-tuning, its
    # weights: the breakdown's "reference", the traffic's "reference")
    objective: str = "sft"

    @property
    def per_device_bytes(self) -> int:
        return sum(self.breakdown.values())

    @property
    def usable_bytes(self) -> int:
        return int(self.accelerator.memory_bytes * USABLE_FRACTION)

    @property
    def fits(self) -> bool:
        return self.per_device_bytes <= self.usable_bytes

    @property
    def step_seconds_at_peak(self) -> float | None:
        """The step time at 100% MFU: a floor, for planning budgets."""
        peak = self.accelerator.peak_flops
        return self.flops_per_step / (peak * self.accelerator.chips) if peak else None

    @property
    def bytes_per_device(self) -> int:
        """HBM bytes one device reads and writes in a step."""
        return sum(self.traffic.values())

    @property
    def roofline(self) -> Roofline | None:
        """The roofline step and run time, an upper bound on speed; None where the chip's peak or
        bandwidth is unknown (CPUs)."""
        chips, peak = self.accelerator.chips, self.accelerator.peak_flops
        bandwidth = self.accelerator.hbm_bytes_per_s
        if not peak or not bandwidth:
            return None
        source = ("analytic lower bound" if self.method == "analytic"
                  else "XLA cost analysis (bytes accessed)")
        return Roofline(compute_seconds=self.flops_per_step / chips / peak,
                        memory_seconds=self.bytes_per_device / bandwidth,
                        tokens_per_step=self.batch_size * self.maxlen, chips=chips,
                        run_steps=self.run_steps, price_per_chip_hour=self.price_per_chip_hour,
                        bytes_source=source)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "fits": self.fits,
            "per_device_gib": round(self.per_device_bytes / GIB, 3),
            "device_hbm_gib": round(self.accelerator.memory_bytes / GIB, 3),
            "usable_gib": round(self.usable_bytes / GIB, 3),
            "breakdown_gib": {k: round(v / GIB, 3) for k, v in self.breakdown.items()},
            "breakdown_bytes": dict(self.breakdown),
            "method": self.method,
            "model": self.model,
            "num_params": self.num_params,
            "trainable_params": self.trainable_params,
            "accelerator": self.accelerator.name,
            "platform": self.accelerator.platform,
            "chips": self.accelerator.chips,
            "mesh": self.mesh,
            "batch_size": self.batch_size,
            "maxlen": self.maxlen,
            "grad_accum_steps": self.grad_accum_steps,
            "remat": self.remat,
            "lora_rank": self.lora_rank,
            "objective": self.objective,
            "param_dtype": self.param_dtype,
            "compute_dtype": self.compute_dtype,
            "flops_per_step": self.flops_per_step,
            "step_seconds_at_peak": self.step_seconds_at_peak,
            "bytes_per_device": self.bytes_per_device,
            "traffic_gib": {k: round(v / GIB, 3) for k, v in self.traffic.items()},
            "roofline": (self.roofline.to_dict() if self.roofline else {
                "step_seconds": None, "bound": None, "tokens_per_s": None,
                "run_steps": self.run_steps, "run_seconds": None, "cost": None,
                "note": self.roofline_line()}),
            "compile_seconds": self.compile_seconds,
        }
        if self.analytic is not None:
            out["analytic"] = self.analytic.to_dict()
        return out

    def summary_line(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        objective = "" if self.objective == "sft" else f" ({self.objective.upper()})"
        return (f"{self.model}{objective} on {self.accelerator.name} mesh {self.mesh}: "
                f"{self.per_device_bytes / GIB:.2f} GiB per device of "
                f"{self.usable_bytes / GIB:.2f} GiB usable -> {verdict} ({self.method})")

    def roofline_line(self) -> str:
        """The time plan in one line, labelled as the upper bound on speed it is."""
        roof = self.roofline
        if roof is None:
            return f"no roofline: no published peak or bandwidth for {self.accelerator.kind}"
        if roof.run_seconds is None:
            run = "run length unknown (set datacount or max_steps)"
        else:
            run = f"{roof.run_steps} steps >= {roof.run_seconds:,.1f} s"
            if roof.cost is not None:
                run += f" >= {roof.cost:,.3f} at {roof.price_per_chip_hour:g} per chip-hour"
        return (f"roofline (upper bound on speed): step >= {roof.step_seconds * 1e3:,.1f} ms "
                f"({roof.bound}-bound: compute {roof.compute_seconds * 1e3:,.1f} ms, HBM "
                f"{self.bytes_per_device / 1e9:,.1f} GB {roof.memory_seconds * 1e3:,.1f} ms), "
                f"<= {roof.tokens_per_s:,.0f} tokens/s; {run}")


def vocab_size_hint(config: TrainConfig) -> int:
    """The embedding rows the run will have, known before the tokenizer is loaded."""
    if config.model.preset == "gemma3-tiny" and config.model.tokenizer == "local":
        return config.model.tokenizer_vocab_size
    if (config.model.preset == "gemma3-tiny" and config.model.tokenizer.endswith(".model")
            and Path(config.model.tokenizer).is_file()):  # e.g. the local one a continued run saved
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=config.model.tokenizer).vocab_size()
    return GEMMA3_VOCAB  # Gemma's tokenizer; the largest a custom one may be for tiny


@functools.cache
def abstract_params(model_config: Any, param_dtype: str) -> Any:
    """The parameter tree's shapes and dtypes (traced, nothing allocated)."""
    import jax
    import jax.numpy as jnp

    from gemmalab import gemma_lib

    model = gemma_lib.gm().nn.Transformer(config=model_config, dtype=jnp.dtype(param_dtype))
    return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]


def adapter_params(model_config: Any, config: TrainConfig, token_rows: int = 0) -> Any:
    """A LoRA run's trainable tree (its adapters and ``token_rows`` embedding rows), abstract;
    ``{}`` without LoRA."""
    if not config.lora.rank:
        return {}
    from gemmalab.model import lora

    return lora.abstract_adapters(model_config, rank=config.lora.rank,
                                  modules=config.lora.modules, dtype=config.model.param_dtype,
                                  token_rows=token_rows)


def preference_segments_bound(maxlen: int) -> int:
    """DPO's segments a row can hold (``optimization.Preference.num_segments``) where no data has
    been read (the plan, the ahead-of-time compile): two per pair, as many pairs as rows of
    ``maxlen`` fit if each took ``PAIR_MIN_TARGETS`` targets. A run derives its own, tighter
    bound from the data (``preparation._max_segments``)."""
    return 2 * max(1, maxlen // PAIR_MIN_TARGETS)


def resolved_mesh(config: TrainConfig, chips: int) -> dict[str, int]:
    from gemmalab.config import DATA_AXIS, resolve_mesh_shape

    if chips % config.runtime.num_slices:
        raise ConfigError("num_slices", f"{config.runtime.num_slices} does not divide {chips} chips",
                          "use the number of slices the chips come in")
    sizes = resolve_mesh_shape(config.runtime.mesh, chips // config.runtime.num_slices)
    return {**sizes, DATA_AXIS: sizes[DATA_AXIS] * config.runtime.num_slices}


def estimate(config: TrainConfig, accelerator: Accelerator | str, *,
             price_per_chip_hour: float | None = None) -> MemoryPlan:
    """The analytic plan: instant, no accelerator needed. ``price_per_chip_hour``: what one chip
    costs an hour, for the roofline's run cost.

    With ``config.trainer.objective == "dpo"`` the step also runs the reference model forward (no
    backward pass through it). Full fine-tuning holds its weights, a compute-dtype copy of the
    starting weights sharded like the params: the breakdown's ``"reference"``; with LoRA the
    reference is the frozen base already in ``"params"``, nothing more. Its forward pass adds its
    transient bytes to ``"weight_copies"`` and ``"activations"`` (``_reference_gather_bytes``,
    ``_activation_bytes``), its FLOPs (``model_flops``) and its HBM traffic (``_traffic_bytes``).
    """
    import jax
    import numpy as np
    from jax.sharding import AbstractMesh

    from gemmalab.model import presets, sharding

    price_per_chip_hour = check_price(price_per_chip_hour)
    if isinstance(accelerator, str):
        accelerator = parse_accelerator(accelerator)
    sizes = resolved_mesh(config, accelerator.chips)
    abstract_mesh = AbstractMesh(tuple(sizes[a] for a in AXES), AXES)
    data_ways = sizes[DATA_AXIS] * sizes[FSDP_AXIS]
    if config.trainer.batch_size % (data_ways * config.trainer.grad_accum_steps):
        raise ConfigError("batch_size", f"{config.trainer.batch_size} rows do not split over "
                          f"{data_ways} data-parallel ways x {config.trainer.grad_accum_steps} "
                          f"micro-batches (mesh {sizes})",
                          f"use a multiple of {data_ways * config.trainer.grad_accum_steps}")
    vocab = vocab_size_hint(config)
    model_config = presets.model_config(config.model.preset, vocab, config.model.num_layers)
    params = abstract_params(model_config, config.model.param_dtype)
    p_size = np.dtype(config.model.param_dtype).itemsize
    c_size = np.dtype(jax.numpy.dtype(config.model.compute_dtype)).itemsize

    shards = {}  # module (embedder, layer_0, ...) -> elements one device holds
    gathered = {}  # module -> elements after the fsdp all-gather (weights split over fsdp)
    used = {}  # module -> elements one device's matmuls read (its shard, fsdp's split undone)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        spec = sharding.weight_spec(path, leaf.shape, abstract_mesh)
        per_device = math.prod(dim // _ways(axis, sizes) for dim, axis in
                               zip(leaf.shape, tuple(spec) + (None,) * leaf.ndim, strict=False))
        module = sharding.dict_path(path)[0]
        shards[module] = shards.get(module, 0) + per_device
        whole = per_device * (sizes[FSDP_AXIS] if FSDP_AXIS in tuple(spec) else 1)
        used[module] = used.get(module, 0) + whole
        if FSDP_AXIS in tuple(spec):
            gathered[module] = gathered.get(module, 0) + whole
    num_params = sum(leaf.size for leaf in jax.tree.leaves(params))
    # Without LoRA every weight trains; with it the adapters (replicated) train and the base
    # weights are held once, frozen, in the compute dtype.
    adapters = sum(leaf.size for leaf in jax.tree.leaves(adapter_params(model_config, config)))
    trained = adapters if config.lora.rank else sum(shards.values())
    base_size = c_size if config.lora.rank else p_size
    weights = trained * p_size
    accumulating = config.trainer.grad_accum_steps > 1
    dpo = config.trainer.objective == "dpo"
    # Full fine-tuning DPO's reference: the starting weights in the compute dtype, cut like the
    # params (LoRA's reference is its frozen base, counted in "params").
    reference = {"reference": sum(shards.values()) * c_size} if dpo and not config.lora.rank \
        else {}
    breakdown = {
        "params": (sum(shards.values()) * c_size + weights) if config.lora.rank else weights,
        **reference,
        "optimizer": 2 * weights,  # AdamW's two moments, in the params' dtype
        # Gradients of the compute-dtype weights, all alive for the global-norm clip; a
        # master-dtype accumulator besides them when micro-batches are summed.
        "gradients": trained * c_size + (weights if accumulating else 0),
        "weight_copies": (_weight_copy_bytes(shards, gathered, config.model.remat, base_size, c_size)
                          + (_reference_gather_bytes(gathered, c_size) if reference else 0)),
        "activations": _activation_bytes(model_config, sizes, config, c_size,
                                         splash=_runs_splash(config, accelerator)),
        "logits": _logits_bytes(config, sizes, vocab, data_ways),
        "batch": BATCH_FIELD_COUNT * 4 * config.trainer.batch_size // data_ways * config.data.maxlen,
        # The compiled program itself: 0.27-0.48 GiB in the compiled steps of docs/scaling.md.
        "code": 0 if accelerator.platform == "cpu" else int(0.4 * GIB),
    }
    return MemoryPlan(
        method="analytic", model=config.model.preset, accelerator=accelerator, mesh=sizes,
        batch_size=config.trainer.batch_size, maxlen=config.data.maxlen,
        grad_accum_steps=config.trainer.grad_accum_steps, remat=config.model.remat,
        param_dtype=config.model.param_dtype, compute_dtype=config.model.compute_dtype,
        breakdown=breakdown,
        flops_per_step=model_flops(model_config, num_params, config, adapters=adapters),
        num_params=num_params + adapters, lora_rank=config.lora.rank,
        trainable_params=adapters if config.lora.rank else num_params,
        traffic=_traffic_bytes(model_config, config, sizes, accelerator, shards=shards,
                               used=used, trained=trained, p_size=p_size, c_size=c_size,
                               vocab=vocab),
        run_steps=run_steps(config), price_per_chip_hour=price_per_chip_hour,
        objective=config.trainer.objective)


def _ways(axis: Any, sizes: dict[str, int]) -> int:
    if axis is None:
        return 1
    axes = axis if isinstance(axis, tuple) else (axis,)
    return math.prod(sizes[a] for a in axes)


def _weight_copy_bytes(shards: dict[str, int], gathered: dict[str, int], remat: str,
                       p_size: int, c_size: int) -> int:
    """Weights held besides the master copy, as the compiled steps show (docs/scaling.md).

    The embedding's compute-dtype copy lives from the input lookup to the loss. Under fsdp the
    embedding is also all-gathered (in the params' dtype) for that whole time, and so is every
    block's weights without remat (the backward pass reuses the forward's gather); with remat
    each block gathers again when recomputed, two blocks at a time. (LoRA's base weights are
    already in the compute dtype: ``p_size == c_size``, no cast copy.)
    """
    cast_copy = shards.get("embedder", 0) * c_size if p_size != c_size else 0
    embedding = cast_copy + gathered.get("embedder", 0) * p_size
    blocks = [n for k, n in gathered.items() if k.startswith("layer_")]
    if remat == "none":
        return embedding + sum(blocks) * p_size
    return embedding + 2 * max(blocks, default=0) * c_size


def _reference_gather_bytes(gathered: dict[str, int], c_size: int) -> int:
    """Full fine-tuning DPO under fsdp: the reference copy's weights all-gathered for its
    forward pass, in the compute dtype: its embedding (the input lookup, and the output head of
    its loss) and two blocks at a time (no backward pass keeps them). 0 without fsdp. (LoRA's
    reference gathers the very frozen base the policy does: nothing more is counted.)"""
    blocks = [n for k, n in gathered.items() if k.startswith("layer_")]
    return (gathered.get("embedder", 0) + 2 * max(blocks, default=0)) * c_size


def _runs_splash(config: TrainConfig, accelerator: Accelerator) -> bool:
    from gemmalab.model import attention

    return attention.resolve(config.model.attention, accelerator.platform) == "splash"


def _activation_bytes(model_config: Any, sizes: dict[str, int], config: TrainConfig,
                      c_size: int, *, splash: bool = False) -> int:
    """What the backward pass keeps of one micro-batch, plus one block's working set.

    ``splash``: attention by the splash kernel (gemmalab.model.attention), which keeps no scores.

    DPO (``config.trainer.objective``): the reference's forward pass runs after the policy's forward and
    before its backward (the loss needs both), so its working set (one block, one logits chunk)
    is alive with what the backward pass keeps but not with the backward's own working set,
    which is larger: it adds nothing here but its output, the final hidden states (one row of
    ``d`` a token), alive until its loss has run. Both losses are per segment
    (``cross_entropy.chunked_segment_nll``): the backward pass weighs every position by its
    segment's cotangent through a float32 one-hot over ``preference_segments_bound`` segments,
    counted whole (all chunks at once).
    """
    d, hd, heads, kv_heads, ffw = _block_dims(model_config, sizes)
    length = config.data.maxlen
    rows = config.trainer.batch_size // (sizes["data"] * sizes["fsdp"] * config.trainer.grad_accum_steps)
    tokens = rows * length
    # Per token of one block, what XLA keeps for the backward pass (calibrated against the
    # compiled step, docs/scaling.md): the block input, q/k/v, the attention output, the gated
    # MLP's gate, up and activation in the compute dtype, and the attention logits and
    # probabilities over the sequence in float32.
    block = (2 * d + 2 * heads * hd + 2 * kv_heads * hd + 3 * ffw) * c_size
    if splash:  # no scores, but q, k, v and the output again in the kernel's heads-major layout
        block += (2 * heads * hd + 2 * kv_heads * hd) * c_size
    else:
        block += heads * length * 2 * 4
    kept = {"none": block,
            # the weight matmuls' outputs: q, k, v, attention output, gate and up, down
            "dots": (2 * d + (heads + 2 * kv_heads) * hd + 2 * ffw) * c_size,
            "full": d * c_size}[config.model.remat]
    layers = model_config.num_layers
    working = 0 if config.model.remat == "none" else block  # one block recomputed at a time
    preference = 0
    if config.trainer.objective == "dpo":  # the reference's hidden states; the segments' one-hot
        preference = d * c_size + preference_segments_bound(length) * 4
    return tokens * (layers * kept + working + block + 4 * d * c_size + preference)


def _block_dims(model_config: Any, sizes: dict[str, int]) -> tuple[int, int, int, int, int]:
    """Embed and head dimension, and the heads, KV heads and MLP width one device computes."""
    tensor = sizes["tensor"]

    def split(n: int) -> int:
        return n // tensor if n % tensor == 0 else n

    return (model_config.embed_dim, model_config.head_dim, split(model_config.num_heads),
            split(model_config.num_kv_heads), split(model_config.hidden_dim))


def _loss_chunks(config: TrainConfig, vocab: int) -> int:
    """How many logits chunks the loss of one micro-batch runs in (``chunked_cross_entropy``);
    1: the whole micro-batch's logits at once, kept for the backward pass."""
    from gemmalab.model.cross_entropy import LOSS_CHUNK_LOGITS

    span = max(1, LOSS_CHUNK_LOGITS // vocab // (config.trainer.batch_size // config.trainer.grad_accum_steps))
    return 1 if span >= config.data.maxlen else -(-config.data.maxlen // span)


def _traffic_bytes(model_config: Any, config: TrainConfig, sizes: dict[str, int],
                   accelerator: Accelerator, *, shards: dict[str, int], used: dict[str, int],
                   trained: int, p_size: int, c_size: int, vocab: int) -> dict[str, int]:
    """HBM bytes one device reads and writes in a step, by part: a lower bound (each tensor
    written once and read once per use; what fuses away in VMEM/caches is not counted, nor are
    collectives or the program's small tensors).

    - weights: the master copy cast to the compute dtype once a step (full fine-tuning), each
      block's weights read in the forward pass, the backward pass and remat's recompute (each
      micro-batch), and the embedding read as the output projection by every logits chunk:
      twice in the forward pass (its logits, and the hidden states' gradient formed there), and
      with full fine-tuning once more in the backward pass, whose embedding gradient recomputes
      the chunk's logits (``cross_entropy``'s fused chunks);
    - gradients: written once per micro-batch (the embedding's accumulated over the chunks),
      the float32 accumulator read and written per micro-batch, then read by the clip's norm and
      by the update;
    - optimizer: AdamW reads and writes the master weights and both moments;
    - activations: what the backward pass needs of each block, written once and read once (the
      attention scores only where they are materialised: gemma's own attention);
    - logits: each chunk's logits written and read in the forward pass, and their gradient
      written and read, in the compute dtype; with full fine-tuning, chunked, the backward
      pass's recompute writes and reads them again;
    - reference (DPO only): the reference model's forward pass, each micro-batch: its block
      weights read once and its embedding once per logits chunk, in the compute dtype (the
      copy, or LoRA's frozen base, is held in it: no cast); each block's intermediates written
      and read once (nothing kept for a backward pass); each chunk's logits written and read
      once.
    """
    from gemmalab.model import attention

    accum = config.trainer.grad_accum_steps
    lora = bool(config.lora.rank)
    passes = 2 + (config.model.remat != "none")
    chunks = _loss_chunks(config, vocab)
    embedding = used.get("embedder", 0)
    blocks = sum(n for module, n in used.items() if module != "embedder")
    cast = 0 if lora or p_size == c_size else sum(shards.values()) * (p_size + c_size)
    head_reads = (2 if lora else 3) * chunks if chunks > 1 else 2
    weights = cast + accum * (passes * blocks + head_reads * embedding) * c_size
    gradients = trained * (accum * c_size + 2 * (p_size if accum > 1 else c_size))
    if accum > 1:
        gradients += 2 * accum * trained * p_size
    if not lora and chunks > 1:  # the embedding's gradient, read and written by every chunk
        gradients += 2 * accum * (chunks - 1) * embedding * c_size
    d, hd, heads, kv_heads, ffw = _block_dims(model_config, sizes)
    tokens = config.trainer.batch_size // (sizes[DATA_AXIS] * sizes[FSDP_AXIS] * accum) * config.data.maxlen
    block = (2 * d + 2 * heads * hd + 2 * kv_heads * hd + 3 * ffw) * c_size
    impl = attention.resolve(config.model.attention, accelerator.platform)
    if impl == "gemma" or (impl == "dot_product" and accelerator.platform != "gpu"):
        block += heads * config.data.maxlen * 2 * 4  # float32 scores and probabilities
    kept_input = 2 * d * c_size if config.model.remat == "full" else 0
    activations = accum * tokens * model_config.num_layers * (2 * block + kept_input)
    vocab_shard = vocab // sizes["tensor"] if vocab % sizes["tensor"] == 0 else vocab
    logits = accum * tokens * vocab_shard * c_size * (6 if chunks > 1 and not lora else 5)
    traffic = {"weights": weights, "gradients": gradients, "optimizer": 6 * trained * p_size,
               "activations": activations, "logits": logits}
    if config.trainer.objective == "dpo":
        traffic["reference"] = accum * (
            (blocks + chunks * embedding) * c_size
            + tokens * model_config.num_layers * 2 * block
            + tokens * vocab_shard * c_size * 2)
    return traffic


def _logits_bytes(config: TrainConfig, sizes: dict[str, int], vocab: int, data_ways: int) -> int:
    """The loss's logits chunk: float32 values and half as much again for the softmax and its
    gradient (as compiled, docs/scaling.md)."""
    from gemmalab.model.cross_entropy import LOSS_CHUNK_LOGITS

    tokens = config.trainer.batch_size // config.trainer.grad_accum_steps * config.data.maxlen
    chunk = max(1, min(tokens, LOSS_CHUNK_LOGITS // vocab))
    vocab_shard = vocab // sizes["tensor"] if vocab % sizes["tensor"] == 0 else vocab
    return 6 * -(-chunk // data_ways) * vocab_shard


def compiled_cost(compiled: Any) -> dict[str, float]:
    """XLA's cost analysis of a compiled program (one device's): ``flops``, ``bytes accessed``
    and the rest; some jax versions wrap it in a one-element list, some give None."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(cost or {})


def model_flops(model_config: Any, num_params: int, config: TrainConfig, *,
                adapters: int = 0) -> float:
    """Training FLOPs of one step: 6 per weight per token (the tied embedding counted once, as
    the output projection) plus attention's score and value products (4 per head dimension and
    position of the sequence a token and layer forward, 12 with the backward pass); remat's
    recompute is not counted (these are the FLOPs MFU is measured against). With LoRA a frozen
    weight costs 4 (forward, and the gradient through it; none for itself) and each adapter
    weight 6.

    DPO (``config.trainer.objective == "dpo"``) adds the reference model's forward pass: 2 more per base
    weight (``num_params``: 8 in full fine-tuning, 6 with LoRA; the reference runs no adapters)
    and attention's forward products (16 instead of 12)."""
    tokens = config.trainer.batch_size * config.data.maxlen
    dpo = config.trainer.objective == "dpo"
    attention = ((16 if dpo else 12) * model_config.num_layers * model_config.num_heads
                 * model_config.head_dim * config.data.maxlen)
    per_weight = (4 if config.lora.rank else 6) + (2 if dpo else 0)
    return float(tokens * (per_weight * num_params + 6 * adapters + attention))


# ---------------------------------------------------------------------------------------------
# What to change when it does not fit.


def suggest_fit(config: TrainConfig, accelerator: Accelerator) -> tuple[dict[str, Any], MemoryPlan
                                                                        ] | None:
    """The first change that fits, and its plan, trying more micro-batches, then full remat,
    then both again with fsdp over every chip; None if nothing on this many chips does."""
    candidates: list[dict[str, Any]] = []
    for mesh_shape in (config.runtime.mesh, {"fsdp": -1}):
        # Not "dots": compiled for TPU it saved nothing over "none" (docs/scaling.md).
        for remat in dict.fromkeys((config.model.remat, "full")):
            accum = config.trainer.grad_accum_steps
            while True:
                candidates.append({"mesh": mesh_shape, "remat": remat, "grad_accum_steps": accum})
                accum *= 2
                if accum > config.trainer.batch_size:
                    break
    for change in candidates:
        candidate = dataclasses.replace(config, **change)
        try:
            plan = estimate(candidate, accelerator)
        except ConfigError:  # e.g. the batch does not split that many ways
            continue
        if plan.fits:
            return {k: v for k, v in change.items() if getattr(config, k) != v}, plan
    return None


def layouts(config: TrainConfig, accelerator: Accelerator) -> list[MemoryPlan]:
    """The run's plan under its own mesh and under fsdp over every chip, each remat policy."""
    plans = []
    for mesh_shape in _unique([config.runtime.mesh, {"fsdp": -1}]):
        for remat in REMAT_POLICIES:
            try:
                plans.append(estimate(dataclasses.replace(config, mesh=mesh_shape, remat=remat),
                                      accelerator))
            except ConfigError:  # the batch does not split over this layout
                continue
    return plans


def _unique(items: list[Any]) -> list[Any]:
    return [item for i, item in enumerate(items) if item not in items[:i]]


TABLE_MODELS = ("gemma3-270m", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b")
# libtpu topology names of a slice of n chips.
TOPOLOGIES = {"v6e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8",
                      128: "8x16", 256: "16x16"},
              "v5e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8",
                      128: "8x16", 256: "16x16"},
              "v5p": {1: "1x1x1", 4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"},
              "v4": {1: "1x1x1", 4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"}}


def fit_table(kind: str = "v6e", chip_counts: tuple[int, ...] = (1, 4, 8, 16, 32),
              maxlens: tuple[int, ...] = (256, 2048), batch_size: int = 32,
              models: tuple[str, ...] = TABLE_MODELS, lora_rank: int = 0
              ) -> list[dict[str, Any]]:
    """For each model x slice x maxlen: the first layout that fits (in ``suggest_fit``'s order,
    from plain data parallelism), or the most frugal one's size when none does."""
    rows = []
    for model in models:
        for maxlen in maxlens:
            row: dict[str, Any] = {"model": model, "maxlen": maxlen}
            for chips in chip_counts:
                shape = TOPOLOGIES[kind][chips] if kind in TOPOLOGIES else chips
                accelerator = parse_accelerator(f"{kind}:{shape}")
                config = TrainConfig.flat(model=model, tokenizer="gemma3", maxlen=maxlen,
                                     batch_size=max(batch_size, chips), lora_rank=lora_rank)
                first = estimate(config, accelerator)
                found = (({}, first) if first.fits else suggest_fit(config, accelerator))
                if found:
                    change, fitted = found
                    layout = _layout_words(fitted)
                    row[f"{chips} chips"] = f"{layout}: {fitted.per_device_bytes / GIB:.1f} GiB"
                else:
                    frugal = estimate(dataclasses.replace(
                        config, mesh={"fsdp": -1}, remat="full",
                        grad_accum_steps=config.trainer.batch_size // chips), accelerator)
                    row[f"{chips} chips"] = f"no ({frugal.per_device_bytes / GIB:.0f} GiB)"
            rows.append(row)
    return rows


def _layout_words(memory_plan: MemoryPlan) -> str:
    words = [f"{axis} {size}" for axis, size in memory_plan.mesh.items() if size > 1]
    if memory_plan.remat != "none":
        words.append(f"remat {memory_plan.remat}")
    if memory_plan.grad_accum_steps > 1:
        words.append(f"accum {memory_plan.grad_accum_steps}")
    return ", ".join(words) or "1 chip"


def write_json(memory_plan: MemoryPlan, output_dir: str) -> str:
    """``output_dir/plan.json`` (local or gs://); returns its path."""
    from etils import epath

    directory = epath.Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "plan.json"
    path.write_text(json.dumps(memory_plan.to_dict(), indent=1))
    return str(path)


def chips_needed(config: TrainConfig, accelerator: Accelerator) -> int | None:
    """The fewest chips (powers of two, up to 4096) of this kind on which the most frugal layout
    fits: fsdp over every chip, full remat, one row per device."""
    chips = accelerator.chips * 2
    while chips <= 4096:
        frugal = dataclasses.replace(config, mesh={"fsdp": -1}, remat="full", num_slices=1,
                                     batch_size=chips, grad_accum_steps=1)
        if estimate(frugal, dataclasses.replace(accelerator, chips=chips, topology="")).fits:
            return chips
        chips *= 2
    return None


def require_fits(config: TrainConfig, accelerator: Accelerator) -> MemoryPlan:
    """The analytic plan, or a one-line ``ConfigError`` naming the change that fits."""
    plan = estimate(config, accelerator)
    if plan.fits:
        return plan
    where = (f"{accelerator.kind} device" if accelerator.platform != "cpu"
             else "CPU device (host memory shared by the local devices)")
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in plan.breakdown.items() if v >= GIB / 10)
    problem = (f"{config.model.preset} needs ~{plan.per_device_bytes / GIB:.1f} GiB per device ({parts}) "
               f"but a {where} has {plan.usable_bytes / GIB:.1f} GiB usable")
    override = "or set check_memory=False to run anyway"
    found = suggest_fit(config, accelerator)
    if found:
        change, fitted = found
        words = ", ".join(f"{k}={v!r}" for k, v in change.items())
        raise ConfigError(next(iter(change)), problem,
                          f"use {words} (~{fitted.per_device_bytes / GIB:.1f} GiB), {override}")
    needed = chips_needed(config, accelerator)
    more = f"about {needed} chips of this kind" if needed else "a larger accelerator"
    raise ConfigError("mesh", problem, f"nothing fits on {accelerator.chips} device(s): use "
                      f"{more} with mesh={{'fsdp': -1}} and remat='full', {override}")


# ---------------------------------------------------------------------------------------------
# The exact plan: libtpu compiles the real step for a TPU topology.


# The exact plan compiles the train step itself: the train stage does that, in this subprocess
# (libtpu must load in a process of its own). A JSON request in, one JSON line out.
AOT_COMPILER = "gemmalab.train.aot"


def find_libtpu() -> str | None:
    """libtpu.so: ``$GEMMALAB_LIBTPU``, ``$TPU_LIBRARY_PATH``, the checkout's ``.libtpu/`` (``make
    libtpu``), or an installed ``libtpu`` package (TPU images)."""
    import importlib.util

    for variable in ("GEMMALAB_LIBTPU", "TPU_LIBRARY_PATH"):
        path = os.environ.get(variable)
        if path and Path(path).is_file():
            return path
    checkout = Path(__file__).resolve().parent.parent / ".libtpu" / "libtpu" / "libtpu.so"
    if checkout.is_file():
        return str(checkout)
    spec = importlib.util.find_spec("libtpu")
    if spec and spec.origin and (Path(spec.origin).parent / "libtpu.so").is_file():
        return str(Path(spec.origin).parent / "libtpu.so")
    return None


def compile_plan(config: TrainConfig, accelerator: Accelerator | str, *,
                 timeout_s: float = 3600, price_per_chip_hour: float | None = None) -> MemoryPlan:
    """The exact plan: XLA's memory analysis of the step compiled by libtpu for the topology.

    Runs ``AOT_COMPILER`` (the train stage's step, compiled ahead of time) in a subprocess that
    loads libtpu (CPU-only machines welcome); the analytic estimate rides along for comparison.
    The roofline then takes XLA's FLOPs and bytes accessed of the compiled step (which count a
    loop's body once: the loss's chunks and gradient accumulation's micro-batches are loops).
    """
    return compile_plans([(config, accelerator)], timeout_s=timeout_s,
                         price_per_chip_hour=price_per_chip_hour)[0]


def compile_plans(targets: Sequence[tuple[TrainConfig, Accelerator | str]], *,
                  timeout_s: float = 3600, price_per_chip_hour: float | None = None
                  ) -> list[MemoryPlan]:
    """``compile_plan`` of each ``(config, accelerator)``, in one subprocess: libtpu's start-up
    (~25 s here) and the imports are paid once, not once a plan. Identical targets compile once.
    ``timeout_s`` bounds the whole subprocess."""
    targets = [(config, parse_accelerator(accelerator) if isinstance(accelerator, str)
                else accelerator) for config, accelerator in targets]
    # Validates every mesh, batch and the price first, instantly.
    analytics = [estimate(config, accelerator, price_per_chip_hour=price_per_chip_hour)
                 for config, accelerator in targets]
    for _, accelerator in targets:
        if accelerator.platform != "tpu":
            raise ConfigError("exact", f"the exact plan compiles for TPUs, not {accelerator.kind}",
                              "use exact=False (the analytic estimate) for GPUs")
    library = find_libtpu()
    if library is None:
        raise ConfigError("exact", "libtpu (the TPU compiler) is not installed",
                          "run `make libtpu`, or set GEMMALAB_LIBTPU to a libtpu.so")
    # The whole config: a field the compiled step depends on cannot be left out.
    requests = [{"config": config.to_dict(), "accelerator": accelerator.name}
                for config, accelerator in targets]
    keys = [json.dumps(request, sort_keys=True) for request in requests]
    distinct = list(dict.fromkeys(keys))
    # Compile-only: no chip is opened, so several planners may run at once (libtpu otherwise
    # takes a machine-wide lock meant for processes that drive real chips).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_LIBRARY_PATH": library,
           "TF_CPP_MIN_LOG_LEVEL": "3", "XLA_FLAGS": "", "TPU_SKIP_MDS_QUERY": "1",
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    argument = json.dumps({"requests": [requests[keys.index(key)] for key in distinct]})
    result = subprocess.run([sys.executable, "-m", AOT_COMPILER, argument],
                            env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        names = ", ".join(dict.fromkeys(accelerator.name for _, accelerator in targets))
        raise RuntimeError(f"compiling for {names} failed:\n{tail}")
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    compiled = dict(zip(distinct, (json.loads(line) for line in lines[-len(distinct):]),
                        strict=True))
    plans = []
    for key, analytic in zip(keys, analytics, strict=True):
        step = compiled[key]
        plans.append(dataclasses.replace(
            analytic, method="compiled", breakdown=step["breakdown"],
            flops_per_step=step["flops"],
            traffic={"xla_bytes_accessed": int(step["bytes_accessed"])},
            compile_seconds=step["seconds"], analytic=analytic))
    return plans


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Per-device memory of a gemmalab training run, "
                                     "and its roofline time (an upper bound on speed).")
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--accelerator", default="v6e")
    parser.add_argument("--mesh", default=None, help='JSON, e.g. \'{"fsdp": -1}\'')
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--maxlen", type=int, default=256)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    parser.add_argument("--lora-modules", default="all")
    parser.add_argument("--objective", default="sft", choices=OBJECTIVES,
                        help="dpo: also the reference model's forward pass (and weights)")
    parser.add_argument("--datacount", type=int, default=None,
                        help="examples in the run, for its length (None: unknown)")
    parser.add_argument("--num-epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None, help="the run's steps instead")
    parser.add_argument("--price-per-chip-hour", type=float, default=None,
                        help="what one chip costs an hour: the roofline run's cost")
    parser.add_argument("--exact", action="store_true", help="compile with libtpu (TPU only)")
    parser.add_argument("--table", action="store_true",
                        help="markdown: what fits on 1-32 chips of --accelerator's kind")
    args = parser.parse_args(argv)
    if args.table:
        rows = fit_table(parse_accelerator(args.accelerator).kind, lora_rank=args.lora_rank)
        print("| " + " | ".join(rows[0]) + " |")
        print("|" + "---|" * len(rows[0]))
        for row in rows:
            print("| " + " | ".join(str(v) for v in row.values()) + " |")
        return
    config = TrainConfig.flat(model=args.model, mesh=json.loads(args.mesh) if args.mesh else None,
                         batch_size=args.batch_size, maxlen=args.maxlen, remat=args.remat,
                         grad_accum_steps=args.grad_accum_steps, lora_rank=args.lora_rank,
                         lora_modules=args.lora_modules, objective=args.objective,
                         datacount=args.datacount,
                         num_epochs=args.num_epochs, max_steps=args.max_steps,
                         tokenizer="local" if args.model == "gemma3-tiny" else "gemma3")
    plan = (compile_plan if args.exact else estimate)(
        config, args.accelerator, price_per_chip_hour=args.price_per_chip_hour)
    print(json.dumps(plan.to_dict(), indent=2))
    print(plan.summary_line(), plan.roofline_line(), sep="\n", file=sys.stderr)


if __name__ == "__main__":
    main()
