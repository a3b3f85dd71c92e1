"""The roofline: the fastest a step (and the run) can go on these chips. The step's model FLOPs
(``model_flops``, or XLA's ``compiled_cost``) at the chips' peak against its HBM bytes
(``traffic_bytes``, an analytic lower bound, or XLA's bytes accessed) at their bandwidth; the
run's steps (``run_steps``) and, given a price per chip-hour, its cost.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from gemmalab.accelerators import Accelerator
from gemmalab.config import ModelConfig, TrainerConfig
from gemmalab.data_parallel import batch_ways
from gemmalab.errors import ConfigError
from gemmalab.plan.shapes import (
    block_dims,
    expert_activations,
    layer_head_dims,
    matmul_params,
)

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


def run_steps(trainer: TrainerConfig, datacount: int | None) -> int | None:
    """The run's steps: ``max_steps``, else ``num_epochs`` epochs of ``datacount`` examples one
    a row (the tutorial's layout); None when ``datacount`` is None (unknown until the data is read).

    A gemmalab run takes fewer: it holds out ``eval_fraction`` of the examples, and packing puts
    several short ones in a row.
    """
    if trainer.max_steps is not None:
        return trainer.max_steps
    if datacount is None:
        return None
    return trainer.num_epochs * math.ceil(datacount / trainer.batch_size)


def model_flops(model_config: Any, num_params: int, *, batch_size: int, maxlen: int,
                lora: bool = False, dpo: bool = False, adapters: int = 0) -> float:
    """Training FLOPs of one step of ``batch_size`` rows of ``maxlen``: 6 per weight per token
    (the tied embedding counted once, as the output projection) plus attention's score and
    value products (4 per head dimension and position of the sequence a token and layer
    forward, 12 with the backward pass); remat's recompute is not counted (these are the FLOPs
    MFU is measured against). With ``lora`` a frozen weight costs 4 (forward, and the gradient
    through it; none for itself) and each of the ``adapters`` weights 6.

    ``dpo`` adds the reference model's forward pass: 2 more per base weight (``num_params``: 8
    in full fine-tuning, 6 with LoRA; the reference runs no adapters) and attention's forward
    products (16 instead of 12).

    Gemma 4: only the weights a token multiplies count (``matmul_params``: a mixture's active
    experts, not its per-layer embedding table, which is looked up), and each layer's
    attention at its own head width (the global layers' wider keys)."""
    tokens = batch_size * maxlen
    attention = ((16 if dpo else 12) * model_config.num_heads
                 * sum(layer_head_dims(model_config)) * maxlen)
    per_weight = (4 if lora else 6) + (2 if dpo else 0)
    return float(tokens * (per_weight * matmul_params(model_config, num_params)
                           + 6 * adapters + attention))


def compiled_cost(compiled: Any) -> dict[str, float]:
    """XLA's cost analysis of a compiled program (one device's): ``flops``, ``bytes accessed``
    and the rest; some jax versions wrap it in a one-element list, some give None."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(cost or {})


def traffic_bytes(model_config: Any, sizes: dict[str, int], accelerator: Accelerator, *,
                  model: ModelConfig, trainer: TrainerConfig, maxlen: int, lora: bool,
                  shards: dict[str, int], used: dict[str, int], trained: int, p_size: int,
                  c_size: int, vocab: int) -> dict[str, int]:
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

    accum = trainer.grad_accum_steps
    passes = 2 + (model.remat != "none")
    chunks = loss_chunks(trainer, maxlen, vocab, accelerator.platform)
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
    d, hd, heads, kv_heads, ffw = block_dims(model_config, sizes)
    tokens = (
        trainer.batch_size
        // (batch_ways(sizes) * accum)
        * maxlen
    )
    block = (2 * d + 2 * heads * hd + 2 * kv_heads * hd + 3 * ffw
             + expert_activations(model_config, sizes, model.expert_capacity_factor)) * c_size
    impl = attention.implementation(model.attention, accelerator.platform, model_config)
    if impl in ("gemma", "blocked") or (impl == "dot_product" and accelerator.platform != "gpu"):
        # float32 scores and probabilities
        block += round(heads * maxlen * 2 * 4 * attention.score_share(impl, maxlen))
    kept_input = 2 * d * c_size if model.remat == "full" else 0
    activations = accum * tokens * model_config.num_layers * (2 * block + kept_input)
    vocab_shard = vocab // sizes["tensor"] if vocab % sizes["tensor"] == 0 else vocab
    logits = accum * tokens * vocab_shard * c_size * (6 if chunks > 1 and not lora else 5)
    traffic = {"weights": weights, "gradients": gradients, "optimizer": 6 * trained * p_size,
               "activations": activations, "logits": logits}
    if trainer.objective == "dpo":
        traffic["reference"] = accum * (
            (blocks + chunks * embedding) * c_size
            + tokens * model_config.num_layers * 2 * block
            + tokens * vocab_shard * c_size * 2)
    return traffic


def loss_chunks(trainer: TrainerConfig, maxlen: int, vocab: int, platform: str) -> int:
    """How many logits chunks the loss of one micro-batch runs in on ``platform``
    (``chunked_cross_entropy``); 1: the whole micro-batch's logits at once."""
    from gemmalab.model.cross_entropy import chunk_logits

    span = max(1, chunk_logits(platform) // vocab // (trainer.batch_size
                                                      // trainer.grad_accum_steps))
    return 1 if span >= maxlen else -(-maxlen // span)
