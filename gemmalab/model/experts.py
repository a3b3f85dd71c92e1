"""A mixture's routed experts, expert-parallel: each device runs its own experts on the tokens
routed to them, wherever those tokens came from.

Under XLA's automatic sharding a ``ragged_dot`` cannot split its groups (the experts) over
devices, so every device gathered all the experts' weights and every routed token of the batch
(libtpu, Gemma 4 26B-A4B on a v6e 2x4, ``expert 8``: 968 MiB of gate|up weights per layer on each
chip, 32.3 GiB per device). Here the experts' part of a layer is a ``shard_map``:

1. each device sorts its own rows' routed tokens (``top_k`` copies of each) by expert;
2. sends each block of them to the device of the ``expert`` axis that holds those experts,
   and receives the tokens routed to its own experts from every device of that axis
   (``all_to_all``). Dropless by default: a block has room for every token a device routed,
   so each device holds buffers for ``expert``-axis-size times its own routed tokens. With a
   capacity factor ``c`` a block holds ``c / (expert axis size)`` of them, the expected share
   of a balanced router times ``c``; the tokens past it are dropped (that expert adds
   nothing to them) and counted;
3. runs its experts on them (``ragged_dot``, with their LoRA adapters), the feed-forward width
   split over ``tensor`` as the dense MLP's is (a ``psum`` after the down projection);
4. sends the results back, and combines each token's ``top_k`` outputs with its router weights.

The batch is split over ``data``, ``fsdp`` and ``expert`` as everywhere (``BATCH_AXES``); an
expert's weights are whole within its ``expert`` shard (gathered over ``fsdp`` at the
``shard_map``'s edge, as FSDP gathers every weight it computes with). Without a mesh, or
with one ``expert`` shard, the same computation runs with no exchange. Dropless, the result
equals the one-device computation's, to rounding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gemmalab.config import EXPERT_AXIS, TENSOR_AXIS


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """One of a mixture's two expert projections as it computes: the base weight (``[E, 2, H,
    D]`` gate|up or ``[E, H, D]`` down, dequantized) and, with LoRA, each expert's factors ``a
    [E, in, r]`` and ``b [E, r, *out]`` with the adapters' scale."""

    w: Any
    a: Any = None
    b: Any = None
    lora_scale: float = 1.0


def _register() -> None:
    import jax

    jax.tree_util.register_dataclass(ExpertWeights, data_fields=["w", "a", "b"],
                                     meta_fields=["lora_scale"])


_register()


def ragged_product(weights: ExpertWeights, x: Any, group_sizes: Any) -> Any:
    """``x`` (tokens sorted by expert, ``group_sizes[e]`` of them for expert ``e``) times each
    one's expert: gate|up comes out ``[tokens, 2H]`` (gate first), down ``[tokens, D]``; plus
    each expert's ``scale * x a_e b_e``, computed from the factors (never a dense update)."""
    import jax
    import jax.numpy as jnp

    weight = weights.w
    experts = weight.shape[0]
    if weight.ndim == 4:  # gate|up [E, 2, H, D] as ragged_dot reads it: [E, D, 2H]
        _, _, hidden, features = weight.shape
        weight = jnp.transpose(weight, (0, 3, 1, 2)).reshape(experts, features, 2 * hidden)
    out = jax.lax.ragged_dot(x, weight, group_sizes=group_sizes)
    if weights.a is None:
        return out
    a, b = weights.a, weights.b
    dtype = jnp.result_type(x.dtype, a.dtype)  # as einsum would: the wider of the two
    low = jax.lax.ragged_dot(x.astype(dtype), a.astype(dtype), group_sizes=group_sizes)
    return out + weights.lora_scale * jax.lax.ragged_dot(
        low, b.reshape(experts, a.shape[-1], -1).astype(dtype), group_sizes=group_sizes)


