"""Hugging Face Gemma 4 text weights: gemma's Gemma 4 params <-> ``Gemma4ForCausalLM``.

``hf_layout`` dispatches here for a Gemma 4 config (export) or params tree (import). The layout,
as transformers' ``modeling_gemma4.py`` (5.23) defines it, against gemma's ``gm.nn.gemma4``:

- ``Linear`` weights are ``[out, in]`` and heads flatten head-major, as in Gemma 3. Both
  libraries' RMSNorm compute ``x * w`` with ``w`` starting at one, so norm scales copy as they
  are; the value norm has no weight on either side.
- Layers that read another layer's keys and values (``num_kv_shared_layers``, the last ones)
  have no ``k_proj``/``v_proj``/``k_norm`` in HF. gemma still creates (and never uses) them:
  they are not exported, and are filled with zeros (norm scales: ones) on import.
- Global layers of ``attention_k_eq_v`` models use their keys as values: ``k_proj`` alone,
  gemma's ``k_einsum``.
- The mixture of experts names its norms the other way round: gemma's dense branch is
  ``mlp2`` under ``pre_ffw2_norm``/``post_ffw2_norm``, HF's is ``mlp`` under
  ``pre_feedforward_layernorm``/``post_feedforward_layernorm_1``; gemma's experts (``mlp``,
  ``pre_ffw_norm``, ``post_ffw1_norm``) are HF's ``experts``/``router`` under
  ``pre_feedforward_layernorm_2``/``post_feedforward_layernorm_2``.
- Experts: gemma's ``gating_einsum`` ``[E, 2, H, D]`` is HF's ``gate_up_proj`` ``[E, 2H, D]``
  (gate rows first); ``linear`` ``[E, H, D]`` is ``down_proj`` ``[E, D, H]``.
- Per-layer embeddings: one ``[V, L * P]`` table and one ``[L * P, D]`` projection for all layers
  (gemma's ``[V, L, P]`` and ``[D, L, P]``); both scale the projection by ``D ** -0.5``.
- Each layer's ``skip_scale`` is HF's ``layer_scalar``, a saved buffer without ``.weight``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from gemmalab.errors import ConfigError
from gemmalab.weights.hf_shapes import config_constants
from gemmalab.weights.hf_shapes import flatten as _flatten
from gemmalab.weights.hf_shapes import heads_in_to_linear as _heads_in_to_linear
from gemmalab.weights.hf_shapes import layer_names as _layer_names
from gemmalab.weights.hf_shapes import linear_to_heads_in as _linear_to_heads_in

# Gemma 4's own chat format (gemma's ``dialog`` GEMMA4 turns; written here, not Hugging Face's
# hub template, which also renders tools and thinking): a real system role, "assistant" read as
# "model", each turn closed by ``<turn|>`` and a line break.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] in ['model', 'assistant'] -%}{%- set role = 'model' -%}"
    "{%- elif message['role'] == 'system' -%}{%- set role = 'system' -%}"
    "{%- else -%}{%- set role = 'user' -%}{%- endif -%}"
    "{{ '<|turn>' + role + '\n' + (message['content'] | trim) + '<turn|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\n' }}{%- endif -%}")
START_OF_TURN, END_OF_TURN = "<|turn>", "<turn|>"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One gemma weight as HF tensors (full names under the model's prefix), both ways."""

    hf: tuple[str, ...]
    to_hf: Callable[[Any], tuple[Any, ...]]
    to_gemma: Callable[[tuple[np.ndarray, ...], tuple[int, ...]], np.ndarray]


def _copy(name: str) -> Rule:
    return Rule((name,), lambda w: (w,), lambda hf, shape: hf[0])


def _transposed(name: str) -> Rule:  # gemma's [in, out] einsum weight, HF's [out, in] Linear
    return Rule((name,), lambda w: (w.T,), lambda hf, shape: hf[0].T)


def _heads(name: str) -> Rule:
    return Rule((name,), lambda w: (_heads_in_to_linear(w),),
                lambda hf, shape: _linear_to_heads_in(hf[0], shape))


