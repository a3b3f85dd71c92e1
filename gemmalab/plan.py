"""Will a run fit? Per-device memory of a training run, before renting the slice.

One description of the run (a ``TrainConfig``: model, mesh, batch, maxlen, remat, dtypes) and an
accelerator (``"v6e:2x4"``, ``"v5p:2x2x2"``, ``"h200:8"``) give a ``MemoryPlan`` two ways:

- ``estimate``, analytic and instant: weights, optimizer state and gradients from the real
  parameter shapes cut by the real sharding rules (``gemmalab.model.sharding``), activations from a
  per-token count of what the backward pass keeps for each remat policy, and the loss's logits
  chunk. It needs no accelerator and is what ``train.ipynb`` checks before loading weights.
- ``compile_plan``, exact (TPU targets): the real train step, lowered with abstract inputs and
  compiled by libtpu for the topology, on a CPU-only machine; XLA's own memory analysis and
  FLOP count. It runs in a subprocess (``python -m gemmalab.plan``) with libtpu from
  ``.libtpu/`` (``make libtpu``), so the calling process never loads the TPU runtime.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from gemmalab.config import AXES, DATA_AXIS, FSDP_AXIS, REMAT_POLICIES, TrainConfig
from gemmalab.errors import ConfigError

BATCH_FIELD_COUNT = 5  # int32 rows per batch: gemmalab.data.packing.FIELDS

GIB = 1 << 30
# A run "fits" when the plan stays under this share of the device's memory: the rest is the
# runtime's own, fragmentation and the error of the estimate.
USABLE_FRACTION = 0.95
GEMMA3_VOCAB = 262_144


@dataclasses.dataclass(frozen=True)
class Chip:
    platform: str  # "tpu" | "gpu" | "cpu"
    memory_gib: float  # HBM per chip
    peak_tflops: float  # dense bf16 per chip
    topology_dims: int = 0  # TPU: 2 (e.g. 2x4) or 3 (e.g. 2x2x2); 0 for GPUs


CHIPS: dict[str, Chip] = {
    "v4": Chip("tpu", 32, 275, 3),
    "v5e": Chip("tpu", 16, 197, 2),
    "v5p": Chip("tpu", 95, 459, 3),
    "v6e": Chip("tpu", 32, 918, 2),
    "h100": Chip("gpu", 79.6, 989),  # 81,559 MiB as the driver reports it
    "h200": Chip("gpu", 140.4, 989),  # 143,771 MiB
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

    @property
    def platform(self) -> str:
        return CHIPS[self.kind].platform if self.kind in CHIPS else "cpu"

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
                       topology)


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
                       chip.peak_tflops * 1e12)


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


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one training step, by part, against the device's memory."""

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
            "param_dtype": self.param_dtype,
            "compute_dtype": self.compute_dtype,
            "flops_per_step": self.flops_per_step,
            "step_seconds_at_peak": self.step_seconds_at_peak,
            "compile_seconds": self.compile_seconds,
        }
        if self.analytic is not None:
            out["analytic"] = self.analytic.to_dict()
        return out

    def summary_line(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"{self.model} on {self.accelerator.name} mesh {self.mesh}: "
                f"{self.per_device_bytes / GIB:.2f} GiB per device of "
                f"{self.usable_bytes / GIB:.2f} GiB usable -> {verdict} ({self.method})")


def vocab_size_hint(config: TrainConfig) -> int:
    """The embedding rows the run will have, known before the tokenizer is loaded."""
    if config.model == "gemma3-tiny" and config.tokenizer == "local":
        return config.tokenizer_vocab_size
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
    if not config.lora_rank:
        return {}
    from gemmalab.model import lora

    return lora.abstract_adapters(model_config, rank=config.lora_rank,
                                  modules=config.lora_modules, dtype=config.param_dtype,
                                  token_rows=token_rows)


