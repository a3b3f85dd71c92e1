"""The train state, the loss, the optimizer and the jit-compiled steps.

One state pytree (``TrainState``) holds everything a resume needs besides the data iterator:
step, fp32 master params and optimizer state. Compute runs in ``compute_dtype`` (params are
cast inside the step, so gradients and updates stay in the master dtype).

With LoRA the state's params are the adapters alone; the base weights are a separate ``frozen``
tree (compute dtype, never updated, not donated) that each step joins to them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from gemmalab import attention, lora, sharding
from gemmalab.mesh import BATCH_AXES, batch_sharding, global_batch, replicated

# Largest logits block the loss materialises (elements): 1 GiB in fp32.
LOSS_CHUNK_LOGITS = 1 << 28


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


@jax.custom_vjp
def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``[..., V]`` logits (any float dtype), ``[...]`` ids -> fp32 negative log-likelihoods.

    The log-sum-exp runs in fp32 whatever the logits' dtype; unlike autodiff through a
    log-softmax, the backward pass keeps only the logits (in their own dtype) and one fp32
    log-sum-exp per token, and writes the logits' gradient straight in their dtype: no fp32
    ``[tokens, V]`` copies in memory (the loss's share of a small model's step on CPU).
    """
    return _token_nll_forward(logits, targets)[0]


