"""Next-token cross entropy: per-token NLL with a memory-lean gradient, and the chunked loss that
never materialises the whole ``[tokens, vocab]`` logits (a 262k vocabulary would not fit).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from gemmalab.model import sharding
from gemmalab.model.mesh import batch_axes

# Largest logits block the loss materialises (elements): 1 GiB in fp32 on accelerators.
LOSS_CHUNK_LOGITS = 1 << 28
# On CPUs half that: a step's temporaries live in one block, and the logits' share kept it above
# the 2 GiB up to which mimalloc's arenas keep freed blocks (the 270M's LoRA step at 8 x 128:
# 2.47 GiB, mapped afresh and faulted in every step; 1.72 GiB at half the chunk).
# bench/loss_chunk.py; docs/benchmarks/arena-bound.md.
CPU_LOSS_CHUNK_LOGITS = 1 << 27
LOSS_SCOPE = "cross_entropy"  # jax.named_scope of the loss's ops (their HLO op_name)
# Full fine-tuning's embedding gradient formed in the chunked loss's forward pass where it can be
# (``_fused_forward``): one [tokens, V] product a chunk fewer than recomputing the logits
# (bench/embedding_gradient.py --form forward flips it to compare).
EMBEDDING_GRADIENT_IN_FORWARD = True


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
    # The max and the picked logit are exact in the logits' own dtype, so only the sum of
    # exponentials reads them widened: a shared fp32 copy (the input of all three) was written
    # out whole, [tokens, V] in fp32 (bench/cross_entropy.py).
    peak = jnp.max(logits, axis=-1).astype(jnp.float32)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)  # a row of -inf logits: no nan from inf - inf
    total = jnp.sum(jnp.exp(logits.astype(jnp.float32) - peak[..., None]), axis=-1)
    logsumexp = peak + jnp.log(total)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return logsumexp - picked.astype(jnp.float32), (logits, targets, logsumexp)


def _token_nll_backward(residuals: tuple[jax.Array, jax.Array, jax.Array], cotangent: jax.Array
                        ) -> tuple[jax.Array, None]:
    logits, targets, logsumexp = residuals
    return _logit_gradient(logits, logsumexp, targets, cotangent, None, axis=-1), None


token_nll.defvjp(_token_nll_forward, _token_nll_backward)


def chunk_logits(platform: str) -> int:
    """The most logits one chunk of the loss holds on ``platform`` ("cpu", "gpu", "tpu")."""
    return CPU_LOSS_CHUNK_LOGITS if platform == "cpu" else LOSS_CHUNK_LOGITS


def masked_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array
                         ) -> tuple[jax.Array, jax.Array]:
    """Sum of next-token NLL over ``mask`` positions, and how many there are (fp32)."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(token_nll(logits, targets) * mask), jnp.sum(mask)


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
    positions are processed in chunks, and each chunk's gradient is formed as soon as its logits
    are (``_fused_chunks``): only the hidden states' gradient (and in full fine-tuning the
    embedding's) is kept, no logits are stored or recomputed. A chunk is a span of
    positions of every row (at least one), never a run of whole rows: the rows stay where the
    batch sharding put them, so each device computes the logits of its own rows. (Chunks of the
    flattened tokens were whole devices' shares: under data parallelism every device gathered
    and computed each of them, 4x the loss's FLOPs on 4 chips.) Under fsdp the embedding is
    gathered whole first (its embed dimension is split over the rows' axis too; left to itself
    XLA moved the rows instead, and a 1B step took 2.8x the memory). When the whole batch's
    logits fit in one chunk (small vocabularies, small batches) there is one chunk, formed the
    same way.
    """
    # The scope names the loss's ops in profiles (trace_analysis.time_by_part).
    with jax.named_scope(LOSS_SCOPE):
        return _chunked_nll(hidden, embedding, targets, mask, None, 0, softcap=softcap,
                            max_logits=max_logits, mesh=mesh, row_updates=row_updates)


def chunked_segment_nll(hidden: jax.Array, embedding: jax.Array, targets: jax.Array,
                        mask: jax.Array, segment_ids: jax.Array, *, num_segments: int,
                        softcap: float | None = None, max_logits: int, mesh: Any = None,
                        row_updates: tuple[jax.Array, jax.Array] | None = None
                        ) -> tuple[jax.Array, jax.Array]:
    """``chunked_cross_entropy`` summed per packed segment instead of over the batch:
    ``([B, num_segments] NLL sums, [B, num_segments] loss-bearing targets)``, column ``k`` for
    segment id ``k + 1`` of each row (0 is padding; ids above ``num_segments`` are dropped).
    A sequence's log-probability is minus its column: what preference losses compare, from
    the same chunks, never the whole logits. Each segment's cotangent weighs its positions
    apart, so in full fine-tuning the embedding's gradient recomputes each chunk's logits."""
    with jax.named_scope(LOSS_SCOPE):
        return _chunked_nll(hidden, embedding, targets, mask, segment_ids, num_segments,
                            softcap=softcap, max_logits=max_logits, mesh=mesh,
                            row_updates=row_updates)


def _chunked_nll(hidden: jax.Array, embedding: jax.Array, targets: jax.Array, mask: jax.Array,
                 segment_ids: jax.Array | None, num_segments: int, *, softcap: float | None,
                 max_logits: int, mesh: Any, row_updates: tuple[jax.Array, jax.Array] | None
                 ) -> tuple[jax.Array, jax.Array]:
    """The NLL sums and counts of the batch (``segment_ids`` None) or of each row's segments."""
    rows, length, dim = hidden.shape
    vocab = embedding.shape[0]
    fields = (targets, mask) if segment_ids is None else (targets, mask, segment_ids)

    # Positions per chunk. All of them in one when their logits fit the bound: the gradient is
    # still formed in the forward pass (the logits are written once, in float32, and never kept).
    span = min(length, max(1, max_logits // vocab // rows))
    padding = -length % span
    if padding:
        hidden = jnp.pad(hidden, ((0, 0), (0, padding), (0, 0)))
        fields = tuple(jnp.pad(x, ((0, 0), (0, padding))) for x in fields)
    count = (length + padding) // span
    chunks = (hidden.reshape(rows, count, span, dim).swapaxes(0, 1),
              *(x.reshape(rows, count, span).swapaxes(0, 1) for x in fields))
    if mesh is not None:
        chunks = jax.lax.with_sharding_constraint(
            chunks, NamedSharding(mesh, PartitionSpec(None, batch_axes(mesh))))
        embedding = jax.lax.with_sharding_constraint(embedding, NamedSharding(
            mesh, sharding.gathered_spec("input_embedding", embedding.shape, mesh)))
    update = None if row_updates is None else row_updates[1]
    ids = None if row_updates is None else row_updates[0]
    return _fused_chunks(chunks[0], embedding, update, chunks[1:], ids, softcap, num_segments)


# The chunked loss's gradient, taken in its forward pass (the "fused linear cross entropy" of
# Liger / Cut Cross-Entropy): each chunk's logits are computed once, its softmax-minus-onehot
# turned straight into the hidden states' gradient, and only that ``[rows, span, D]`` block is
# kept; the backward pass scales it by each position's cotangent. Autodiff through checkpointed
# chunks instead computed every chunk's logits twice (forward, then recomputed in backward): a
# third more of the loss's FLOPs, which are half a small Gemma's step. The embedding's gradient
# (full fine-tuning) is summed over positions: where one cotangent scales them all (the batch's
# summed loss) it too is formed in the forward pass and scaled in the backward; per-segment
# cotangents (DPO's sequence sums) weigh positions apart, so there it recomputes the logits in
# the backward pass. LoRA's frozen head never needs it (``symbolic_zeros`` says which inputs
# are differentiated).
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _fused_chunks(hidden: jax.Array, embedding: jax.Array, update: jax.Array | None,
                  fields: tuple[jax.Array, ...], ids: jax.Array | None, softcap: float | None,
                  num_segments: int) -> tuple[jax.Array, jax.Array]:
    def one(args: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        h, (t, m, *segments) = args[0], args[1:]
        logits = _chunk_logits(h, embedding, update, ids, softcap)
        return _reduce(token_nll(logits, t), m, segments, num_segments)

    totals, counts = jax.lax.map(one, (hidden, *fields))
    return jnp.sum(totals, axis=0), jnp.sum(counts, axis=0)


def _chunk_logits(h: jax.Array, embedding: jax.Array, update: jax.Array | None,
                  ids: jax.Array | None, softcap: float | None) -> jax.Array:
    """A chunk's logits in float32 whatever the compute dtype: the matmul accumulates in float32,
    and on CPUs writing that out is faster than rounding it to bfloat16 (the 270M's loss over
    1,024 x 262k logits, forward and gradient: 1.14x, for 0.5 GiB more of temporaries,
    bench/logits_float32.py); the softmax then reads them with no widening."""
    logits = jnp.einsum("...d,vd->...v", h, embedding, preferred_element_type=jnp.float32)
    if update is not None:
        logits = logits.at[..., ids].add(jnp.einsum("...d,kd->...k", h, update))
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    return logits


def _reduce(nll: jax.Array, m: jax.Array, segments: list[jax.Array], num_segments: int
            ) -> tuple[jax.Array, jax.Array]:
    """A chunk's NLL and target counts: summed, or per row and segment."""
    m = m.astype(jnp.float32)
    if not segments:
        return jnp.sum(nll * m), jnp.sum(m)
    of_segment = _of_segment(segments[0], num_segments)
    return (jnp.einsum("rl,rls->rs", nll * m, of_segment), jnp.einsum("rl,rls->rs", m, of_segment))


def _of_segment(segments: jax.Array, num_segments: int) -> jax.Array:
    columns = jnp.arange(1, num_segments + 1, dtype=segments.dtype)
    return (segments[..., None] == columns).astype(jnp.float32)  # [rows, span, S]


def _unit_logit_gradient(h: jax.Array, embedding: jax.Array, update: jax.Array | None,
                         ids: jax.Array | None, softcap: float | None, t: jax.Array, m: jax.Array
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A chunk's masked NLL, and its gradient w.r.t. the (uncapped) logits for a cotangent of
    one at every position, in the embedding's dtype (the next matmul's):
    ``(nll, gradient, logsumexp)``."""
    logits = _chunk_logits(h, embedding, update, ids, softcap)
    nll, (_, _, logsumexp) = _token_nll_forward(logits, t)
    gradient = _logit_gradient(logits, logsumexp, t, m.astype(jnp.float32), softcap, axis=-1)
    return nll, gradient.astype(embedding.dtype), logsumexp


def _logit_gradient(logits: jax.Array, logsumexp: jax.Array, targets: jax.Array,
                    weight: jax.Array, softcap: float | None, *, axis: int) -> jax.Array:
    """``(softmax - onehot) * weight`` along the vocabulary ``axis`` (through the soft cap),
    in the logits' dtype; ``logsumexp``, ``targets`` and ``weight`` have the other axes.

    The barrier keeps this widening of the logits apart from the log-sum-exp's: XLA merged the
    two into one float32 copy of the whole logits, written out for both readers, where the
    log-sum-exp's alone is fused into its sum on CPUs (bench/logits_widening.py: 0.5 GiB less
    of a 270M LoRA step's temporaries and 1.12-1.26x the step, the same numbers).
    """
    logits32 = jax.lax.optimization_barrier(logits).astype(jnp.float32)
    vocab = logits.shape[axis]
    gradient = (jnp.exp(logits32 - jnp.expand_dims(logsumexp, axis))
                - jax.nn.one_hot(targets, vocab, dtype=jnp.float32, axis=axis))
    gradient = gradient * jnp.expand_dims(weight, axis)
    if softcap is not None:
        gradient = gradient * (1.0 - jnp.square(logits32 / softcap))
    return gradient.astype(logits.dtype)


def _chunk_embedding_gradient(embedding: jax.Array, update: jax.Array | None,
                              ids: jax.Array | None, softcap: float | None, h: jax.Array,
                              weight: jax.Array, targets: jax.Array, mask: jax.Array,
                              logsumexp: jax.Array) -> jax.Array:
    """A chunk's share of the embedding's gradient, ``sum_t g[t, v] h[t, d]``, in its dtype.

    The chunk's logits are recomputed (in float32, as ``_chunk_logits``) vocabulary-major,
    ``[V, tokens]``, so that the gradient ``g`` is laid out ``[V, tokens]`` and the product
    contracts the last dimension of its left operand: the form XLA's CPU backend hands to its
    fast matmul library. Written from
    ``[tokens, V]`` (what autodiff does), the same product contracts dimension 0 of both
    operands and ran 2.2x slower (3.8 s against 1.7 s at the 270M's 1,024 tokens x 262k, bf16;
    a transpose in between is folded away by XLA, or costs what it saves).
    """
    tokens = h.reshape(-1, h.shape[-1])
    logits = jnp.einsum("vd,td->vt", embedding, tokens, preferred_element_type=jnp.float32)
    if update is not None:
        logits = logits.at[ids].add(jnp.einsum("kd,td->kt", update, tokens))
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    weight = (mask.astype(jnp.float32) * weight.astype(jnp.float32)).reshape(-1)
    gradient = _logit_gradient(logits, logsumexp.reshape(-1), targets.reshape(-1), weight,
                               softcap, axis=0).astype(embedding.dtype)
    return jnp.einsum("vt,td->vd", gradient, tokens).astype(embedding.dtype)


def _fused_forward(hidden: Any, embedding: Any, update: Any, fields: Any, ids: Any,
                   softcap: float | None, num_segments: int) -> tuple[Any, Any]:
    from jax.custom_derivatives import custom_vjp_primal_tree_values as values

    wants_update = update is not None and update.perturbed
    wants_embedding = embedding.perturbed
    # One cotangent for every position (no segments): the embedding's gradient is that times
    # the sum formed here; per segment it is recomputed in the backward pass.
    embedding_now = wants_embedding and not num_segments and EMBEDDING_GRADIENT_IN_FORWARD
    recompute = wants_embedding and not embedding_now
    hidden, embedding, update, fields, ids = values((hidden, embedding, update, fields, ids))

    def one(total: Any, args: tuple[jax.Array, ...]) -> tuple[Any, tuple[Any, ...]]:
        h, (t, m, *segments) = args[0], args[1:]
        nll, gradient, logsumexp = _unit_logit_gradient(h, embedding, update, ids, softcap, t, m)
        d_hidden = jnp.einsum("...v,vd->...d", gradient, embedding)
        picked = None
        if update is not None:
            picked = gradient[..., ids]
            d_hidden = d_hidden + jnp.einsum("...k,kd->...d", picked, update)
        if embedding_now:  # summed in the embedding's dtype, as the recompute's scan sums it
            total = total + jnp.einsum("...v,...d->vd", gradient, h,
                                       preferred_element_type=jnp.float32).astype(total.dtype)
        return total, (_reduce(nll, m, segments, num_segments), d_hidden.astype(h.dtype),
                       picked if wants_update else None, logsumexp if recompute else None)

    start = jnp.zeros(embedding.shape, embedding.dtype) if embedding_now else None
    summed, (sums, d_hidden, picked, logsumexp) = jax.lax.scan(one, start, (hidden, *fields))
    totals, counts = (jnp.sum(x, axis=0) for x in sums)
    residuals = (d_hidden, picked, fields, hidden if (wants_update or recompute) else None,
                 embedding if recompute else None, update, ids, logsumexp, summed)
    return (totals, counts), residuals


def _fused_backward(softcap: float | None, num_segments: int, residuals: Any, cotangents: Any
                    ) -> tuple[Any, ...]:
    d_hidden, picked, fields, hidden, embedding, update, ids, logsumexp, summed = residuals
    cotangent = cotangents[0]  # the counts carry no gradient
    if type(cotangent) is jax.custom_derivatives.SymbolicZero:
        cotangent = jnp.zeros(cotangent.shape, cotangent.dtype)
    if num_segments:  # each position's weight: its segment's cotangent
        weight = jnp.einsum("crls,rs->crl", jax.vmap(
            lambda s: _of_segment(s, num_segments))(fields[2]), cotangent)
    else:
        weight = jnp.broadcast_to(cotangent, d_hidden.shape[:3])
    grad_hidden = (d_hidden * weight[..., None].astype(d_hidden.dtype))
    grad_update = None
    if picked is not None:
        grad_update = jnp.einsum("crlk,crl,crld->kd", picked.astype(jnp.float32), weight,
                                 hidden.astype(jnp.float32))
    grad_embedding = None
    if summed is not None:  # formed in the forward pass, for one scalar cotangent
        grad_embedding = (summed.astype(jnp.float32) * cotangent).astype(summed.dtype)
    elif logsumexp is not None:
        def embedding_grad(total: jax.Array, args: tuple[jax.Array, ...]
                           ) -> tuple[jax.Array, None]:
            return total + _chunk_embedding_gradient(embedding, update, ids, softcap, *args), None

        # Summed over the chunks in the embedding's dtype, as autodiff through the chunk loop
        # did: a float32 [V, D] carry would double it (5.6 GB a device for a 27B's embedding).
        grad_embedding, _ = jax.lax.scan(
            embedding_grad, jnp.zeros(embedding.shape, embedding.dtype),
            (hidden, weight, *fields[:2], logsumexp))
    if grad_update is not None:
        grad_update = grad_update.astype(update.dtype)
    return grad_hidden, grad_embedding, grad_update, tuple(None for _ in fields), None


_fused_chunks.defvjp(_fused_forward, _fused_backward, symbolic_zeros=True)