def resolved_mesh(config: TrainConfig, chips: int) -> dict[str, int]:
    from gemmalab.config import DATA_AXIS, resolve_mesh_shape

    if chips % config.num_slices:
        raise ConfigError("num_slices", f"{config.num_slices} does not divide {chips} chips",
                          "use the number of slices the chips come in")
    sizes = resolve_mesh_shape(config.mesh, chips // config.num_slices)
    return {**sizes, DATA_AXIS: sizes[DATA_AXIS] * config.num_slices}


def estimate(config: TrainConfig, accelerator: Accelerator | str) -> MemoryPlan:
    """The analytic plan: instant, no accelerator needed."""
    import jax
    import numpy as np
    from jax.sharding import AbstractMesh

    from gemmalab.model import presets, sharding

    if isinstance(accelerator, str):
        accelerator = parse_accelerator(accelerator)
    sizes = resolved_mesh(config, accelerator.chips)
    abstract_mesh = AbstractMesh(tuple(sizes[a] for a in AXES), AXES)
    data_ways = sizes[DATA_AXIS] * sizes[FSDP_AXIS]
    if config.batch_size % (data_ways * config.grad_accum_steps):
        raise ConfigError("batch_size", f"{config.batch_size} rows do not split over "
                          f"{data_ways} data-parallel ways x {config.grad_accum_steps} "
                          f"micro-batches (mesh {sizes})",
                          f"use a multiple of {data_ways * config.grad_accum_steps}")
    vocab = vocab_size_hint(config)
    model_config = presets.model_config(config.model, vocab)
    params = abstract_params(model_config, config.param_dtype)
    p_size = np.dtype(config.param_dtype).itemsize
    c_size = np.dtype(jax.numpy.dtype(config.compute_dtype)).itemsize

    shards = {}  # module (embedder, layer_0, ...) -> elements one device holds
    gathered = {}  # module -> elements after the fsdp all-gather (weights split over fsdp)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        spec = sharding.weight_spec(path, leaf.shape, abstract_mesh)
        per_device = math.prod(dim // _ways(axis, sizes) for dim, axis in
                               zip(leaf.shape, tuple(spec) + (None,) * leaf.ndim, strict=False))
        module = sharding.dict_path(path)[0]
        shards[module] = shards.get(module, 0) + per_device
        if FSDP_AXIS in tuple(spec):
            gathered[module] = gathered.get(module, 0) + per_device * sizes[FSDP_AXIS]
    num_params = sum(leaf.size for leaf in jax.tree.leaves(params))
    # Without LoRA every weight trains; with it the adapters (replicated) train and the base
    # weights are held once, frozen, in the compute dtype.
    adapters = sum(leaf.size for leaf in jax.tree.leaves(adapter_params(model_config, config)))
    trained = adapters if config.lora_rank else sum(shards.values())
    base_size = c_size if config.lora_rank else p_size
    weights = trained * p_size
    accumulating = config.grad_accum_steps > 1
    breakdown = {
        "params": (sum(shards.values()) * c_size + weights) if config.lora_rank else weights,
        "optimizer": 2 * weights,  # AdamW's two moments, in the params' dtype
        # Gradients of the compute-dtype weights, all alive for the global-norm clip; a
        # master-dtype accumulator besides them when micro-batches are summed.
        "gradients": trained * c_size + (weights if accumulating else 0),
        "weight_copies": _weight_copy_bytes(shards, gathered, config.remat, base_size, c_size),
        "activations": _activation_bytes(model_config, sizes, config, c_size,
                                         splash=_runs_splash(config, accelerator)),
        "logits": _logits_bytes(config, sizes, vocab, data_ways),
        "batch": BATCH_FIELD_COUNT * 4 * config.batch_size // data_ways * config.maxlen,
        # The compiled program itself: 0.27-0.48 GiB in the compiled steps of docs/scaling.md.
        "code": 0 if accelerator.platform == "cpu" else int(0.4 * GIB),
    }
    return MemoryPlan(
        method="analytic", model=config.model, accelerator=accelerator, mesh=sizes,
        batch_size=config.batch_size, maxlen=config.maxlen,
        grad_accum_steps=config.grad_accum_steps, remat=config.remat,
        param_dtype=config.param_dtype, compute_dtype=config.compute_dtype,
        breakdown=breakdown,
        flops_per_step=model_flops(model_config, num_params, config, adapters=adapters),
        num_params=num_params + adapters, lora_rank=config.lora_rank,
        trainable_params=adapters if config.lora_rank else num_params)


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


def _runs_splash(config: TrainConfig, accelerator: Accelerator) -> bool:
    from gemmalab.model import attention

    return attention.resolve(config.attention, accelerator.platform) == "splash"


def _activation_bytes(model_config: Any, sizes: dict[str, int], config: TrainConfig,
                      c_size: int, *, splash: bool = False) -> int:
    """What the backward pass keeps of one micro-batch, plus one block's working set.

    ``splash``: attention by the splash kernel (gemmalab.model.attention), which keeps no scores.
    """
    tensor = sizes["tensor"]

    def split(n: int) -> int:
        return n // tensor if n % tensor == 0 else n

    d, hd, length = model_config.embed_dim, model_config.head_dim, config.maxlen
    heads, kv_heads = split(model_config.num_heads), split(model_config.num_kv_heads)
    ffw = split(model_config.hidden_dim)
    rows = config.batch_size // (sizes["data"] * sizes["fsdp"] * config.grad_accum_steps)
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
            "full": d * c_size}[config.remat]
    layers = model_config.num_layers
    working = 0 if config.remat == "none" else block  # one block recomputed at a time
    return tokens * (layers * kept + working + block + 4 * d * c_size)


