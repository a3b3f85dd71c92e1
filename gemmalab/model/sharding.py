"""Where every weight lives on the mesh: the sharding rules, in one place.

Each Gemma 3 weight is named by its module (``q_einsum``, ``linear``, ...); its rule names the mesh
axis that splits each dimension. ``fsdp`` splits the model dimension, ``tensor`` splits heads,
the feed-forward width and the vocabulary. An axis that does not divide a dimension leaves it
whole (e.g. Gemma3-270M's single KV head under ``tensor=2``), so every preset runs on every mesh.
The optimizer state follows its weight (``training.state_sharding``).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Mesh axis per dimension of each weight. Gemma 3's layouts (transpose_gating_einsum=True).
RULES: dict[str, tuple[str | None, ...]] = {
    "input_embedding": ("tensor", "fsdp"),  # [vocab, embed]
    "q_einsum": ("tensor", "fsdp", None),  # [heads, embed, head_dim]
    "kv_einsum": (None, "tensor", "fsdp", None),  # [k|v, kv_heads, embed, head_dim]
    "attn_vec_einsum": ("tensor", None, "fsdp"),  # [heads, head_dim, embed]
    "gating_einsum": (None, "tensor", "fsdp"),  # [gate|up, ffw, embed]
    "linear": ("tensor", "fsdp"),  # [ffw, embed]
    "scale": (),  # RMS norms: small, replicated
    "lora": (),  # LoRA adapters (gemmalab.model.lora): rank-r factors, small, replicated
    # LoRA's trained embedding rows (gemmalab.model.lora.TOKEN_ROWS): a few, replicated.
    "token_rows": (),
}


def rule_name(path: tuple[Any, ...]) -> str:
    """The rule a weight follows: its module's name (the leaf's own for norms and MLP weights)."""
    names = [entry.key for entry in path if isinstance(entry, jax.tree_util.DictKey)]
    if "lora" in names:
        return "lora"
    name = names[-2] if names and names[-1] == "w" and len(names) > 1 else names[-1]
    if name not in RULES:
        raise ValueError(f"no sharding rule for parameter {jax.tree_util.keystr(path)}: "
                         f"add one to gemmalab.model.sharding.RULES")
    return name


def weight_spec(path: tuple[Any, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    return _spec(RULES[rule_name(path)], shape, mesh)


def gathered_spec(rule: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """A weight's spec with fsdp's split undone: the weight whole on each device, bar the
    tensor axis (e.g. the embedding as the loss reads it, ``training.chunked_cross_entropy``)."""
    return _spec(tuple(None if axis == "fsdp" else axis for axis in RULES[rule]), shape, mesh)


def _spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    spec = [axis if axis is not None and dim % mesh.shape[axis] == 0 and mesh.shape[axis] > 1
            else None for axis, dim in zip(axes, shape, strict=False)]
    return PartitionSpec(*spec)


def param_sharding(params: Any, mesh: Mesh) -> Any:
    """A ``NamedSharding`` for every weight (concrete or ``jax.ShapeDtypeStruct`` leaves)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, weight_spec(path, leaf.shape, mesh)), params)


def dict_path(path: tuple[Any, ...]) -> tuple[str, ...]:
    """The dictionary keys of a path: the same for a weight and its optimizer moments."""
    return tuple(entry.key for entry in path if isinstance(entry, jax.tree_util.DictKey))


def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of ``tree`` (its largest shard of each leaf)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shards = leaf.addressable_shards
        total += max(s.data.nbytes for s in shards) if shards else 0
    return total
