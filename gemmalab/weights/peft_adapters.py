"""LoRA adapters alone in PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors``),
for peft or vLLM on the matching base model; trained token rows as PEFT's
``trainable_token_indices``; Gemma 4's experts as PEFT's ``target_parameters``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gemmalab.errors import ConfigError
from gemmalab.weights import safetensors_io
from gemmalab.weights.hf_layout import EXPORT_DTYPES, require_dtype, require_new_dir, write_json

# The LoRA-adapted projections, by gemma module, as HF modules (PEFT's target_modules).
PEFT_MODULES = {
    "q_einsum": ("self_attn.q_proj",),
    "kv_einsum": ("self_attn.k_proj", "self_attn.v_proj"),
    "qkv_einsum": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn_vec_einsum": ("self_attn.o_proj",),
    "gating_einsum": ("mlp.gate_proj", "mlp.up_proj"),
    "linear": ("mlp.down_proj",),
    # Gemma 4: global layers whose values are their keys (HF computes v from k_proj too), and
    # each block's per-layer-input gate and projection. The dense MLP beside its experts
    # (gemma's mlp2) is HF's mlp.
    "k_einsum": ("self_attn.k_proj",),
    "per_layer_input_gate": ("per_layer_input_gate",),
    "per_layer_projection": ("per_layer_projection",),
}
# Gemma 4's experts: HF's 3-D parameters of ``layers.N.experts`` (PEFT's target_parameters), as
# (target parameter, the adapter's module path). PEFT adapts each with a ParamWrapper replacing
# the experts module, the second wrapping the first, in the order the module registers them
# (gate_up_proj, then down_proj: peft 0.21's ``_inject_parameters``), so gate_up_proj's adapter
# lies under ``base_layer``.
PEFT_PARAMETERS = {"experts_gating": ("experts.gate_up_proj", "experts.base_layer"),
                   "experts_linear": ("experts.down_proj", "experts")}


def _peft_tensors(module: str, a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """``(HF module, lora_A [r, in], lora_B [out, r])`` of one gemma adapter.

    gemma's adapter computes ``einsum(x, a, b)``: ``a`` holds the weight's input axes then the
    rank, ``b`` the rank then its output axes (``gemma.peft``), so both are reshapes of PEFT's
    matrices (K and V, gate and up share ``a``: it is copied to both).
    """
    if module in PEFT_PARAMETERS:  # a [E, in, r], b [E, r, *out]; HF's weight [E, out, in]
        experts, rank = a.shape[0], a.shape[-1]
        # PEFT's lora_A [r E, in] is expert-major ([E, r, in]), lora_B [out, r E] rank-major
        # ([out, r, E]): expert e's update is lora_B[:, :, e] @ lora_A[e].
        lora_a = a.transpose(0, 2, 1).reshape(experts * rank, -1)
        lora_b = b.reshape(experts, rank, -1).transpose(2, 1, 0).reshape(-1, rank * experts)
        return [(PEFT_PARAMETERS[module][1], lora_a, lora_b)]
    rank = b.shape[0]
    if module in ("q_einsum", "linear", "k_einsum", "per_layer_input_gate",
                  "per_layer_projection"):
        return [(PEFT_MODULES[module][0], a.T, b.reshape(rank, -1).T)]
    if module in ("kv_einsum", "qkv_einsum", "gating_einsum"):  # b: [r, k|v (|...), ...]
        return [(name, a.T, b[:, j].reshape(rank, -1).T)
                for j, name in enumerate(PEFT_MODULES[module])]
    if module == "attn_vec_einsum":  # a: [heads, head_dim, r]
        return [(PEFT_MODULES[module][0], a.reshape(-1, rank).T, b.T)]
    raise ValueError(f"no PEFT layout for a LoRA adapter on {module}")


def peft_adapter_tensors(lora_params: dict, dtype: str = "float32"
                         ) -> list[safetensors_io.Tensor]:
    """PEFT's ``adapter_model.safetensors`` tensors for a gemma LoRA adapter tree."""
    from gemmalab.model import lora

    out_dtype = safetensors_io.DTYPES[EXPORT_DTYPES[dtype]]
    tensors = []
    for path, module, a, b in lora.adapted_weights(lora_params):
        layer = int(path[0].removeprefix("layer_"))
        a_host, b_host = np.asarray(a, np.float32), np.asarray(b, np.float32)
        for name, lora_a, lora_b in _peft_tensors(module, a_host, b_host):
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            for kind, value in (("lora_A", lora_a), ("lora_B", lora_b)):
                tensors.append(safetensors_io.Tensor(
                    f"{prefix}.{kind}.weight", tuple(value.shape), out_dtype,
                    lambda value=value: value.astype(out_dtype)))
    return sorted(tensors, key=lambda t: t.name)


