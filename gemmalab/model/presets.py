"""Gemma 3 and Gemma 4 presets: gemma's own model classes, plus tiny ones sized for CPUs.

``gemma`` is imported inside functions (it pulls tensorflow).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import TYPE_CHECKING, Any

from gemmalab import gemma_lib
from gemmalab.config import PRESET_NAMES, REMAT_POLICIES, TINY_PRESETS
from gemmalab.errors import ConfigError
from gemmalab.model import attention as attention_lib
from gemmalab.model import gemma4
from gemmalab.model import mesh as mesh_lib

if TYPE_CHECKING:
    from gemma import gm


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    gemma_class: str  # Attribute of gm.nn; the tiny preset derives its config from it.
    checkpoints: tuple[str, ...]  # gm.ckpts.CheckpointPath names with weights for it.
    default_learning_rate: float
    multimodal: bool = False
    # LoRA's adapters start at zero and are few: they take a larger step than full fine-tuning.
    # 2e-4 is PEFT's usual rate; the 270M did better at 1e-3: docs/benchmarks/lora-learning-rate.md.
    default_lora_learning_rate: float = 2e-4
    # DPO moves a model that already writes well by small margins; None: the LoRA rate above.
    default_lora_dpo_learning_rate: float | None = None

    @property
    def family(self) -> str:
        """"gemma3" or "gemma4": which of gemma's model packages builds it."""
        return self.name.split("-")[0]

    @property
    def tiny(self) -> bool:
        return self.name in TINY_PRESETS


PRESETS = {
    p.name: p
    for p in (
        Preset("gemma3-tiny", "Gemma3_270M", (), 3e-3, default_lora_learning_rate=3e-3),
        Preset("gemma3-270m", "Gemma3_270M", ("GEMMA3_270M_PT", "GEMMA3_270M_IT"), 2e-5,
               default_lora_learning_rate=1e-3, default_lora_dpo_learning_rate=1e-4),
        Preset("gemma3-1b", "Gemma3_1B", ("GEMMA3_1B_PT", "GEMMA3_1B_IT"), 2e-5),
        Preset("gemma3-4b", "Gemma3_4B", ("GEMMA3_4B_PT", "GEMMA3_4B_IT"), 2e-5, True),
        Preset("gemma3-12b", "Gemma3_12B", ("GEMMA3_12B_PT", "GEMMA3_12B_IT"), 2e-5, True),
        Preset("gemma3-27b", "Gemma3_27B", ("GEMMA3_27B_PT", "GEMMA3_27B_IT"), 2e-5, True),
        # Gemma 4's checkpoints all hold vision (and E2B/E4B audio) towers: loaded text-only.
        Preset("gemma4-tiny", "Gemma4_E2B", (), 3e-3, default_lora_learning_rate=3e-3),
        Preset("gemma4-tiny-moe", "Gemma4_26B_A4B", (), 3e-3, default_lora_learning_rate=3e-3),
        Preset("gemma4-e2b", "Gemma4_E2B", ("GEMMA4_E2B_PT", "GEMMA4_E2B_IT"), 2e-5, True),
        Preset("gemma4-e4b", "Gemma4_E4B", ("GEMMA4_E4B_PT", "GEMMA4_E4B_IT"), 2e-5, True),
        Preset("gemma4-31b", "Gemma4_31B", ("GEMMA4_31B_PT", "GEMMA4_31B_IT"), 2e-5, True),
        Preset("gemma4-26b-a4b", "Gemma4_26B_A4B", ("GEMMA4_26B_A4B_PT", "GEMMA4_26B_A4B_IT"),
               2e-5, True),
    )
}
assert tuple(PRESETS) == PRESET_NAMES


def default_learning_rate(preset_name: str, *, lora: bool, objective: str = "sft") -> float:
    """The peak learning rate a run uses when ``learning_rate`` is None."""
    preset = PRESETS[preset_name]
    if not lora:
        return preset.default_learning_rate
    if objective == "dpo" and preset.default_lora_dpo_learning_rate is not None:
        return preset.default_lora_dpo_learning_rate
    return preset.default_lora_learning_rate


# The tiny preset keeps Gemma 3's architecture — 5 sliding-window layers then 1 global layer,
# QK-norm, GQA, post-norms, dual RoPE bases — at a size that learns in minutes on two cores.
TINY_OVERRIDES = dict(
    embed_dim=128,
    hidden_dim=512,
    num_heads=4,
    head_dim=32,
    num_kv_heads=2,
    sliding_window_size=128,
)
TINY_NUM_LAYERS = 6