def _token_nll_forward(logits: jax.Array, targets: jax.Array
                       ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    wide = logits.astype(jnp.float32)
    logsumexp = jax.nn.logsumexp(wide, axis=-1)
    picked = jnp.take_along_axis(wide, targets[..., None], axis=-1)[..., 0]
    return logsumexp - picked, (logits, targets, logsumexp)


def _token_nll_backward(residuals: tuple[jax.Array, jax.Array, jax.Array], cotangent: jax.Array
                        ) -> tuple[jax.Array, None]:
    logits, targets, logsumexp = residuals
    probs = jnp.exp(logits.astype(jnp.float32) - logsumexp[..., None])
    onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
    return ((probs - onehot) * cotangent[..., None]).astype(logits.dtype), None


token_nll.defvjp(_token_nll_forward, _token_nll_backward)


def masked_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array
                         ) -> tuple[jax.Array, jax.Array]:
    """Sum of next-token NLL over ``mask`` positions, and how many there are (fp32)."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(token_nll(logits, targets) * mask), jnp.sum(mask)


def cast_params(params: Any, dtype: Any) -> Any:
    """The compute copy of the (master-dtype) params."""
    return jax.tree.map(lambda p: p.astype(dtype), params)


def chunked_cross_entropy(hidden: jax.Array, embedding: jax.Array, targets: jax.Array,
                          mask: jax.Array, *, softcap: float | None = None,
                          max_logits: int, mesh: Any = None,
                          row_updates: tuple[jax.Array, jax.Array] | None = None
                          ) -> tuple[jax.Array, jax.Array]:
    """``masked_cross_entropy`` of the tied-embedding logits of ``[B, L, D]`` hidden states,
    about ``max_logits`` logits at a time. ``mesh``: the one the batch is split over.
    ``row_updates``: ``(ids, [len(ids), D] update)`` of a few embedding rows (LoRA's trained
    token rows), added to those logits apart, so the update's gradient is ``[len(ids), D]`` —
    folded into ``embedding`` it would take the whole ``[V, D]`` gradient, a second logits-sized
    matmul.

    With Gemma's 262k vocabulary the logits of a 128 x 256 batch take 34 GB in fp32; there the
    positions are processed in chunks, and each chunk's logits are recomputed in the backward
    pass instead of stored. A chunk is a span of positions of every row (at least one), never
    a run of whole rows: the rows stay where the batch sharding put them, so each device
    computes the logits of its own rows. (Chunks of the flattened tokens were whole devices'
    shares: under data parallelism every device gathered and computed each of them, 4x the
    loss's FLOPs on 4 chips.) Under fsdp the embedding is gathered whole first (its embed
    dimension is split over the rows' axis too; left to itself XLA moved the rows instead, and
    a 1B step took 2.8x the memory). When the whole batch's logits fit in one chunk (small
    vocabularies, small batches) they are kept: recomputing them would cost a third more of
    the loss's FLOPs for no memory saved.
    """
    rows, length, dim = hidden.shape
    vocab = embedding.shape[0]

    def one_chunk(args: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        h, t, m = args
        logits = jnp.einsum("...d,vd->...v", h, embedding)
        if row_updates is not None:
            ids, update = row_updates
            logits = logits.at[..., ids].add(jnp.einsum("...d,kd->...k", h, update))
        if softcap is not None:
            logits = jnp.tanh(logits / softcap) * softcap
        return masked_cross_entropy(logits, t, m)

    span = max(1, max_logits // vocab // rows)  # positions per chunk
    if span >= length:  # all logits fit in the bound: keep them, recompute nothing
        return one_chunk((hidden, targets, mask))
    padding = -length % span
    if padding:
        hidden = jnp.pad(hidden, ((0, 0), (0, padding), (0, 0)))
        targets, mask = (jnp.pad(x, ((0, 0), (0, padding))) for x in (targets, mask))
    count = (length + padding) // span
    chunks = (hidden.reshape(rows, count, span, dim).swapaxes(0, 1),
              targets.reshape(rows, count, span).swapaxes(0, 1),
              mask.reshape(rows, count, span).swapaxes(0, 1))
    if mesh is not None:
        chunks = jax.lax.with_sharding_constraint(
            chunks, NamedSharding(mesh, PartitionSpec(None, BATCH_AXES)))
        embedding = jax.lax.with_sharding_constraint(embedding, NamedSharding(
            mesh, sharding.gathered_spec("input_embedding", embedding.shape, mesh)))
    totals, counts = jax.lax.map(jax.checkpoint(one_chunk), chunks)
    return jnp.sum(totals), jnp.sum(counts)


def forward_loss(model: Any, params: Any, batch: dict[str, jax.Array], compute_dtype: Any,
                 frozen: Any = None, mesh: Any = None) -> tuple[jax.Array, jax.Array]:
    """Sum of masked next-token NLL over the batch, and the number of loss-bearing targets.

    ``frozen``: the base weights a LoRA model's adapters (``params``) are joined to. ``mesh``:
    the one the batch is split over (None: let XLA place the loss's chunks).
    """
    params = cast_params(params, compute_dtype)
    head, row_updates = None, None
    if frozen is not None:
        frozen = cast_params(frozen, compute_dtype)
        token_ids = lora.token_ids(model)
        if lora.TOKEN_ROWS in params:  # the output head: the frozen rows, the update apart
            head = frozen["embedder"]["input_embedding"]
            row_updates = (jnp.asarray(token_ids, jnp.int32), params[lora.TOKEN_ROWS])
        params = lora.join(frozen, params, token_ids)
    # A fused attention kernel takes the segments, not the [B, L, L] mask (gemmalab.attention).
    mask = (attention.segment_starts(batch["segment_ids"]) if attention.kernel_of(model)
            else attention_mask(batch["segment_ids"]))
    # The model's own logits are unused (XLA drops them); the loss recomputes them in chunks.
    output = model.apply({"params": params}, batch["tokens"], positions=batch["positions"],
                         attention_mask=mask, return_hidden_states=True)
    head = params["embedder"]["input_embedding"] if head is None else head
    return chunked_cross_entropy(output.hidden_states, head, batch["targets"],
                                 batch["loss_mask"] > 0, softcap=model.config.final_logit_softcap,
                                 max_logits=LOSS_CHUNK_LOGITS, mesh=mesh,
                                 row_updates=row_updates)


def make_train_step(model: Any, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, compute_dtype: Any, mesh: Any, state_shardings: Any,
                    *, grad_accum_steps: int = 1, skip_nonfinite: bool = False,
                    frozen_shardings: Any = None) -> Callable[..., tuple[TrainState, dict]]:
    """One jit-compiled step ``(state, batch, frozen) -> (state, metrics)``; the incoming state
    is donated (updated in place) and keeps ``state_shardings`` (from ``state_sharding``).
    ``frozen``: LoRA's base weights (placed by ``frozen_shardings``), read, never donated; None
    for full fine-tuning. (Positional: jit takes no keyword arguments beside its shardings.)

    With ``grad_accum_steps`` > 1 the batch is processed in that many micro-batches, one after
    the other, and their gradients summed: activations of one micro-batch at a time, the same
    update (the loss is the mean over every loss-bearing token of the whole batch either way).

    With ``skip_nonfinite`` a step whose loss or gradient norm is not finite keeps the weights
    and optimizer state as they were (its metrics say ``skipped``: 1).
    """

    def step(state: TrainState, batch: dict[str, jax.Array], frozen: Any
             ) -> tuple[TrainState, dict]:
        (total, count), grads = summed_gradients(model, state.params, batch, compute_dtype,
                                                 mesh, grad_accum_steps, frozen)
        scale = 1.0 / jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": total * scale, "useful_tokens": count,
                   "grad_norm": optax.tree.norm(grads), "learning_rate": schedule(state.step)}
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
                     mesh: Any, micro_batches: int, frozen: Any = None
                     ) -> tuple[tuple[jax.Array, jax.Array], Any]:
    """``((sum of NLL, loss-bearing targets), gradient of the sum)`` over ``micro_batches``."""
    value_and_grad = jax.value_and_grad(
        lambda p, b: forward_loss(model, p, b, compute_dtype, frozen, mesh), has_aux=True)
    if micro_batches == 1:
        return value_and_grad(params, batch)
    # Micro-batch j takes rows j, j + n, j + 2n, ...: every device keeps working on its own rows.
    split = jax.tree.map(
        lambda x: x.reshape(x.shape[0] // micro_batches, micro_batches, *x.shape[1:])
        .swapaxes(0, 1), batch)

    def accumulate(carry: Any, micro: dict[str, jax.Array]) -> tuple[Any, None]:
        micro = jax.lax.with_sharding_constraint(micro, batch_sharding(mesh))
        (total, count), grads = value_and_grad(params, micro)
        sums, counts, summed = carry
        return (sums + total, counts + count, jax.tree.map(jnp.add, summed, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
             jax.tree.map(jnp.zeros_like, params))
    (total, count, grads), _ = jax.lax.scan(accumulate, zeros, split)
    return (total, count), grads


def make_eval_step(model: Any, compute_dtype: Any, mesh: Any, params_shardings: Any,
                   frozen_shardings: Any = None) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """``(params, batch, frozen) -> (sum of NLL, loss-bearing targets)``, jit-compiled
    (``frozen``: LoRA's base weights, or None)."""
    def step(params: Any, batch: dict[str, jax.Array], frozen: Any
             ) -> tuple[jax.Array, jax.Array]:
        return forward_loss(model, params, batch, compute_dtype, frozen, mesh)

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
             frozen: Any = None) -> tuple[float, float]:
    """Mean loss over every loss-bearing target of the eval set, and its perplexity."""
    total, count = 0.0, 0.0
    for batch in batches:
        s, n = jax.device_get(eval_step(params, global_batch(batch, mesh), frozen))
        total += float(s)
        count += float(n)
    loss = total / max(count, 1.0)
    return loss, float(np.exp(min(loss, 80.0)))
