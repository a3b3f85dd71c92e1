"""The train state, the optimizer and the jit-compiled steps.

One state pytree (``TrainState``) holds everything a resume needs besides the data iterator:
step, fp32 master params and optimizer state. Compute runs in ``compute_dtype`` (params are
cast inside the step, so gradients and updates stay in the master dtype). The loss is
``gemmalab.model.cross_entropy``'s.

With LoRA the state's params are the adapters alone; the base weights are a separate ``frozen``
tree (compute dtype, never updated, not donated) that each step joins to them.

With DPO (``Preference``) the steps compare the policy's sequence log-probabilities with the
reference's, the base model run on ``frozen``: with LoRA that is the base itself (the adapters
off, no extra weights); in full fine-tuning it is a frozen compute-dtype copy of the starting
weights, passed in ``frozen``'s place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from gemmalab.model import (
    attention,
    cross_entropy,
    gemma4,
    lora,
    preference,
    presets,
    quantization,
    sharding,
)
from gemmalab.model import mesh as mesh_lib
from gemmalab.model.mesh import batch_sharding, global_batch, replicated

OPTIMIZER_SCOPE = "optimizer"  # jax.named_scope of the update's ops (their HLO op_name)


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def learning_rate_schedule(peak: float, total_steps: int, *, warmup_ratio: float,
                           min_lr_ratio: float) -> optax.Schedule:
    """Linear warmup to ``peak`` then cosine decay to ``peak * min_lr_ratio``."""
    warmup = int(round(total_steps * warmup_ratio))
    if total_steps <= 1:
        return optax.constant_schedule(peak)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else peak, peak_value=peak, warmup_steps=warmup,
        decay_steps=total_steps, end_value=peak * min_lr_ratio)


def make_optimizer(schedule: optax.Schedule, *, weight_decay: float, b1: float, b2: float,
                   max_grad_norm: float) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW; norms' scales (1-D params) are not decayed."""
    return optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay,
                    mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)),
    )


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """``[B, L, L]``: causal, within one segment, and nothing for padding (segment 0)."""
    length = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids > 0)[:, :, None]
    return causal[None] & same & real


@dataclasses.dataclass(frozen=True)
class Preference:
    """DPO's settings for the steps (``make_train_step``/``make_eval_step``; None: SFT).

    ``reference_model``: the base model (no adapters), run on ``frozen`` for the reference's
    log-probabilities. ``adapters``: the policy is a LoRA model whose ``frozen`` is its own base
    (else ``frozen`` is only the reference's copy). ``num_segments``: the most segments a row
    can hold (a static bound: two per pair). ``rpo_alpha``: the weight of RPO's NLL term on the
    chosen replies (0: plain DPO)."""

    reference_model: Any
    beta: float
    label_smoothing: float
    num_segments: int
    adapters: bool
    rpo_alpha: float = 0.0

    @classmethod
    def of(cls, dpo: Any, reference_model: Any, num_segments: int, *, adapters: bool
           ) -> Preference:
        """A ``DPOConfig``'s settings with the base model as the reference; ``adapters``: the
        policy is LoRA over that base (the reference is the base with the adapters off)."""
        return cls(reference_model=reference_model, beta=dpo.beta,
                   label_smoothing=dpo.label_smoothing, num_segments=num_segments,
                   adapters=adapters, rpo_alpha=dpo.rpo_alpha)


def _hidden_states(model: Any, params: Any, batch: dict[str, jax.Array], compute_dtype: Any,
                   frozen: Any = None) -> tuple[jax.Array, jax.Array, Any, dict[str, jax.Array]]:
    """``(hidden states [B, L, D], output head, LoRA's row updates or None, router sums)`` of
    the batch (router sums: a mixture of experts' ``router_sums``, else empty).

    ``frozen``: the base weights a LoRA model's adapters (``params``) are joined to."""
    params = presets.cast_params(params, compute_dtype)
    head, row_updates = None, None
    if frozen is not None:
        frozen = presets.cast_params(frozen, compute_dtype)
        token_ids = lora.token_ids(model)
        if lora.TOKEN_ROWS in params:  # the output head: the frozen rows, the update apart
            head = frozen["embedder"]["input_embedding"]
            row_updates = (jnp.asarray(token_ids, jnp.int32), params[lora.TOKEN_ROWS])
        params = lora.join(frozen, params, token_ids)
    # A fused attention kernel takes the segments, not the [B, L, L] mask
    # (gemmalab.model.attention).
    mask = (attention.segment_starts(batch["segment_ids"]) if attention.kernel_of(model)
            else attention_mask(batch["segment_ids"]))
    # The model's own logits are unused (XLA drops them); the loss recomputes them in chunks.
    with quantization.dequantizing():  # QLoRA: a quantized base, dequantized in each matmul
        output, sown = model.apply({"params": params}, batch["tokens"],
                                   positions=batch["positions"], attention_mask=mask,
                                   return_hidden_states=True, mutable=[gemma4.ROUTER_COLLECTION])
    head = params["embedder"]["input_embedding"] if head is None else head
    return output.hidden_states, head, row_updates, router_sums(sown)