def _logits_bytes(config: TrainConfig, sizes: dict[str, int], vocab: int, data_ways: int) -> int:
    """The loss's logits chunk: float32 values and half as much again for the softmax and its
    gradient (as compiled, docs/scaling.md)."""
    from gemmalab.model.cross_entropy import LOSS_CHUNK_LOGITS

    tokens = config.batch_size // config.grad_accum_steps * config.maxlen
    chunk = max(1, min(tokens, LOSS_CHUNK_LOGITS // vocab))
    vocab_shard = vocab // sizes["tensor"] if vocab % sizes["tensor"] == 0 else vocab
    return 6 * -(-chunk // data_ways) * vocab_shard


def model_flops(model_config: Any, num_params: int, config: TrainConfig, *,
                adapters: int = 0) -> float:
    """Training FLOPs of one step: 6 per weight per token (the tied embedding counted once, as
    the output projection) plus attention's score and value products; remat's recompute is not
    counted (these are the FLOPs MFU is measured against). With LoRA a frozen weight costs 4
    (forward, and the gradient through it; none for itself) and each adapter weight 6."""
    tokens = config.batch_size * config.maxlen
    attention = (12 * model_config.num_layers * model_config.num_heads * model_config.head_dim
                 * config.maxlen)
    per_weight = 4 if config.lora_rank else 6
    return float(tokens * (per_weight * num_params + 6 * adapters + attention))


# ---------------------------------------------------------------------------------------------
# What to change when it does not fit.


def suggest_fit(config: TrainConfig, accelerator: Accelerator) -> tuple[dict[str, Any], MemoryPlan
                                                                        ] | None:
    """The first change that fits, and its plan, trying more micro-batches, then full remat,
    then both again with fsdp over every chip; None if nothing on this many chips does."""
    candidates: list[dict[str, Any]] = []
    for mesh_shape in (config.mesh, {"fsdp": -1}):
        # Not "dots": compiled for TPU it saved nothing over "none" (docs/scaling.md).
        for remat in dict.fromkeys((config.remat, "full")):
            accum = config.grad_accum_steps
            while True:
                candidates.append({"mesh": mesh_shape, "remat": remat, "grad_accum_steps": accum})
                accum *= 2
                if accum > config.batch_size:
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
    for mesh_shape in _unique([config.mesh, {"fsdp": -1}]):
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
                config = TrainConfig(model=model, tokenizer="gemma3", maxlen=maxlen,
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
                        grad_accum_steps=config.batch_size // chips), accelerator)
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
    problem = (f"{config.model} needs ~{plan.per_device_bytes / GIB:.1f} GiB per device ({parts}) "
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
                 timeout_s: float = 3600) -> MemoryPlan:
    """The exact plan: XLA's memory analysis of the step compiled by libtpu for the topology.

    Runs ``AOT_COMPILER`` (the train stage's step, compiled ahead of time) in a subprocess that
    loads libtpu (CPU-only machines welcome); the analytic estimate rides along for comparison.
    """
    if isinstance(accelerator, str):
        accelerator = parse_accelerator(accelerator)
    analytic = estimate(config, accelerator)  # validates mesh and batch first, instantly
    if accelerator.platform != "tpu":
        raise ConfigError("exact", f"the exact plan compiles for TPUs, not {accelerator.kind}",
                          "use exact=False (the analytic estimate) for GPUs")
    library = find_libtpu()
    if library is None:
        raise ConfigError("exact", "libtpu (the TPU compiler) is not installed",
                          "run `make libtpu`, or set GEMMALAB_LIBTPU to a libtpu.so")
    # Compile-only: no chip is opened, so several planners may run at once (libtpu otherwise
    # takes a machine-wide lock meant for processes that drive real chips).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_LIBRARY_PATH": library,
           "TF_CPP_MIN_LOG_LEVEL": "3", "XLA_FLAGS": "", "TPU_SKIP_MDS_QUERY": "1",
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    # The whole config: a field the compiled step depends on cannot be left out.
    request = json.dumps({"config": config.to_dict(), "accelerator": accelerator.name})
    result = subprocess.run([sys.executable, "-m", AOT_COMPILER, request],
                            env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"compiling for {accelerator.name} failed:\n{tail}")
    compiled = json.loads(result.stdout.strip().splitlines()[-1])
    return dataclasses.replace(analytic, method="compiled", breakdown=compiled["breakdown"],
                               flops_per_step=compiled["flops"],
                               compile_seconds=compiled["seconds"], analytic=analytic)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Per-device memory of a gemmalab training run.")
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--accelerator", default="v6e")
    parser.add_argument("--mesh", default=None, help='JSON, e.g. \'{"fsdp": -1}\'')
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--maxlen", type=int, default=256)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    parser.add_argument("--lora-modules", default="all")
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
    config = TrainConfig(model=args.model, mesh=json.loads(args.mesh) if args.mesh else None,
                         batch_size=args.batch_size, maxlen=args.maxlen, remat=args.remat,
                         grad_accum_steps=args.grad_accum_steps, lora_rank=args.lora_rank,
                         lora_modules=args.lora_modules,
                         tokenizer="local" if args.model == "gemma3-tiny" else "gemma3")
    plan = (compile_plan if args.exact else estimate)(config, args.accelerator)
    print(json.dumps(plan.to_dict(), indent=2))


if __name__ == "__main__":
    main()