def model_config(preset_name: str, vocab_size: int, num_layers: int | None = None
                 ) -> gm.nn.config.TransformerConfig:
    """The resolved gemma ``TransformerConfig`` (text-only) for a preset; with ``num_layers``,
    only its last ``num_layers`` layers (``TrainConfig.num_layers``)."""
    config = _whole_config(preset_name, vocab_size)
    if num_layers is None or num_layers == config.num_layers:
        return config
    check_num_layers(preset_name, num_layers)
    if PRESETS[preset_name].family == "gemma4":
        return gemma4.cut(config, num_layers)
    # The pattern's tail: the tiny preset and the 270M end on their global layer.
    return dataclasses.replace(config, attention_types=config.attention_types[-num_layers:])


def expert_count(preset_name: str) -> int:
    """How many experts each layer of a preset has (0: a dense model)."""
    return getattr(_whole_config(preset_name, 0), "num_experts", 0)


def check_num_layers(preset_name: str, num_layers: int | None) -> None:
    """Refuse a ``TrainConfig.num_layers`` deeper than the preset (before any data work)."""
    if num_layers is None:
        return
    depth = _whole_config(preset_name, 0).num_layers
    if not 1 <= num_layers <= depth:
        raise ConfigError("num_layers", f"{num_layers} is not among {preset_name}'s {depth} "
                          "layers", f"use 1 to {depth}, or None for all of them")


def _whole_config(preset_name: str, vocab_size: int) -> gm.nn.config.TransformerConfig:
    gm = gemma_lib.gm()
    from gemma.gm.nn import _config
    from gemma.gm.nn._gemma import GEMMA3_ATTENTION_PATTERN

    preset = PRESETS[preset_name]
    if preset.family == "gemma4":
        if preset.tiny:
            return gemma4.tiny_config(moe=preset_name.endswith("-moe"), vocab_size=vocab_size)
        return gemma4.text_config(preset.gemma_class)
    base = getattr(gm.nn, preset.gemma_class).config
    if preset_name == "gemma3-tiny":
        return dataclasses.replace(
            base, num_embed=vocab_size, **TINY_OVERRIDES,
            attention_types=_config.make_attention_layers_types(
                GEMMA3_ATTENTION_PATTERN, num_layers=TINY_NUM_LAYERS))
    return dataclasses.replace(base, vision_encoder=None)


def build_model(config: gm.nn.config.TransformerConfig, *, param_dtype: Any,
                remat: str = "none", attention: str = "gemma", mesh: Any = None,
                expert_capacity_factor: float = 0.0) -> gm.nn.Transformer:
    """A gemma Transformer for ``config`` whose ``init`` creates ``param_dtype`` weights.

    ``remat`` (``REMAT_POLICIES``) trades compute for activation memory in the backward pass:
    ``"full"`` keeps only each block's input and recomputes the block, ``"dots"`` also keeps
    the outputs of the weight matmuls (recomputing norms, attention scores and activations).
    ``attention`` (``ATTENTION_IMPLS``) picks what computes attention without a KV cache
    (``gemmalab.model.attention``), for the devices of ``mesh`` (default: the default backend's).
    The weights and their names are the same whichever is chosen. A mixture's experts run
    expert-parallel over ``mesh`` with ``expert_capacity_factor`` (``gemmalab.model.experts``).
    """
    gm = gemma_lib.gm()
    if remat not in REMAT_POLICIES:
        raise ConfigError("remat", f"unknown policy {remat!r}", f"use one of {REMAT_POLICIES}")
    if gemma4.is_gemma4(config):
        if attention not in ("auto", "gemma"):  # the fused kernels read Gemma 3's attention
            raise ConfigError("attention", f"{attention!r} is not wired for Gemma 4's attention "
                              "(global heads of another width, shared keys and values)",
                              "use attention='gemma' (or 'auto')")
        return gemma4.transformer_class(remat)(config=config, dtype=param_dtype, mesh=mesh,
                                               capacity_factor=expert_capacity_factor)
    base = gm.nn.Transformer if remat == "none" else _remat_transformer_class()
    fields = {} if remat == "none" else {"remat": remat}
    kernel = attention_kernel(attention, config, mesh)
    if kernel is None:
        return base(config=config, dtype=param_dtype, **fields)
    return attention_lib.transformer_class(base)(config=config, dtype=param_dtype,
                                                 attention=kernel, **fields)


def plain_model(config: Any, param_dtype: Any) -> Any:
    """gemma's model for ``config`` as gemma defines it (no remat, gemma's attention): what the
    parameter tree's shapes are traced from."""
    if gemma4.is_gemma4(config):
        return gemma4.transformer_class()(config=config, dtype=param_dtype)
    return gemma_lib.gm().nn.Transformer(config=config, dtype=param_dtype)


