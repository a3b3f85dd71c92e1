"""The run's tensors before any is allocated: the vocabulary, the parameter and adapter trees
(abstract: shapes and dtypes), DPO's segments a row and a block's dimensions on one device.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from gemmalab.config import TINY_PRESETS, LoRAConfig, ModelConfig

BATCH_FIELD_COUNT = 5  # int32 rows per batch: gemmalab.data.packing.FIELDS
GEMMA3_VOCAB = 262_144
# A preference pair's two chat documents (prompt and reply in turn markers, each) take at least
# this many next-token targets together: what bounds DPO's segments a row before any data is read.
PAIR_MIN_TARGETS = 18


def vocab_size_hint(model: ModelConfig) -> int:
    """The embedding rows the run will have, known before the tokenizer is loaded."""
    if model.preset in TINY_PRESETS and model.tokenizer == "local":
        return model.tokenizer_vocab_size
    if (model.preset in TINY_PRESETS and model.tokenizer.endswith(".model")
            and Path(model.tokenizer).is_file()):  # e.g. the local one a continued run saved
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=model.tokenizer).vocab_size()
    return GEMMA3_VOCAB  # Gemma's tokenizer (Gemma 4's is as large); the largest for tiny


@functools.cache
def abstract_params(model_config: Any, param_dtype: str) -> Any:
    """The parameter tree's shapes and dtypes (traced, nothing allocated)."""
    import jax
    import jax.numpy as jnp

    from gemmalab.model import presets

    model = presets.plain_model(model_config, jnp.dtype(param_dtype))
    return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]


def adapter_params(model_config: Any, lora_config: LoRAConfig, param_dtype: str,
                   token_rows: int = 0) -> Any:
    """A LoRA run's trainable tree (its adapters and ``token_rows`` embedding rows), abstract;
    ``{}`` without LoRA."""
    if not lora_config.enabled:
        return {}
    from gemmalab.model import lora

    return lora.abstract_adapters(model_config, rank=lora_config.rank,
                                  modules=lora_config.modules, dtype=param_dtype,
                                  token_rows=token_rows)


def preference_segments_bound(maxlen: int) -> int:
    """DPO's segments a row can hold (``optimization.Preference.num_segments``) where no data has
    been read (the plan, the ahead-of-time compile): two per pair, as many pairs as rows of
    ``maxlen`` fit if each took ``PAIR_MIN_TARGETS`` targets. A run derives its own, tighter
    bound from the data (``preparation._max_segments``)."""
    return 2 * max(1, maxlen // PAIR_MIN_TARGETS)


def layer_head_dims(model_config: Any) -> list[int]:
    """Each layer's attention head width: Gemma 4's global layers attend with wider keys
    (``global_key_size``); Gemma 3's are all ``head_dim``."""
    wide = getattr(model_config, "global_key_size", None) or model_config.head_dim
    return [wide if kind.name == "GLOBAL" else model_config.head_dim
            for kind in model_config.attention_types]


def matmul_params(model_config: Any, num_params: int) -> int:
    """The weights of a model of ``num_params`` that one token multiplies: all of Gemma 3's;
    Gemma 4's less its per-layer embedding table (a lookup) and, in a mixture of experts, the
    experts that do not run it (each token runs ``top_k_experts`` of ``num_experts``)."""
    layers = model_config.num_layers
    lookup = model_config.num_embed * layers * getattr(model_config, "per_layer_input_dim", 0)
    experts = 0
    if getattr(model_config, "enable_moe", False):
        per_layer = model_config.num_experts * 3 * model_config.expert_dim * model_config.embed_dim
        idle = 1 - model_config.top_k_experts / model_config.num_experts
        experts = int(layers * per_layer * idle)
    return num_params - lookup - experts


def active_adapters(model_config: Any, adapters: Any) -> int:
    """The LoRA weights of ``adapters`` (a tree) that one token multiplies: all of them, but of
    a mixture's per-expert adapters only those of the ``top_k_experts`` experts that run it."""
    import jax

    from gemmalab.model import sharding

    total = experts = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(adapters):
        total += leaf.size
        if sharding.rule_name(path, leaf.ndim) == "lora_experts":
            experts += leaf.size
    if not experts:
        return total
    return total - experts + experts * model_config.top_k_experts // model_config.num_experts


def expert_activations(model_config: Any, sizes: dict[str, int], capacity_factor: float = 0.0
                       ) -> int:
    """Per token of one layer of a mixture of experts, the elements its experts' working set
    holds on a device (``gemmalab.model.experts``); 0 for a dense model.

    Each of a token's ``top_k_experts`` routed copies is a row of the sorted input and output
    and of the gate, up and activated widths (``tensor``'s share of them). Under an ``expert``
    axis a device computes the rows it has room for: the axis's size times its own (dropless)
    or ``capacity_factor`` times them; and each such row is also in the blocks sent, received
    and returned."""
    if not getattr(model_config, "enable_moe", False):
        return 0
    shards, tensor = sizes.get("expert", 1), sizes.get("tensor", 1)
    hidden = model_config.expert_dim
    hidden = hidden // tensor if hidden % tensor == 0 else hidden
    width = 2 * model_config.embed_dim + 3 * hidden
    if shards == 1:
        return model_config.top_k_experts * width
    from gemmalab.model.experts import rows_per_copy

    rows = rows_per_copy(shards, capacity_factor)
    return math.ceil(model_config.top_k_experts * rows * (width + 3 * model_config.embed_dim))


def expert_kept_bytes(model_config: Any) -> int:
    """Per token of one layer of a mixture of experts, the bytes the compiled step holds a
    layer beyond the block's input, whatever the remat policy: a float32 value per routed copy
    and feature. Measured, not derived (libtpu, 26B-A4B LoRA on a v6e 2x4 ``expert 8``, remat
    full; docs/gemma4.md): 0.09-0.13 GiB a layer at 1,024 tokens a device (this figure's 0.09),
    0.19 at 2,048 (0.17); the whole plan stays above the compiled step there."""
    if not getattr(model_config, "enable_moe", False):
        return 0
    return model_config.top_k_experts * model_config.embed_dim * 4


def block_dims(model_config: Any, sizes: dict[str, int]) -> tuple[int, int, int, int, int]:
    """Embed and head dimension, and the heads, KV heads and MLP width one device computes."""
    tensor = sizes["tensor"]

    def split(n: int) -> int:
        return n // tensor if n % tensor == 0 else n

    return (model_config.embed_dim, model_config.head_dim, split(model_config.num_heads),
            split(model_config.num_kv_heads), split(model_config.hidden_dim))