def router_sums(sown: Any) -> dict[str, jax.Array]:
    """A forward pass's router figures (``gemma4.router_metrics``) as sums that add up over
    micro-batches (``router_forwards``: how many were added); empty for dense models."""
    figures = gemma4.router_metrics(sown)
    return {**figures, "router_forwards": jnp.ones(())} if figures else {}


def forward_loss(model: Any, params: Any, batch: dict[str, jax.Array], compute_dtype: Any,
                 frozen: Any = None, mesh: Any = None) -> tuple[jax.Array, jax.Array]:
    """Sum of masked next-token NLL over the batch, and the number of loss-bearing targets.

    ``frozen``: the base weights a LoRA model's adapters (``params``) are joined to. ``mesh``:
    the one the batch is split over (None: let XLA place the loss's chunks).
    """
    hidden, head, row_updates, router = _hidden_states(model, params, batch, compute_dtype,
                                                       frozen)
    total, count = cross_entropy.chunked_cross_entropy(
        hidden, head, batch["targets"], batch["loss_mask"] > 0,
        softcap=model.config.final_logit_softcap,
        max_logits=cross_entropy.chunk_logits(mesh_lib.platform(mesh)), mesh=mesh,
        row_updates=row_updates)
    return total, count, router


def segment_logps(model: Any, params: Any, batch: dict[str, jax.Array], compute_dtype: Any,
                  num_segments: int, frozen: Any = None, mesh: Any = None
                  ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """``([B, num_segments] sequence log-probabilities, their loss-bearing tokens, router
    sums)``: each packed segment's sum over its loss-bearing targets, from the chunked loss."""
    hidden, head, row_updates, router = _hidden_states(model, params, batch, compute_dtype,
                                                       frozen)
    nll, counts = cross_entropy.chunked_segment_nll(
        hidden, head, batch["targets"], batch["loss_mask"] > 0, batch["segment_ids"],
        num_segments=num_segments, softcap=model.config.final_logit_softcap,
        max_logits=cross_entropy.chunk_logits(mesh_lib.platform(mesh)), mesh=mesh,
        row_updates=row_updates)
    return -nll, counts, router


def forward_preference(model: Any, params: Any, batch: dict[str, jax.Array], compute_dtype: Any,
                       frozen: Any, mesh: Any, settings: Preference
                       ) -> tuple[jax.Array, preference.PairSums, dict[str, jax.Array]]:
    """DPO's loss summed over the batch's pairs, its sums (``preference.dpo_sums``) and the
    policy's router sums: the policy (``model`` on ``params``) against the reference (the base
    on ``frozen``)."""
    policy, counts, router = segment_logps(model, params, batch, compute_dtype,
                                           settings.num_segments,
                                           frozen if settings.adapters else None, mesh)
    # The reference depends on no trained weight: autodiff runs no backward pass through it.
    reference, _, _ = segment_logps(settings.reference_model, jax.lax.stop_gradient(frozen),
                                    batch, compute_dtype, settings.num_segments, None, mesh)
    sums = preference.dpo_sums(policy, reference, counts, beta=settings.beta,
                               label_smoothing=settings.label_smoothing,
                               rpo_alpha=settings.rpo_alpha)
    return sums.loss, sums, router


def loss_sums(model: Any, params: Any, batch: dict[str, jax.Array], compute_dtype: Any,
              frozen: Any, mesh: Any, settings: Preference | None = None
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The objective's summed loss (what is differentiated) and its sums: ``count`` (what the
    loss is a mean over: loss-bearing targets, or DPO's pairs), ``useful_tokens`` and, for
    DPO, the pairs' diagnostics. Sums, so micro-batches and eval batches add up."""
    if settings is None:
        total, count, router = forward_loss(model, params, batch, compute_dtype, frozen, mesh)
        return total, {"count": count, "useful_tokens": count, **router}
    total, sums, router = forward_preference(model, params, batch, compute_dtype, frozen, mesh,
                                             settings)
    return total, {**sums._asdict(), "count": sums.pairs, "useful_tokens": sums.response_tokens,
                   **router}


def sums_metrics(total: jax.Array, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The logged means of a step's (or an evaluation's) sums: ``loss``, ``useful_tokens``, and
    for DPO ``preference.pair_means``'s (``reward_accuracy``, ``kl_estimate``, ...)."""
    metrics = {"loss": total / jnp.maximum(sums["count"], 1.0),
               "useful_tokens": sums["useful_tokens"]}
    if "router_forwards" in sums:  # a mixture of experts: the router's, per forward pass
        metrics.update({name: sums[name] / sums["router_forwards"]
                        for name in ("router_balance_loss", "router_max_load", "router_dropped")})
    if "pairs" in sums:
        fields = preference.PairSums._fields
        means = preference.pair_means(preference.PairSums(**{k: sums[k] for k in fields}))
        metrics.update(means)
    return metrics


def make_train_step(model: Any, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, compute_dtype: Any, mesh: Any, state_shardings: Any,
                    *, grad_accum_steps: int = 1, skip_nonfinite: bool = False,
                    frozen_shardings: Any = None, preference_settings: Preference | None = None
                    ) -> Callable[..., tuple[TrainState, dict]]:
    """One jit-compiled step ``(state, batch, frozen) -> (state, metrics)``; the incoming state
    is donated (updated in place) and keeps ``state_shardings`` (from ``state_sharding``).
    ``frozen``: LoRA's base weights, or full fine-tuning DPO's reference copy (placed by
    ``frozen_shardings``), read, never donated; None otherwise. (Positional: jit takes no
    keyword arguments beside its shardings.) ``preference_settings``: DPO's (None: SFT).

    With ``grad_accum_steps`` > 1 the batch is processed in that many micro-batches, one after
    the other, and their gradients summed: activations of one micro-batch at a time, the same
    update (the loss is the mean over every loss-bearing token, or pair, of the whole batch
    either way).

    With ``skip_nonfinite`` a step whose loss or gradient norm is not finite keeps the weights
    and optimizer state as they were (its metrics say ``skipped``: 1).
    """

    def step(state: TrainState, batch: dict[str, jax.Array], frozen: Any
             ) -> tuple[TrainState, dict]:
        (total, sums), grads = summed_gradients(model, state.params, batch, compute_dtype,
                                                mesh, grad_accum_steps, frozen,
                                                preference_settings)
        scale = 1.0 / jnp.maximum(sums["count"], 1.0)
        grads = jax.tree.map(lambda g: g * scale, grads)
        with jax.named_scope(OPTIMIZER_SCOPE):  # names the update's ops in profiles
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        metrics = {**sums_metrics(total, sums), "grad_norm": optax.tree.norm(grads),
                   "learning_rate": schedule(state.step)}
        if skip_nonfinite:
            finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
            params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                             (params, opt_state), (state.params, state.opt_state))
            metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return jax.jit(step, donate_argnums=(0,),
                   in_shardings=(state_shardings, batch_sharding(mesh), frozen_shardings),
                   out_shardings=(state_shardings, replicated(mesh)))


def summed_gradients(model: Any, params: Any, batch: dict[str, jax.Array], compute_dtype: Any,
                     mesh: Any, micro_batches: int, frozen: Any = None,
                     preference_settings: Preference | None = None
                     ) -> tuple[tuple[jax.Array, dict[str, jax.Array]], Any]:
    """``((summed loss, loss_sums' sums), gradient of the sum)`` over ``micro_batches``."""
    value_and_grad = jax.value_and_grad(
        lambda p, b: loss_sums(model, p, b, compute_dtype, frozen, mesh, preference_settings),
        has_aux=True)
    if micro_batches == 1:
        return value_and_grad(params, batch)
    # Micro-batch j takes rows j, j + n, j + 2n, ...: every device keeps working on its own rows.
    split = jax.tree.map(
        lambda x: x.reshape(x.shape[0] // micro_batches, micro_batches, *x.shape[1:])
        .swapaxes(0, 1), batch)

    def accumulate(carry: Any, micro: dict[str, jax.Array]) -> tuple[Any, None]:
        micro = jax.lax.with_sharding_constraint(micro, batch_sharding(mesh))
        return jax.tree.map(jnp.add, carry, value_and_grad(params, micro)), None

    zeros = jax.tree.map(jnp.zeros_like,
                         jax.eval_shape(value_and_grad, params, jax.tree.map(lambda x: x[0],
                                                                             split)))
    summed, _ = jax.lax.scan(accumulate, zeros, split)
    return summed


def make_eval_step(model: Any, compute_dtype: Any, mesh: Any, params_shardings: Any,
                   frozen_shardings: Any = None, preference_settings: Preference | None = None
                   ) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """``(params, batch, frozen) -> (summed loss, loss_sums' sums)``, jit-compiled
    (``frozen``: LoRA's base weights or DPO's reference copy, or None)."""
    def step(params: Any, batch: dict[str, jax.Array], frozen: Any
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
        return loss_sums(model, params, batch, compute_dtype, frozen, mesh, preference_settings)

    return jax.jit(step, in_shardings=(params_shardings, batch_sharding(mesh), frozen_shardings),
                   out_shardings=replicated(mesh))


def state_sharding(params: Any, optimizer: optax.GradientTransformation, mesh: Any
                   ) -> TrainState:
    """Where each leaf of the train state lives: weights by ``sharding.RULES``, each optimizer
    moment with its weight, counters replicated. ``params`` may be abstract."""
    weights = sharding.param_sharding(params, mesh)
    by_path = {sharding.dict_path(path): s
               for path, s in jax.tree_util.tree_leaves_with_path(weights)}
    shapes = {sharding.dict_path(path): leaf.shape
              for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    opt_shape = jax.eval_shape(optimizer.init, params)

    def moment(path: tuple, leaf: Any) -> Any:
        key = sharding.dict_path(path)
        return by_path[key] if shapes.get(key) == leaf.shape else replicated(mesh)

    return TrainState(step=replicated(mesh), params=weights,
                      opt_state=jax.tree_util.tree_map_with_path(moment, opt_shape))


def abstract_state(params: Any, optimizer: optax.GradientTransformation, shardings: TrainState
                   ) -> TrainState:
    """The train state as ``jax.ShapeDtypeStruct`` leaves with their shardings (nothing
    allocated): what a compile or a checkpoint restore targets. ``params`` may be abstract."""
    shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                        opt_state=jax.eval_shape(optimizer.init, params))
    return jax.tree.map(
        lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
        shapes, shardings)


def init_state(params: Any, optimizer: optax.GradientTransformation, mesh: Any
               ) -> tuple[TrainState, TrainState]:
    """The state placed on the mesh by its shardings; returns ``(state, shardings)``."""
    shardings = state_sharding(params, optimizer, mesh)
    params = jax.device_put(params, shardings.params)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    step = jax.device_put(jnp.asarray(0, jnp.int32), shardings.step)
    return TrainState(step=step, params=params, opt_state=opt_state), shardings


def evaluate(eval_step: Callable, params: Any, batches: list[dict[str, np.ndarray]], mesh: Any,
             frozen: Any = None) -> dict[str, float]:
    """The held-out metrics over the whole eval set: ``eval_loss`` (the mean over every
    loss-bearing target, or DPO's pairs), ``eval_perplexity`` (of the loss-bearing targets; for
    DPO of the chosen replies, under the policy) and, for DPO, the pairs' means (``eval_`` +
    ``sums_metrics``'s names: ``eval_reward_accuracy``, ``eval_kl_estimate``, ...)."""
    total, sums = 0.0, None
    for batch in batches:
        s, batch_sums = jax.device_get(eval_step(params, global_batch(batch, mesh), frozen))
        total += float(s)
        batch_sums = {k: float(v) for k, v in batch_sums.items()}
        sums = batch_sums if sums is None else {k: sums[k] + batch_sums[k] for k in sums}
    if sums is None:
        return {"eval_loss": float("nan"), "eval_perplexity": float("nan")}
    means = {k: float(v) for k, v in sums_metrics(np.float64(total), sums).items()}
    loss = means.pop("loss")
    if "pairs" not in sums:
        return {"eval_loss": loss, "eval_perplexity": float(np.exp(min(loss, 80.0)))}
    # DPO: the perplexity of the chosen replies (-log p per chosen token), and the pairs' means.
    nll_per_token = -sums["chosen_logp"] / max(sums["chosen_tokens"], 1.0)
    return {"eval_loss": loss, "eval_perplexity": float(np.exp(min(nll_per_token, 80.0))),
            **{f"eval_{k}": v for k, v in means.items() if k != "useful_tokens"}}