def attention_kernel(attention: str, config: gm.nn.config.TransformerConfig, mesh: Any = None
                     ) -> attention_lib.Kernel | None:
    """The fused attention kernel ``attention`` means for the devices of ``mesh`` (default: the
    default backend's); None: gemma's own attention."""
    return attention_lib.kernel_for(attention, platform=mesh_lib.platform(mesh), mesh=mesh,
                                    soft_cap=config.attn_logits_soft_cap)


@functools.cache
def _remat_transformer_class() -> type:
    """gemma's Transformer whose blocks are rematerialised (``jax.checkpoint``) when training."""
    import flax.linen as nn
    import jax

    gm = gemma_lib.gm()
    policies = {"full": None,
                "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}

    def run_block(block: Any, x: Any, positions: Any, attention_mask: Any) -> Any:
        return block(x, positions, None, attention_mask)[1]

    class RematTransformer(gm.nn.Transformer):
        remat: str = "full"

        def _apply_attention(self, inputs: Any, cache: Any) -> tuple[Any, Any]:
            if cache is not None:  # decoding with a KV cache: no backward pass to save for
                return super()._apply_attention(inputs, cache)
            remat_block = nn.remat(run_block, policy=policies[self.remat], prevent_cse=True)
            x = inputs.embeddings
            for block in self.blocks:
                x = remat_block(block, x, inputs.positions, inputs.attention_mask)
            return self.final_norm(x), {}

    return RematTransformer


# For random init: which axes of each weight are contracted with the layer's input (its fan-in),
# by the weight's name and number of dimensions (Gemma 4's experts share names with its MLP's).
_FAN_IN_AXES = {
    ("input_embedding", 2): (1,),  # scaled by sqrt(embed_dim) on input; tied output projection
    ("q_einsum", 3): (1,),  # [heads, embed, head_dim]
    ("k_einsum", 3): (1,),  # Gemma 4's keys-are-values global layers: [kv_heads, embed, head_dim]
    ("kv_einsum", 4): (2,),  # [2, kv_heads, embed, head_dim]
    ("qkv_einsum", 4): (2,),  # [3, heads, embed, head_dim]
    ("attn_vec_einsum", 3): (0, 1),  # [heads, head_dim, embed]
    ("linear", 2): (0,),  # [hidden, embed]
    ("linear", 3): (1,),  # Gemma 4's experts: [experts, hidden, embed]
    ("gating_einsum", 4): (3,),  # Gemma 4's experts: [experts, 2, hidden, embed]
    ("router_logits", 2): (0,),  # [embed, experts]
    # Gemma 4's per-layer embeddings: [vocab, layers, dim] (scaled by sqrt(dim) on input), the
    # model's projection to them [embed, layers, dim] (RMS-normed after: any scale does), and
    # each block's gate [embed, dim] and projection back [dim, embed].
    ("per_layer_embeddings", 3): (2,),
    ("per_layer_model_projection", 3): (0,),
    ("per_layer_input_gate", 2): (0,),
    ("per_layer_projection", 2): (0,),
}
_RESIDUAL_OUTPUTS = ("attn_vec_einsum", "linear", "per_layer_projection")
# Gemma 4's 1-D weights that multiply (start at one); Gemma 3's norm scales add to one (zeros).
_GEMMA4_UNIT_VECTORS = ("scale", "skip_scale", "router_scale", "per_expert_scale")


def init_params(model: gm.nn.Transformer, *, seed: int, sample_length: int,
                shardings: Any = None) -> Any:
    """Random weights for training from scratch, drawn with fan-in scaling.

    gemma's modules draw every weight from N(0, 0.01), which suits loading checkpoints but
    trains slowly from scratch (the tiny preset's eval loss after 40 steps: 5.0 vs 2.6 with this).
    Weights get std 1/sqrt(fan_in); projections back into the residual stream are further
    scaled by 1/sqrt(2 * num_layers); norm scales start at unit gain (Gemma 3's zeros, as its
    norms scale by 1 + scale; Gemma 4's ones, as do its other 1-D scales).
    """
    import jax
    import jax.numpy as jnp

    config = model.config
    family4 = gemma4.is_gemma4(config)
    # gating_einsum is [2, hidden, embed] when transposed (Gemma 3; always in Gemma 4), else
    # [2, embed, hidden].
    gating_fan_in = 2 if family4 or config.transpose_gating_einsum else 1
    depth_scale = 1.0 / math.sqrt(2 * config.num_layers)

    def std_of(path: Any, weight: Any) -> float | str:
        """The weight's init std, or "zeros"/"ones" for a 1-D scale."""
        names = [getattr(entry, "key", "") for entry in path]
        if weight.ndim < 2:
            if family4 and names[-1] in _GEMMA4_UNIT_VECTORS:
                return "ones"
            if not family4 and names[-1] == "scale":
                return "zeros"
            raise ValueError(f"no init rule for parameter {jax.tree_util.keystr(path)}")
        name = next((n for n in reversed(names)
                     if (n, weight.ndim) in _FAN_IN_AXES or n == "gating_einsum"), None)
        if name is None:
            raise ValueError(f"no fan-in rule for parameter {jax.tree_util.keystr(path)}")
        axes = _FAN_IN_AXES.get((name, weight.ndim), (gating_fan_in,))
        std = 1.0 / math.sqrt(math.prod(weight.shape[a] for a in axes))
        return std * depth_scale if name in _RESIDUAL_OUTPUTS else std

    # gemma's own init gives the tree's shapes alone: compiled, its draws and the forward pass
    # it runs took most of the init's compile.
    params = jax.eval_shape(model.init, jax.random.key(0),
                            jnp.zeros((1, sample_length), jnp.int32))["params"]
    leaves = jax.tree_util.tree_leaves_with_path(params)
    stds = [std_of(path, weight) for path, weight in leaves]

    # One small program per distinct (shape, dtype, std, sharding), each device drawing only
    # its own shards (no device holds the whole model), called once a weight with that weight's
    # key: the numbers of one program drawing every weight (a key's draw does not depend on the
    # others'), compiled in a fraction of the time (the tiny preset: ~70 weights, ~8 programs;
    # vmapping the draws over each shape's keys instead compiled for 7.5 s).
    _, rescale_key = jax.random.split(jax.random.key(seed))  # (the first half was gemma's init's)
    keys = jax.random.split(rescale_key, len(leaves))
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        wheres = [shardings] * len(leaves)
    else:
        wheres = jax.tree.leaves(shardings)
    programs: dict[tuple[Any, ...], Any] = {}

    def program(shape: tuple[int, ...], dtype: Any, std: float | str, where: Any) -> Any:
        signature = (shape, dtype, std, where)
        if signature not in programs:
            def draw(key: Any) -> Any:
                if std == "zeros":
                    return jnp.zeros(shape, dtype)
                if std == "ones":
                    return jnp.ones(shape, dtype)
                return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)

            programs[signature] = jax.jit(draw, out_shardings=where)
        return programs[signature]

    new = [program(weight.shape, weight.dtype, std, where)(key)
           for (_, weight), std, where, key in zip(leaves, stds, wheres, keys, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(params), new)


def config_to_dict(config: Any) -> dict[str, Any]:
    """JSON-ready fields of a Gemma 3 or Gemma 4 ``TransformerConfig`` (enums by name, Gemma
    4's KV sharing as its fields); see ``config_from_dict``."""
    out = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, enum.Enum):
            value = value.name
        elif isinstance(value, tuple | list):
            value = [v.name if isinstance(v, enum.Enum) else v for v in value]
        elif field.name == "kv_cache_sharing_config" and value is not None:
            value = dataclasses.asdict(value)
        elif value is not None and not isinstance(value, int | float | str | bool):
            value = type(value).__name__  # e.g. a vision encoder; text runs have None here
        out[field.name] = value
    return out