def peft_adapter_config(*, rank: int, alpha: float, target_modules: list[str],
                        base_model_name_or_path: str, token_ids: tuple[int, ...] = (),
                        target_parameters: list[str] | None = None) -> dict[str, Any]:
    """``adapter_config.json``: PEFT's LoraConfig fields that peft and vLLM read (and
    ``target_parameters`` where experts are adapted)."""
    config = {
        "trainable_token_indices": {"embed_tokens": list(token_ids)} if token_ids else None,
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "r": rank, "lora_alpha": alpha, "target_modules": target_modules,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
    }
    if target_parameters:
        config["target_parameters"] = target_parameters
    return config


def _hf_linear_shapes(model_config: Any) -> dict[str, tuple[int, int]]:
    """``[out, in]`` of each adaptable HF Linear of a Gemma 3 block."""
    embed, ffw = model_config.embed_dim, model_config.hidden_dim
    q_out = model_config.num_heads * model_config.head_dim
    kv_out = model_config.num_kv_heads * model_config.head_dim
    return {"self_attn.q_proj": (q_out, embed), "self_attn.k_proj": (kv_out, embed),
            "self_attn.v_proj": (kv_out, embed), "self_attn.o_proj": (embed, q_out),
            "mlp.gate_proj": (ffw, embed), "mlp.up_proj": (ffw, embed),
            "mlp.down_proj": (embed, ffw)}


def _hf_adapted_shapes(model_config: Any, layer: int) -> dict[str, tuple[int, int, int]]:
    """``(experts, out, in)`` of each adaptable HF weight of block ``layer``, by the adapter's
    module path in the block (experts 1: a Linear)."""
    from gemmalab.model import gemma4

    if not gemma4.is_gemma4(model_config):
        return {name: (1, *shape) for name, shape in _hf_linear_shapes(model_config).items()}
    config = model_config
    embed, heads = config.embed_dim, config.num_heads
    global_ = config.attention_types[layer].name == "GLOBAL"
    key = config.global_key_size if global_ and config.global_key_size else config.head_dim
    kv_heads = (config.num_global_kv_heads if global_ and config.num_global_kv_heads is not None
                else config.num_kv_heads)
    shares = gemma4.sharing_pattern(config)[layer] != layer
    ffw = (config.moe_dense_hidden_dim if config.enable_moe
           else config.override_kv_shared_ffw_hidden
           if shares and config.override_kv_shared_ffw_hidden is not None else config.hidden_dim)
    shapes = {"self_attn.q_proj": (1, heads * key, embed),
              "self_attn.o_proj": (1, embed, heads * key),
              "mlp.gate_proj": (1, ffw, embed), "mlp.up_proj": (1, ffw, embed),
              "mlp.down_proj": (1, embed, ffw)}
    if not shares:  # a sharing layer has no keys and values of its own in HF
        shapes["self_attn.k_proj"] = (1, kv_heads * key, embed)
        if not (global_ and config.k_eq_v_global):
            shapes["self_attn.v_proj"] = (1, kv_heads * key, embed)
    if config.per_layer_input_dim:
        shapes["per_layer_input_gate"] = (1, config.per_layer_input_dim, embed)
        shapes["per_layer_projection"] = (1, embed, config.per_layer_input_dim)
    if config.enable_moe:
        experts, hidden = config.num_experts, config.expert_dim
        shapes[PEFT_PARAMETERS["experts_gating"][1]] = (experts, 2 * hidden, embed)
        shapes[PEFT_PARAMETERS["experts_linear"][1]] = (experts, embed, hidden)
    return shapes