def _gate_up(prefix: str) -> Rule:  # a dense MLP's [2, hidden, embed] as HF's two [out, in]
    return Rule((f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"),
                lambda w: (w[0], w[1]), lambda hf, shape: np.stack(hf))


_TOP = {
    ("embedder", "input_embedding"): Rule(  # the Hub's multimodal tables may hold more rows
        ("embed_tokens.weight",), lambda w: (w,), lambda hf, shape: hf[0][:shape[0]]),
    ("embedder", "per_layer_embeddings"): Rule(
        ("embed_tokens_per_layer.weight",), lambda w: (w.reshape(w.shape[0], -1),),
        lambda hf, shape: hf[0][:shape[0]].reshape(shape)),
    ("embedder", "per_layer_model_projection", "w"): Rule(
        ("per_layer_model_projection.weight",), lambda w: (w.reshape(w.shape[0], -1).T,),
        lambda hf, shape: hf[0].T.reshape(shape)),
    ("embedder", "per_layer_projection_norm", "scale"): _copy("per_layer_projection_norm.weight"),
    ("final_norm", "scale"): _copy("norm.weight"),
}

_BLOCK = {
    ("pre_attention_norm", "scale"): _copy("input_layernorm.weight"),
    ("post_attention_norm", "scale"): _copy("post_attention_layernorm.weight"),
    ("attn", "q_einsum", "w"): _heads("self_attn.q_proj.weight"),
    ("attn", "query_norm", "scale"): _copy("self_attn.q_norm.weight"),
    ("attn", "attn_vec_einsum", "w"): Rule(  # [heads, head_dim, embed] -> [embed, h * hd]
        ("self_attn.o_proj.weight",), lambda w: (w.reshape(-1, w.shape[-1]).T,),
        lambda hf, shape: hf[0].T.reshape(shape)),
    ("skip_scale",): _copy("layer_scalar"),
    ("per_layer_input_gate", "w"): _transposed("per_layer_input_gate.weight"),
    ("per_layer_projection", "w"): _transposed("per_layer_projection.weight"),
    ("post_per_layer_input_norm", "scale"): _copy("post_per_layer_input_norm.weight"),
}

# A layer's own keys and values: HF's KV-sharing layers have none of these.
OWN_KV = {
    ("attn", "kv_einsum", "w"): Rule(
        ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        lambda w: (_heads_in_to_linear(w[0]), _heads_in_to_linear(w[1])),
        lambda hf, shape: np.stack([_linear_to_heads_in(x, shape[1:]) for x in hf])),
    ("attn", "k_einsum", "w"): _heads("self_attn.k_proj.weight"),
    ("attn", "key_norm", "scale"): _copy("self_attn.k_norm.weight"),
}

_DENSE = {
    ("pre_ffw_norm", "scale"): _copy("pre_feedforward_layernorm.weight"),
    ("mlp", "gating_einsum"): _gate_up("mlp"),
    ("mlp", "linear"): _transposed("mlp.down_proj.weight"),
    ("post_ffw_norm", "scale"): _copy("post_feedforward_layernorm.weight"),
}

_MOE = {
    # the dense branch
    ("pre_ffw2_norm", "scale"): _copy("pre_feedforward_layernorm.weight"),
    ("mlp2", "gating_einsum"): _gate_up("mlp"),
    ("mlp2", "linear"): _transposed("mlp.down_proj.weight"),
    ("post_ffw2_norm", "scale"): _copy("post_feedforward_layernorm_1.weight"),
    # the experts and their router
    ("pre_ffw_norm", "scale"): _copy("pre_feedforward_layernorm_2.weight"),
    ("mlp", "router_logits", "w"): _transposed("router.proj.weight"),
    ("mlp", "router_scale"): _copy("router.scale"),
    ("mlp", "per_expert_scale"): _copy("router.per_expert_scale"),
    ("mlp", "gating_einsum", "w"): Rule(
        ("experts.gate_up_proj",), lambda w: (w.reshape(w.shape[0], -1, w.shape[-1]),),
        lambda hf, shape: hf[0].reshape(shape)),
    ("mlp", "linear", "w"): Rule(
        ("experts.down_proj",), lambda w: (w.transpose(0, 2, 1),),
        lambda hf, shape: hf[0].transpose(0, 2, 1)),
    ("post_ffw1_norm", "scale"): _copy("post_feedforward_layernorm_2.weight"),
    # both branches summed
    ("post_ffw_norm", "scale"): _copy("post_feedforward_layernorm.weight"),
}


def block_rules(moe: bool) -> dict[tuple[str, ...], Rule]:
    """The rules of one layer's weights (dense or mixture of experts)."""
    return {**_BLOCK, **OWN_KV, **(_MOE if moe else _DENSE)}


def top_rules() -> dict[tuple[str, ...], Rule]:
    """The rules of the weights outside the layers (embeddings, final norm)."""
    return dict(_TOP)


def layer_types(model_config: Any) -> list[str]:
    """HF's ``layer_types``, read with Gemma 4's own ``AttentionType`` (not Gemma 3's enum,
    whose members never equal these)."""
    from gemma.gm.nn.gemma4 import _modules

    names = {_modules.AttentionType.GLOBAL: "full_attention",
             _modules.AttentionType.LOCAL_SLIDING: "sliding_attention"}
    return [names[t] for t in model_config.attention_types]


def kv_shared_layers(model_config: Any) -> int:
    """HF's ``num_kv_shared_layers``: how many last layers reuse another layer's keys and values.

    HF's sharing layers are always the last ones, and each reads the last earlier layer of its
    own type; gemma's pattern (``gemmalab.model.gemma4.sharing_pattern``) must be that one."""
    from gemmalab.model import gemma4

    pattern = gemma4.sharing_pattern(model_config)
    sharing = [i for i, source in enumerate(pattern) if source != i]
    if not sharing:
        return 0
    first, types = sharing[0], layer_types(model_config)
    hf_pattern = list(range(first))
    for i in range(first, len(types)):
        same = [j for j in range(first) if types[j] == types[i]]
        hf_pattern.append(same[-1] if same else -1)
    if pattern != hf_pattern:
        raise ConfigError("model_config", f"its KV sharing {pattern} is not Gemma4TextConfig's "
                          f"(the last layers each reading the last earlier one of its type: "
                          f"{hf_pattern})", "export a configuration gemma and Hugging Face "
                          "share keys and values alike (the Gemma 4 presets do)")
    return len(pattern) - first


def kv_sharing_layers(num_layers: int, shared: int) -> range:
    """The indices of the layers without their own keys and values in HF's layout."""
    return range(num_layers - shared, num_layers)


def _rope(base: float, factor: float, proportion: float | None) -> dict[str, Any]:
    if proportion is not None and proportion != 1.0:
        rope = {"rope_type": "proportional", "partial_rotary_factor": float(proportion),
                "rope_theta": float(base)}
        return rope if factor == 1.0 else {**rope, "factor": float(factor)}
    if factor == 1.0:
        return {"rope_type": "default", "rope_theta": float(base)}
    return {"rope_type": "linear", "factor": float(factor), "rope_theta": float(base)}


def _require_hf_blocks(model_config: Any) -> None:
    """Refuse what ``Gemma4TextConfig`` cannot say (it would load as another model)."""
    from gemma.gm.nn.gemma4 import _modules

    def refuse(problem: str) -> None:
        raise ConfigError("model_config", f"{problem}: no Gemma4ForCausalLM equivalent",
                          "export a Gemma 4 preset's configuration")

    for field in ("use_post_attn_norm", "use_post_ffw_norm", "qk_norm_with_scale"):
        if not getattr(model_config, field):
            refuse(f"{field}=False")
    if model_config.attn_logits_soft_cap is not None:
        refuse("attention logit soft-capping")  # HF's Gemma 4 attention never caps
    if model_config.vision_encoder is not None or model_config.audio_encoder is not None:
        refuse("a vision or audio tower")
    if model_config.attention_types[-1] != _modules.AttentionType.GLOBAL:
        refuse("a last layer that is not global")  # HF forces it to full attention
    global_kv = model_config.num_global_kv_heads
    if global_kv not in (None, model_config.num_kv_heads) and not model_config.k_eq_v_global:
        refuse("global KV heads of their own without keys as values")  # HF reads them only so


def _double_wide_mlp(model_config: Any, shared: int) -> bool:
    wide = model_config.override_kv_shared_ffw_hidden
    if wide is None or not shared:
        return False
    if wide != 2 * model_config.hidden_dim:
        raise ConfigError("model_config", f"sharing layers' MLP width {wide} is not twice "
                          f"{model_config.hidden_dim}: HF's use_double_wide_mlp only doubles",
                          "export a Gemma 4 preset's configuration")
    return True


def context_length(model_config: Any) -> int:
    """``max_position_embeddings``: 128k for the models with per-layer embeddings (E2B, E4B),
    256k for the others (31B, 26B-A4B), as their model cards give."""
    return 131_072 if model_config.per_layer_input_dim else 262_144


def hf_config(model_config: Any, *, dtype: str, bos_id: int, eos_id: int | list[int],
              pad_id: int) -> dict[str, Any]:
    """``config.json`` of ``Gemma4ForCausalLM`` (``Gemma4TextConfig``) for a gemma Gemma 4
    ``TransformerConfig``. Every field whose HF default is not gemma's is written, e.g.
    ``global_head_dim`` (default 512) and ``hidden_size_per_layer_input`` (default 256, 0 here
    without per-layer embeddings)."""
    _require_hf_blocks(model_config)
    shared = kv_shared_layers(model_config)
    moe = bool(model_config.enable_moe)
    k_eq_v = bool(model_config.k_eq_v_global)
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": model_config.num_embed,
        "hidden_size": model_config.embed_dim,
        "intermediate_size": model_config.moe_dense_hidden_dim if moe else model_config.hidden_dim,
        "num_hidden_layers": model_config.num_layers,
        "num_attention_heads": model_config.num_heads,
        "num_key_value_heads": model_config.num_kv_heads,
        "head_dim": model_config.head_dim,
        "global_head_dim": model_config.global_key_size or model_config.head_dim,
        "attention_k_eq_v": k_eq_v,
        "num_global_key_value_heads": (model_config.num_global_kv_heads or
                                       model_config.num_kv_heads) if k_eq_v else None,
        "hidden_activation": "gelu_pytorch_tanh",  # gemma's nn.gelu: the tanh approximation
        "rms_norm_eps": 1e-6,  # fixed in gemma's RMSNorm
        "sliding_window": model_config.sliding_window_size,
        "layer_types": layer_types(model_config),
        "rope_parameters": {
            "sliding_attention": _rope(model_config.local_base_frequency,
                                       model_config.local_scale_factor,
                                       model_config.local_rope_proportion),
            "full_attention": _rope(model_config.global_base_frequency,
                                    model_config.global_scale_factor,
                                    model_config.global_rope_proportion)},
        "max_position_embeddings": context_length(model_config),
        "final_logit_softcapping": model_config.final_logit_softcap,
        "vocab_size_per_layer_input": model_config.num_embed,
        "hidden_size_per_layer_input": model_config.per_layer_input_dim or 0,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": _double_wide_mlp(model_config, shared),
        "enable_moe_block": moe,
        "num_experts": model_config.num_experts if moe else None,
        "top_k_experts": model_config.top_k_experts if moe else None,
        "moe_intermediate_size": model_config.expert_dim if moe else None,
        "use_bidirectional_attention": None,
        **config_constants(bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, dtype=dtype),
    }