def routed_ffw(x: Any, choices: Any, combine: Any, gate: ExpertWeights, linear: ExpertWeights,
               expert_scale: Any, *, mesh: Any = None, capacity_factor: float = 0.0
               ) -> tuple[Any, Any]:
    """The experts' output ``[B, L, D]`` for tokens ``x [B, L, D]``, each routed to the experts
    ``choices [B, L, k]`` with the weights ``combine [B, L, k]``; each expert's output is
    scaled by ``expert_scale [E]``. Expert-parallel over ``mesh`` (see the module's
    docstring) when its batch axes split the batch; else on the whole batch at once.

    Also returns the share of the routed token copies dropped (float32; 0 when
    ``capacity_factor`` is 0, dropless)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from gemmalab.model.mesh import batch_axes

    x, gate, linear = _adapter_gradients_first(x, gate, linear)
    rows = () if mesh is None else batch_axes(mesh)
    ways = math.prod(mesh.shape[axis] for axis in rows)
    if mesh is None or x.shape[0] % ways:  # or a batch it does not split, e.g. init's one row
        out, _ = _local_ffw(x, choices, combine, gate, linear, expert_scale, None, None)
        return out, _no_drops()

    def axis(name: str) -> str | None:
        return name if name in mesh.axis_names and mesh.shape[name] > 1 else None

    expert, tensor = axis(EXPERT_AXIS), axis(TENSOR_AXIS)
    if tensor is not None and linear.w.shape[1] % mesh.shape[tensor]:
        tensor = None  # a width the axis does not divide is computed whole, as the table does
    tokens = P(rows or None, None, None)
    gate_specs = ExpertWeights(w=P(expert, None, tensor, None),
                               a=None if gate.a is None else P(expert, None, None),
                               b=None if gate.b is None else P(expert, None, None, tensor),
                               lora_scale=gate.lora_scale)
    linear_specs = ExpertWeights(w=P(expert, tensor, None),
                                 a=None if linear.a is None else P(expert, tensor, None),
                                 b=None if linear.b is None else P(expert, None, None),
                                 lora_scale=linear.lora_scale)

    def body(x: Any, choices: Any, combine: Any, gate: ExpertWeights, linear: ExpertWeights,
             expert_scale: Any) -> tuple[Any, Any]:
        out, dropped = _local_ffw(x, choices, combine, gate, linear, expert_scale, expert,
                                  tensor, capacity_factor)
        return out, jax.lax.psum(dropped, rows) / (choices.size * ways)

    return jax.shard_map(body, mesh=mesh,
                         in_specs=(tokens, tokens, tokens, gate_specs, linear_specs, P(expert)),
                         out_specs=(tokens, P()))(x, choices, combine, gate, linear, expert_scale)


def _adapter_gradients_first(x: Any, gate: ExpertWeights, linear: ExpertWeights
                             ) -> tuple[Any, ExpertWeights, ExpertWeights]:
    """``x`` and the weights as they are; in the backward pass, the gradient into ``x`` waits
    for the experts' factors' gradients. Their gradients are contractions over the routed
    tokens that nothing later in the backward pass needs, so XLA would schedule them at its
    end and keep every layer's routed-token cotangents alive until then (libtpu, 26B-A4B:
    1.2 GiB more a layer)."""
    import jax

    if gate.a is None and linear.a is None:
        return x, gate, linear
    factors = (gate.a, gate.b, linear.a, linear.b)

    @jax.custom_vjp
    def tied(x: Any, factors: Any) -> tuple[Any, Any]:
        return x, factors

    def forward(x: Any, factors: Any) -> tuple[tuple[Any, Any], None]:
        return (x, factors), None

    def backward(_: None, cotangents: tuple[Any, Any]) -> tuple[Any, Any]:
        return jax.lax.optimization_barrier(cotangents)

    tied.defvjp(forward, backward)
    x, (gate_a, gate_b, linear_a, linear_b) = tied(x, factors)
    return (x, dataclasses.replace(gate, a=gate_a, b=gate_b),
            dataclasses.replace(linear, a=linear_a, b=linear_b))


def _no_drops() -> Any:
    import jax.numpy as jnp

    return jnp.zeros((), jnp.float32)


def _local_ffw(x: Any, choices: Any, combine: Any, gate: ExpertWeights, linear: ExpertWeights,
               expert_scale: Any, expert_axis: str | None, tensor_axis: str | None,
               capacity_factor: float = 0.0) -> tuple[Any, Any]:
    """One device's part (or the whole batch's, with no axes): ``expert_scale`` and the weights
    hold this device's experts, ``1 / (expert axis size)`` of them. Also returns how many of
    its routed token copies were dropped (float32)."""
    import jax
    import jax.numpy as jnp

    batch, length, features = x.shape
    top_k = choices.shape[-1]
    local_experts = expert_scale.shape[0]
    shards = 1 if expert_axis is None else jax.lax.axis_size(expert_axis)
    flat = choices.reshape(-1)
    order = jnp.argsort(flat)  # stable: a token's copies keep their order within an expert
    sorted_x = x.reshape(-1, features)[order // top_k]
    sorted_expert = flat[order]
    counts = jnp.zeros(local_experts * shards, jnp.int32).at[flat].add(1)

    def ffw(tokens: Any, group_sizes: Any, expert_of_row: Any) -> Any:
        """The local experts on ``tokens`` sorted by them (``group_sizes``); rows past the
        groups (``expert_of_row`` == local_experts) come out zero."""
        gate_out = ragged_product(gate, tokens, group_sizes)
        gate_out = gate_out.reshape(gate_out.shape[0], 2, -1)
        activation = jax.nn.gelu(gate_out[:, 0, :]) * gate_out[:, 1, :]
        out = ragged_product(linear, activation, group_sizes)
        if tensor_axis is not None:  # each tensor shard's part of the feed-forward width
            out = jax.lax.psum(out, tensor_axis)
        kept = expert_of_row < local_experts
        scale = expert_scale.astype(out.dtype)[jnp.where(kept, expert_of_row, 0), None]
        return jnp.where(kept[:, None], out * scale, jnp.zeros((), out.dtype))

    if shards == 1:
        out_sorted, dropped = ffw(sorted_x, counts, sorted_expert), _no_drops()
    else:
        out_sorted, dropped = _exchanged_ffw(ffw, sorted_x, sorted_expert, counts, expert_axis,
                                             shards, local_experts, capacity_factor)
    outputs = out_sorted[jnp.argsort(order)].reshape(batch, length, top_k, -1)
    return jnp.einsum("blkd,blk->bld", outputs, combine,
                      preferred_element_type=outputs.dtype), dropped


def rows_per_copy(shards: int, capacity_factor: float) -> float:
    """The rows a device's experts compute (and exchange) for each routed copy of its own
    tokens, with ``shards`` of them on the expert axis: room for the whole axis's copies
    dropless (``capacity_factor`` 0), else the factor times a balanced share, at most that."""
    return min(capacity_factor, shards) if capacity_factor else shards


def block_capacity(slots: int, shards: int, capacity_factor: float) -> int:
    """How many of a device's ``slots`` routed token copies one block to one of ``shards``
    expert shards holds (``rows_per_copy`` of them a copy, over the shards' blocks)."""
    return min(slots, math.ceil(rows_per_copy(shards, capacity_factor) * slots / shards))


def _exchanged_ffw(ffw: Any, sorted_x: Any, sorted_expert: Any, counts: Any, expert_axis: str,
                   shards: int, local_experts: int, capacity_factor: float) -> tuple[Any, Any]:
    """``ffw`` on the tokens routed to this device's experts from every device of
    ``expert_axis``, the results sent back: ``[slots, D]`` in ``sorted_x``'s order (zero for
    a dropped copy), and how many copies were dropped."""
    import jax
    import jax.numpy as jnp

    slots, features = sorted_x.shape
    capacity = block_capacity(slots, shards, capacity_factor)
    per_shard = counts.reshape(shards, local_experts)  # my tokens for each shard's experts
    shard_counts = per_shard.sum(axis=1)
    starts = jnp.cumsum(shard_counts) - shard_counts
    # A block keeps its first `capacity` tokens (sorted by expert): each expert's share of it.
    kept_ends = jnp.minimum(jnp.cumsum(per_shard, axis=1), capacity)
    kept = jnp.diff(kept_ends, axis=1, prepend=0)
    place = jnp.arange(capacity)
    index = starts[:, None] + place[None, :]  # [shards, capacity]
    sent = place[None, :] < shard_counts[:, None]
    blocks = jnp.where(sent[..., None], sorted_x[jnp.minimum(index, slots - 1)],
                       jnp.zeros((), sorted_x.dtype))
    received = jax.lax.all_to_all(blocks, expert_axis, 0, 0)  # [source, capacity, D]
    received_counts = jax.lax.all_to_all(kept, expert_axis, 0, 0)  # [source, my experts]
    # Each source's block is sorted by my experts: row i is expert #(ends <= i), else padding.
    ends = jnp.cumsum(received_counts, axis=1)
    expert_of_row = (place[None, :, None] >= ends[:, None, :]).sum(axis=-1).reshape(-1)
    regroup = jnp.argsort(expert_of_row)
    out = ffw(received.reshape(-1, features)[regroup], received_counts.sum(axis=0),
              expert_of_row[regroup])
    back = out[jnp.argsort(regroup)].reshape(shards, capacity, -1)
    returned = jax.lax.all_to_all(back, expert_axis, 0, 0)  # [destination, capacity, D]
    shard = sorted_expert // local_experts
    offset = jnp.arange(slots) - starts[shard]
    out_sorted = returned[shard, jnp.minimum(offset, capacity - 1)]
    if capacity < slots:
        out_sorted = jnp.where((offset < capacity)[:, None], out_sorted,
                               jnp.zeros((), out_sorted.dtype))
    dropped = (shard_counts - jnp.minimum(shard_counts, capacity)).sum()
    return out_sorted, dropped.astype(jnp.float32)
