"""Per-device memory of one training step: ``estimate``, the analytic ``MemoryPlan`` (weights,
optimizer state, gradients, weight copies, activations, the loss's logits chunk, the batch), and
its roofline (``gemmalab.plan.roofline``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from gemmalab.accelerators import GIB, Accelerator, parse_accelerator
from gemmalab.config import (
    AXES,
    DATA_AXIS,
    FSDP_AXIS,
    LoRAConfig,
    ModelConfig,
    RuntimeConfig,
    TrainConfig,
    TrainerConfig,
    resolve_mesh_shape,
)
from gemmalab.data_parallel import batch_ways, check_batch_split, check_expert_axis
from gemmalab.errors import ConfigError
from gemmalab.model import attention, quantization
from gemmalab.plan.roofline import Roofline, check_price, model_flops, run_steps, traffic_bytes
from gemmalab.plan.shapes import (
    BATCH_FIELD_COUNT,
    abstract_params,
    active_adapters,
    adapter_params,
    block_dims,
    expert_activations,
    expert_kept_bytes,
    preference_segments_bound,
    vocab_size_hint,
)
from gemmalab.weights import resolution

# A run "fits" when the plan stays under this share of the device's memory: the rest is the
# runtime's own, fragmentation and the error of the estimate.
USABLE_FRACTION = 0.95


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


def resolved_mesh(runtime: RuntimeConfig, chips: int) -> dict[str, int]:
    """The mesh axes' sizes ``runtime.mesh`` comes to on ``chips`` chips in its slices."""
    if chips % runtime.num_slices:
        raise ConfigError(
            "num_slices",
            f"{runtime.num_slices} does not divide {chips} chips",
            "use the number of slices the chips come in",
        )
    sizes = resolve_mesh_shape(runtime.mesh, chips // runtime.num_slices)
    return {**sizes, DATA_AXIS: sizes[DATA_AXIS] * runtime.num_slices}


def estimate(config: TrainConfig, accelerator: Accelerator | str, *,
             price_per_chip_hour: float | None = None) -> MemoryPlan:
    """The analytic plan: instant, no accelerator needed. ``price_per_chip_hour``: what one chip
    costs an hour, for the roofline's run cost.

    With ``config.trainer.objective == "dpo"`` the step also runs the reference model forward (no
    backward pass through it). Full fine-tuning holds its weights, a compute-dtype copy of the
    starting weights sharded like the params: the breakdown's ``"reference"``; with LoRA the
    reference is the frozen base already in ``"params"``, nothing more. Its forward pass adds its
    transient bytes to ``"weight_copies"`` and ``"activations"`` (``_reference_gather_bytes``,
    ``_activation_bytes``), its FLOPs (``model_flops``) and its HBM traffic
    (``roofline.traffic_bytes``).
    """
    config = resolution.resolve(config).config  # a run's choices, decided as it decides them
    import jax
    import numpy as np
    from jax.sharding import AbstractMesh

    from gemmalab.model import presets, sharding

    price_per_chip_hour = check_price(price_per_chip_hour)
    if isinstance(accelerator, str):
        accelerator = parse_accelerator(accelerator)
    sizes = resolved_mesh(config.runtime, accelerator.chips)
    abstract_mesh = AbstractMesh(tuple(sizes[a] for a in AXES), AXES)
    check_expert_axis(sizes, config.model.preset, config.model.expert_capacity_factor)
    data_ways = batch_ways(sizes)
    check_batch_split(config.trainer.batch_size, data_ways, config.trainer.grad_accum_steps,
                      where=f"mesh {sizes} on {accelerator.name}")
    vocab = vocab_size_hint(config.model)
    model_config = presets.model_config(config.model.preset, vocab, config.model.num_layers)
    params = abstract_params(model_config, config.model.param_dtype)
    quantization.check_base(config.lora.base_quantization, params, sizes)
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
    # Without LoRA every weight trains; with it the adapters train (replicated, bar the experts'
    # split over the expert axis) and the base weights are held once, frozen, in the compute
    # dtype.
    adapter_tree = adapter_params(model_config, config.lora, config.model.param_dtype)
    adapters = sum(leaf.size for leaf in jax.tree.leaves(adapter_tree))
    held_adapters = sum(
        math.prod(dim // _ways(axis, sizes) for dim, axis in
                  zip(leaf.shape, tuple(sharding.weight_spec(path, leaf.shape, abstract_mesh))
                      + (None,) * leaf.ndim, strict=False))
        for path, leaf in jax.tree_util.tree_leaves_with_path(adapter_tree))
    trained = held_adapters if config.lora.rank else sum(shards.values())
    base_size = c_size if config.lora.rank else p_size
    weights = trained * p_size
    accumulating = config.trainer.grad_accum_steps > 1
    dpo = config.trainer.objective == "dpo"
    # Full fine-tuning DPO's reference: the starting weights in the compute dtype, cut like the
    # params (LoRA's reference is its frozen base, counted in "params").
    reference = {"reference": sum(shards.values()) * c_size} if dpo and not config.lora.rank \
        else {}
    quantized = _quantized_base_bytes(model_config, config.lora, config.model, abstract_mesh,
                                      sizes, used)
    held_base = quantized[0] if quantized else sum(shards.values()) * c_size
    breakdown = {
        "params": (held_base + weights) if config.lora.rank else weights,
        # QLoRA: the projections dequantized for the matmuls (see _quantized_base_bytes).
        **({"dequantized": quantized[1]} if quantized else {}),
        **reference,
        "optimizer": 2 * weights,  # AdamW's two moments, in the params' dtype
        # Gradients of the compute-dtype weights, all alive for the global-norm clip; a
        # master-dtype accumulator besides them when micro-batches are summed.
        "gradients": trained * c_size + (weights if accumulating else 0),
        "weight_copies": (
            _weight_copy_bytes(shards, gathered, config.model.remat, base_size, c_size)
            + (_reference_gather_bytes(gathered, c_size) if reference else 0)
        ),
        "activations": _activation_bytes(
            model_config, sizes, c_size, model=config.model, trainer=config.trainer,
            maxlen=config.data.maxlen,
            attention_impl=attention.implementation(config.model.attention, accelerator.platform,
                                                    model_config)
        ),
        "logits": _logits_bytes(config.trainer, config.data.maxlen, sizes, vocab, data_ways,
                                accelerator.platform),
        "batch": BATCH_FIELD_COUNT
        * 4
        * config.trainer.batch_size
        // data_ways
        * config.data.maxlen,
        # The compiled program itself: 0.27-0.48 GiB in the compiled steps of docs/scaling.md.
        "code": 0 if accelerator.platform == "cpu" else int(0.4 * GIB),
    }
    return MemoryPlan(
        method="analytic", model=config.model.preset, accelerator=accelerator, mesh=sizes,
        batch_size=config.trainer.batch_size, maxlen=config.data.maxlen,
        grad_accum_steps=config.trainer.grad_accum_steps, remat=config.model.remat,
        param_dtype=config.model.param_dtype, compute_dtype=config.model.compute_dtype,
        breakdown=breakdown,
        flops_per_step=model_flops(model_config, num_params, batch_size=config.trainer.batch_size,
                                   maxlen=config.data.maxlen, lora=config.lora.enabled, dpo=dpo,
                                   adapters=active_adapters(model_config, adapter_tree)),
        num_params=num_params + adapters, lora_rank=config.lora.rank,
        trainable_params=adapters if config.lora.rank else num_params,
        traffic=traffic_bytes(model_config, sizes, accelerator, model=config.model,
                              trainer=config.trainer, maxlen=config.data.maxlen,
                              lora=config.lora.enabled, shards=shards, used=used,
                              trained=trained, p_size=p_size, c_size=c_size, vocab=vocab),
        run_steps=run_steps(config.trainer, config.data.datacount),
        price_per_chip_hour=price_per_chip_hour,
        objective=config.trainer.objective)


def _ways(axis: Any, sizes: dict[str, int]) -> int:
    if axis is None:
        return 1
    axes = axis if isinstance(axis, tuple) else (axis,)
    return math.prod(sizes[a] for a in axes)


def _quantized_base_bytes(model_config: Any, lora_config: LoRAConfig, model: ModelConfig,
                          abstract_mesh: Any, sizes: dict[str, int], used: dict[str, int]
                          ) -> tuple[int, int] | None:
    """QLoRA (``lora.base_quantization``): ``(bytes of the quantized base one device holds,
    bytes of its dequantized copies)``, else None.

    The held base: each leaf as ``quantization.abstract_base`` makes it (values at their bits,
    scales in the compute dtype) cut by the one table. Its copies: a projection dequantizes
    inside its block, so with remat two blocks' weights are alive at once in the compute dtype,
    and without remat every block's (the backward pass keeps what the forward dequantized)."""
    fmt = lora_config.base_quantization
    if not lora_config.rank or fmt == "none":
        return None
    import jax
    import numpy as np

    from gemmalab.model import sharding

    base = quantization.abstract_base(abstract_params(model_config, model.compute_dtype),
                                      fmt, model.compute_dtype)
    held = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(base):
        spec = tuple(sharding.weight_spec(path, leaf.shape, abstract_mesh))
        ways = math.prod(_ways(axis, sizes) for axis in spec)
        held += sharding.array_bytes(leaf) // ways
    c_size = np.dtype(jax.numpy.dtype(model.compute_dtype)).itemsize
    blocks = [n for k, n in used.items() if k.startswith("layer_")]
    live = sum(blocks) if model.remat == "none" else 2 * max(blocks, default=0)
    return held, live * c_size


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


def _activation_bytes(model_config: Any, sizes: dict[str, int], c_size: int, *,
                      model: ModelConfig, trainer: TrainerConfig, maxlen: int,
                      attention_impl: str = "gemma") -> int:
    """What the backward pass keeps of one micro-batch, plus one block's working set.

    ``attention_impl`` (resolved, gemmalab.model.attention): splash keeps no scores; blocked
    keeps those of its blocks (``attention.blocked_score_share`` of a causal row's, counted for
    every layer: a local layer's share is smaller).

    DPO (``trainer.objective``): the reference's forward pass runs after the policy's
    forward and
    before its backward (the loss needs both), so its working set (one block, one logits chunk)
    is alive with what the backward pass keeps but not with the backward's own working set,
    which is larger: it adds nothing here but its output, the final hidden states (one row of
    ``d`` a token), alive until its loss has run. Both losses are per segment
    (``cross_entropy.chunked_segment_nll``): the backward pass weighs every position by its
    segment's cotangent through a float32 one-hot over ``preference_segments_bound`` segments,
    counted whole (all chunks at once).
    """
    d, hd, heads, kv_heads, ffw = block_dims(model_config, sizes)
    length = maxlen
    rows = trainer.batch_size // (batch_ways(sizes) * trainer.grad_accum_steps)
    tokens = rows * length
    # Per token of one block, what XLA keeps for the backward pass (calibrated against the
    # compiled step, docs/scaling.md): the block input, q/k/v, the attention output, the gated
    # MLP's gate, up and activation in the compute dtype, and the attention logits and
    # probabilities over the sequence in float32.
    block = (2 * d + 2 * heads * hd + 2 * kv_heads * hd + 3 * ffw
             + expert_activations(model_config, sizes, model.expert_capacity_factor)) * c_size
    if attention_impl == "splash":  # no scores; q, k, v and the output in heads-major layout
        block += (2 * heads * hd + 2 * kv_heads * hd) * c_size
    else:
        block += round(heads * length * 2 * 4 * attention.score_share(attention_impl, length))
    kept = {"none": block,
            # the weight matmuls' outputs: q, k, v, attention output, gate and up, down
            "dots": (2 * d + (heads + 2 * kv_heads) * hd + 2 * ffw) * c_size
            + expert_kept_bytes(model_config),
            "full": d * c_size + expert_kept_bytes(model_config)}[model.remat]
    layers = model_config.num_layers
    working = 0 if model.remat == "none" else block  # one block recomputed at a time
    preference = 0
    if trainer.objective == "dpo":  # the reference's hidden states; the segments' one-hot
        preference = d * c_size + preference_segments_bound(length) * 4
    return tokens * (layers * kept + working + block + 4 * d * c_size + preference)


def _logits_bytes(trainer: TrainerConfig, maxlen: int, sizes: dict[str, int], vocab: int,
                  data_ways: int, platform: str) -> int:
    """The loss's logits chunk on ``platform``: float32 values and half as much again for the
    softmax and its gradient (as compiled, docs/scaling.md)."""
    from gemmalab.model.cross_entropy import chunk_logits

    tokens = trainer.batch_size // trainer.grad_accum_steps * maxlen
    chunk = max(1, min(tokens, chunk_logits(platform) // vocab))
    vocab_shard = vocab // sizes["tensor"] if vocab % sizes["tensor"] == 0 else vocab
    return 6 * -(-chunk // data_ways) * vocab_shard


def write_json(memory_plan: MemoryPlan, output_dir: str) -> str:
    """``output_dir/plan.json`` (local or gs://); returns its path."""
    from etils import epath

    directory = epath.Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "plan.json"
    path.write_text(json.dumps(memory_plan.to_dict(), indent=1))
    return str(path)