def unexported_paths(model_config: Any) -> set[tuple[str, ...]]:
    """The params (``layer_i`` first) that HF's layout has no place for: the keys, values and
    key norms of the layers that reuse another layer's (gemma computes and discards them)."""
    shared = kv_shared_layers(model_config)
    return {(f"layer_{i}", *path)
            for i in kv_sharing_layers(model_config.num_layers, shared) for path in OWN_KV}


def _rule(rules: dict[tuple[str, ...], Rule], where: str, path: tuple[str, ...]) -> Rule:
    if path not in rules:
        raise ValueError(f"{where}{'/'.join(path)} has no Hugging Face counterpart "
                         "(a LoRA tree? merge it first)")
    return rules[path]


def export_tensors(params: dict, model_config: Any,
                   make: Callable[[str, Any, Callable[[Any], Any]], Any]) -> list[Any]:
    """``make(name, leaf, convert)`` for each HF tensor of a Gemma 4 params tree (names under
    the model's prefix), the sharing layers' unused keys and values left out."""
    shared = kv_sharing_layers(model_config.num_layers, kv_shared_layers(model_config))
    top = {k: v for k, v in params.items() if not k.startswith("layer_")}
    out = []

    def add(rule: Rule, leaf: Any) -> None:
        for j, name in enumerate(rule.hf):
            out.append(make(name, leaf, lambda w, rule=rule, j=j: rule.to_hf(w)[j]))

    for path, leaf in _flatten(top).items():
        add(_rule(_TOP, "", path), leaf)
    rules = block_rules(bool(model_config.enable_moe))
    for i, layer_name in enumerate(_layer_names(params)):
        for path, leaf in sorted(_flatten(params[layer_name]).items()):
            if i in shared and path in OWN_KV:
                continue
            rule = _rule(rules, f"{layer_name}/", path)
            add(dataclasses.replace(rule, hf=tuple(f"layers.{i}.{n}" for n in rule.hf)), leaf)
    return out


