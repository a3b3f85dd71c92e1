"""Where every weight lives on the mesh: the sharding rules, in one place.

Each Gemma 3 or Gemma 4 weight is named by its module (``q_einsum``, ``linear``, ...); its rule
names the mesh axis that splits each dimension. ``fsdp`` splits the model dimension, ``tensor``
splits heads, the feed-forward width and the vocabulary, ``expert`` a mixture's experts (an axis
a mesh may lack: then nothing is split over it). An axis that does not divide a dimension leaves it
whole (e.g. Gemma3-270M's single KV head under ``tensor=2``), so every preset runs on every mesh.
The optimizer state follows its weight (``training.state_sharding``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Mesh axis per dimension of each weight. Gemma 3's layouts (transpose_gating_einsum=True), which
# Gemma 4's dense layers share, then Gemma 4's own.
RULES: dict[str, tuple[str | None, ...]] = {
    "input_embedding": ("tensor", "fsdp"),  # [vocab, embed]
    "q_einsum": ("tensor", "fsdp", None),  # [heads, embed, head_dim]
    "kv_einsum": (None, "tensor", "fsdp", None),  # [k|v, kv_heads, embed, head_dim]
    "attn_vec_einsum": ("tensor", None, "fsdp"),  # [heads, head_dim, embed]
    "gating_einsum": (None, "tensor", "fsdp"),  # [gate|up, ffw, embed]
    "linear": ("tensor", "fsdp"),  # [ffw, embed]
    "scale": (),  # RMS norms: small, replicated
    # Gemma 4: global layers whose values are their keys; a mixture's router and experts (the
    # experts' weights are told from the dense MLP's of the same names by their extra axis).
    "k_einsum": ("tensor", "fsdp", None),  # [kv_heads, embed, head_dim]
    "router_logits": ("fsdp", None),  # [embed, experts]
    "experts_gating": ("expert", None, "tensor", "fsdp"),  # [experts, gate|up, ffw, embed]
    "experts_linear": ("expert", "tensor", "fsdp"),  # [experts, ffw, embed]
    # Gemma 4's per-layer embeddings: the table [vocab, layers, dim] (E2B's is half the model),
    # the projection to them [embed, layers, dim], each block's gate [embed, dim] and back.
    "per_layer_embeddings": ("tensor", None, "fsdp"),
    "per_layer_model_projection": ("fsdp", None, None),
    "per_layer_input_gate": ("fsdp", None),
    "per_layer_projection": (None, "fsdp"),
    "skip_scale": (),  # Gemma 4's scalars and vectors: small, replicated
    "router_scale": (),
    "per_expert_scale": (),
    "lora": (),  # LoRA adapters (gemmalab.model.lora): rank-r factors, small, replicated
    # ... but for Gemma 4's experts': one pair an expert ([E, in, r], [E, r, ...]; 238M for
    # 26B-A4B at rank 8), split over experts as their experts are, whole within each expert.
    "lora_experts": ("expert",),
    # LoRA's trained embedding rows (gemmalab.model.lora.TOKEN_ROWS): a few, replicated.
    "token_rows": (),
}


# Gemma 4's experts: (module, dimensions) -> rule.
_EXPERT_RULES = {("gating_einsum", 4): "experts_gating", ("linear", 3): "experts_linear"}


def rule_name(path: tuple[Any, ...], ndim: int | None = None) -> str:
    """The rule a weight of ``ndim`` dimensions follows: its module's name (the leaf's own for
    norms and Gemma 4's MLP weights), or its experts' rule; a LoRA adapter's, ``lora`` or (the
    experts' adapters, ``lora.py``'s ``_LoRAExperts``) ``lora_experts``."""
    names = [entry.key for entry in path if isinstance(entry, jax.tree_util.DictKey)]
    if "lora" in names:
        return "lora_experts" if any(n.startswith("_LoRAExperts") for n in names) else "lora"
    name = names[-2] if names and names[-1] == "w" and len(names) > 1 else names[-1]
    name = _EXPERT_RULES.get((name, ndim), name)
    if name not in RULES:
        raise ValueError(f"no sharding rule for parameter {jax.tree_util.keystr(path)}: "
                         f"add one to gemmalab.model.sharding.RULES")
    return name


def weight_spec(path: tuple[Any, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    return _spec(RULES[rule_name(path, len(shape))], shape, mesh)


def gathered_spec(rule: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """A weight's spec with fsdp's split undone: the weight whole on each device, bar the
    tensor axis (e.g. the embedding as the loss reads it, ``training.chunked_cross_entropy``)."""
    return _spec(tuple(None if axis == "fsdp" else axis for axis in RULES[rule]), shape, mesh)


def _spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    sizes = dict(mesh.shape)
    spec = [axis if axis is not None and sizes.get(axis, 1) > 1 and dim % sizes[axis] == 0
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
        total += max(array_bytes(s.data) for s in shards) if shards else 0
    return total


def array_bytes(leaf: Any) -> int:
    """Bytes an array (concrete or abstract) takes, 4-bit types at 4 bits (as TPUs pack them;
    numpy counts them a byte)."""
    dtype = np.dtype(leaf.dtype)
    bits = 4 if dtype.name in ("int4", "uint4") else dtype.itemsize * 8
    return (int(np.prod(leaf.shape)) * bits + 7) // 8