def _check_adapter_shapes(tensors: list[safetensors_io.Tensor], model_config: Any,
                          rank: int) -> None:
    """Each lora_A is [rank, in] and lora_B [out, rank] of its Linear in ``model_config`` (of
    its experts' weight: [rank E, in] and [out, rank E])."""
    fix = "give the run's lora_rank, its model config and its adapters"
    for tensor in tensors:
        parts = tensor.name.split(".")
        layer, module, kind = int(parts[4]), ".".join(parts[5:-2]), parts[-2]
        # Any layer's shapes name a wrong shape as such, even in a layer the model lacks.
        shapes = _hf_adapted_shapes(model_config, min(layer, model_config.num_layers - 1))
        if module not in shapes:
            raise ConfigError("lora_params", f"{tensor.name}: layer {layer} of the model has "
                              f"no {module} to adapt", fix)
        experts, out, in_ = shapes[module]
        want = (rank * experts, in_) if kind == "lora_A" else (out, rank * experts)
        if tensor.shape != want or layer >= model_config.num_layers:
            problem = (f"{tensor.name} has shape {tensor.shape}, the model's {want}"
                       if tensor.shape != want else f"{tensor.name}: the model has "
                       f"{model_config.num_layers} layers")
            raise ConfigError("lora_params", problem, fix)

# PEFT's trained embedding rows (LoraConfig.trainable_token_indices): the rows' new values,
# which PEFT writes over the base embedding's (``index_copy``), tied to the output head.
PEFT_TOKEN_ROWS = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"


def export_peft(lora_params: dict, model_config: Any, out_dir: str | Path, *, rank: int,
                alpha: float, base_model_name_or_path: str, dtype: str = "float32",
                token_ids: tuple[int, ...] = (), token_rows: Any = None) -> list[str]:
    """Write LoRA adapters alone in PEFT's layout (``adapter_config.json``,
    ``adapter_model.safetensors``). ``alpha / rank`` is the scale the run trained with
    (gemma's own LoRA, unscaled, is ``alpha = rank``). A run that trained embedding rows gives
    their ids and their trained values (``token_rows``, ``[len(token_ids), embed]``: the
    merged embedding's rows), written as PEFT's trainable tokens."""
    require_dtype(dtype)
    if rank <= 0 or alpha <= 0:
        raise ConfigError("rank" if rank <= 0 else "alpha", f"{rank if rank <= 0 else alpha} "
                          "is not positive", "give the run's lora_rank and lora_alpha")
    tensors = peft_adapter_tensors(lora_params, dtype)
    if not tensors:
        raise ConfigError("lora_params", "no LoRA adapters in the tree",
                          "give the adapters of a run with lora_rank > 0 "
                          "(gemmalab.model.lora.split)")
    from gemmalab.model import lora

    adapted = lora.adapted_weights(lora_params)
    ranks = {a.shape[-1] for _, _, a, _ in adapted}  # a: the input axes, then the rank
    if ranks != {rank}:
        raise ConfigError("rank", f"{rank} differs from the adapters' rank {sorted(ranks)}",
                          "give the run's lora_rank")
    _check_adapter_shapes(tensors, model_config, rank)
    modules = {module for _, module, _, _ in adapted}
    targets = sorted({name.split(".")[-1] for module in modules
                      for name in PEFT_MODULES.get(module, ())})
    parameters = sorted(PEFT_PARAMETERS[m][0] for m in modules if m in PEFT_PARAMETERS)
    if len(parameters) == 1:  # the names of gate_up_proj's adapter assume both are adapted
        raise ConfigError("lora_params", f"the experts' adapters hold {parameters[0]} alone",
                          "give adapters of both expert weights (lora_modules 'mlp' or 'all')")

    if lora.TOKEN_ROWS in lora_params and not token_ids:
        raise ConfigError("token_ids", "the adapters hold trained embedding rows but no ids were "
                          "given", "give the run's lora_token_ids and the rows (export_run does)")
    if token_ids:
        rows = np.asarray(token_rows, np.float32)
        if rows.shape != (len(token_ids), model_config.embed_dim):
            raise ConfigError("token_rows", f"shape {rows.shape}, not ({len(token_ids)}, "
                              f"{model_config.embed_dim})", "give the merged embedding's rows "
                              "of the run's lora_token_ids")
        out_dtype = safetensors_io.DTYPES[EXPORT_DTYPES[dtype]]
        tensors.append(safetensors_io.Tensor(PEFT_TOKEN_ROWS, rows.shape, out_dtype,
                                             lambda: rows.astype(out_dtype)))
    out = require_new_dir(out_dir)
    safetensors_io.write_file(out / "adapter_model.safetensors", tensors)
    write_json(out / "adapter_config.json", peft_adapter_config(
        rank=rank, alpha=alpha, target_modules=targets,
        base_model_name_or_path=base_model_name_or_path, token_ids=tuple(token_ids),
        target_parameters=parameters))
    return ["adapter_config.json", "adapter_model.safetensors"]