def import_params(get: Callable[[str], np.ndarray], has: Callable[[str], bool],
                  put: Callable[[tuple[str, ...], np.ndarray, Any], None], expected: dict,
                  kv_shared: int) -> None:
    """Fill a Gemma 4 tree shaped like ``expected`` through ``put(path, value, leaf)`` from HF
    tensors (``get(name)``, names under the model's prefix). The last ``kv_shared`` layers reuse
    another layer's keys and values: where HF saved none of their own, gemma's unused ones get
    zeros (norm scales: ones)."""
    for path, leaf in _flatten({k: v for k, v in expected.items()
                                if not k.startswith("layer_")}).items():
        rule = _rule(_TOP, "", path)
        put(path, rule.to_gemma(tuple(get(n) for n in rule.hf), tuple(leaf.shape)), leaf)
    layers = _layer_names(expected)
    shared = kv_sharing_layers(len(layers), kv_shared)
    for i, layer_name in enumerate(layers):
        rules = block_rules(moe="mlp2" in expected[layer_name])
        for path, leaf in _flatten(expected[layer_name]).items():
            rule = _rule(rules, f"{layer_name}/", path)
            names = tuple(f"layers.{i}.{n}" for n in rule.hf)
            if i in shared and path in OWN_KV and not all(has(n) for n in names):
                fill = np.ones if path[-1] == "scale" else np.zeros
                value = fill(tuple(leaf.shape), np.float32)
            else:
                value = rule.to_gemma(tuple(get(n) for n in names), tuple(leaf.shape))
            put((layer_name, *path), value, leaf)