def config_from_dict(values: dict[str, Any]) -> gm.nn.config.TransformerConfig:
    """Rebuild the exact ``TransformerConfig`` that ``config_to_dict`` wrote."""
    gemma_lib.gm()
    values = dict(values)
    if values.get("vision_encoder") is not None or values.get("audio_encoder") is not None:
        raise ValueError("multimodal configs are not rebuilt from JSON; use the preset")
    if "kv_cache_sharing_config" in values:  # a field of Gemma 4's config alone
        from gemma.gm.nn.gemma4 import _config, _modules

        sharing = values["kv_cache_sharing_config"]
        values["kv_cache_sharing_config"] = (None if sharing is None
                                             else _config.KVCacheSharingConfig(**sharing))
    else:
        from gemma.gm.nn import _config, _modules

        values["query_pre_attn_norm"] = _config.QueryPreAttentionNormalisation[
            values["query_pre_attn_norm"]]
    values["attention_types"] = tuple(_modules.AttentionType[n] for n in values["attention_types"])
    return _config.TransformerConfig(**values)


def cast_params(params: Any, dtype: Any) -> Any:
    """The compute copy of the (master-dtype) params (a quantized base weight keeps its
    values: its scales take ``dtype``, ``gemmalab.model.quantization``)."""
    from gemmalab.model import quantization

    return quantization.cast(params, dtype)


def parameter_count(params: Any) -> int:
    """The weights in ``params`` (a quantized one counted once, not its scales)."""
    from gemmalab.model import quantization

    return quantization.element_count(params)
