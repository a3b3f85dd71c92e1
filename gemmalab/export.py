"""Export a run's weights for other tools, and read Hugging Face Gemma 3 weights back.

- ``save_gemma_params``: gemma's own format (the Orbax tree ``gm.ckpts.load_params`` reads);
- ``export_hf``: a Hugging Face ``Gemma3ForCausalLM`` directory (``config.json``, safetensors,
  sharded past a size, tokenizer files, ``generation_config.json``);
- ``export_peft``: LoRA adapters alone in PEFT's layout (``adapter_config.json``,
  ``adapter_model.safetensors``), for peft or vLLM on the matching base model;
- ``load_hf_params``: an HF Gemma 3 directory as a gemma params tree (a run's ``checkpoint``).

The two layouts, as transformers' Gemma 3 modeling code and its converter from gemma's
checkpoints define them: HF ``Linear`` weights are ``[out, in]`` and a projection's heads are
flattened head-major (``n * head_dim + h``); both libraries' RMSNorm compute ``x * (1 + w)``, so
norm scales copy as they are; both multiply the embedding by ``sqrt(hidden)`` at the input and
reuse it, tied, as the output head (HF saves no ``lm_head.weight``).

    python -m gemmalab.export --run runs/x --format hf|gemma|peft --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gemmalab import safetensors_io
from gemmalab.errors import ConfigError

FORMATS = ("hf", "gemma", "peft")
EXPORT_DTYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' own default shard size ("5GB")

# HF's names (``model.layers.{i}.`` + name + ``.weight``) of the weights in a gemma block.
_NORMS = {
    ("pre_attention_norm", "scale"): "input_layernorm",
    ("post_attention_norm", "scale"): "post_attention_layernorm",
    ("pre_ffw_norm", "scale"): "pre_feedforward_layernorm",
    ("post_ffw_norm", "scale"): "post_feedforward_layernorm",
    ("attn", "_query_norm", "scale"): "self_attn.q_norm",
    ("attn", "_key_norm", "scale"): "self_attn.k_norm",
}
# The LoRA-adapted projections, by gemma module, as HF modules (PEFT's target_modules).
PEFT_MODULES = {
    "q_einsum": ("self_attn.q_proj",),
    "kv_einsum": ("self_attn.k_proj", "self_attn.v_proj"),
    "qkv_einsum": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn_vec_einsum": ("self_attn.o_proj",),
    "gating_einsum": ("mlp.gate_proj", "mlp.up_proj"),
    "linear": ("mlp.down_proj",),
}


# ---------------------------------------------------------------------------------------------
# Weight layouts: gemma <-> HF. Every function works on numpy arrays and on JAX tracers alike
# (tracers give the output shapes without computing anything).


def _heads_in_to_linear(w: Any) -> Any:
    """``[heads, embed, head_dim]`` (q/k/v einsum) -> HF ``[heads * head_dim, embed]``."""
    return w.transpose(0, 2, 1).reshape(-1, w.shape[1])


def _linear_to_heads_in(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    heads, embed, head_dim = shape
    return x.reshape(heads, head_dim, embed).transpose(0, 2, 1)


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One gemma weight of a block as HF weights, both ways."""

    hf: tuple[str, ...]  # HF module names in the block
    to_hf: Callable[[Any], tuple[Any, ...]]
    to_gemma: Callable[[tuple[np.ndarray, ...], tuple[int, ...]], np.ndarray]


def _gating_to_gemma(hf: tuple[np.ndarray, ...], shape: tuple[int, ...]) -> np.ndarray:
    # HF's gate/up are [ffw, embed]: gemma 3's transposed gating einsum as is, else transposed.
    # (Square ffw == embed never occurs in Gemma 3; it would read as the transposed layout.)
    if hf[0].shape == tuple(shape[1:]):
        return np.stack(hf)
    return np.stack([x.T for x in hf])


def _block_rules(transpose_gating: bool) -> dict[tuple[str, ...], _Rule]:
    rules = {
        ("attn", "q_einsum", "w"): _Rule(
            ("self_attn.q_proj",), lambda w: (_heads_in_to_linear(w),),
            lambda hf, shape: _linear_to_heads_in(hf[0], shape)),
        ("attn", "kv_einsum", "w"): _Rule(
            ("self_attn.k_proj", "self_attn.v_proj"),
            lambda w: (_heads_in_to_linear(w[0]), _heads_in_to_linear(w[1])),
            lambda hf, shape: np.stack([_linear_to_heads_in(x, shape[1:]) for x in hf])),
        ("attn", "qkv_einsum", "w"): _Rule(
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            lambda w: tuple(_heads_in_to_linear(w[j]) for j in range(3)),
            lambda hf, shape: np.stack([_linear_to_heads_in(x, shape[1:]) for x in hf])),
        ("attn", "attn_vec_einsum", "w"): _Rule(  # [heads, head_dim, embed] -> [embed, h*hd]
            ("self_attn.o_proj",), lambda w: (w.reshape(-1, w.shape[-1]).T,),
            lambda hf, shape: hf[0].T.reshape(shape)),
        ("mlp", "gating_einsum"): _Rule(
            ("mlp.gate_proj", "mlp.up_proj"),
            (lambda w: (w[0], w[1])) if transpose_gating else (lambda w: (w[0].T, w[1].T)),
            _gating_to_gemma),
        ("mlp", "linear"): _Rule(  # [ffw, embed] -> [embed, ffw]
            ("mlp.down_proj",), lambda w: (w.T,), lambda hf, shape: hf[0].T),
    }
    for path, name in _NORMS.items():
        rules[path] = _Rule((name,), lambda w: (w,), lambda hf, shape: hf[0])
    return rules


def _flatten(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, (*prefix, key)))
        else:
            flat[(*prefix, key)] = value
    return flat


def _layer_names(params: dict) -> list[str]:
    return sorted((k for k in params if k.startswith("layer_")), key=lambda k: int(k[6:]))


def hf_tensors(params: dict, model_config: Any, dtype: str = "bfloat16"
               ) -> list[safetensors_io.Tensor]:
    """The ``Gemma3ForCausalLM`` tensors of a gemma params tree, in ``dtype``, converted lazily."""
    import jax

    out_dtype = safetensors_io.DTYPES[EXPORT_DTYPES[dtype]]
    rules = _block_rules(model_config.transpose_gating_einsum)

    def tensor(name: str, leaf: Any, convert: Callable[[Any], Any]) -> safetensors_io.Tensor:
        shape = jax.eval_shape(convert, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)).shape
        return safetensors_io.Tensor(
            name, tuple(shape), out_dtype,
            lambda: np.asarray(convert(np.asarray(leaf, np.float32))).astype(out_dtype))

    tensors = [tensor("model.embed_tokens.weight", params["embedder"]["input_embedding"],
                      lambda w: w)]
    for i, layer_name in enumerate(_layer_names(params)):
        for path, leaf in sorted(_flatten(params[layer_name]).items()):
            if path not in rules:
                raise ValueError(f"{layer_name}/{'/'.join(path)} has no Hugging Face counterpart "
                                 "(a LoRA tree? merge it first)")
            rule = rules[path]
            for j, module in enumerate(rule.hf):
                tensors.append(tensor(f"model.layers.{i}.{module}.weight", leaf,
                                      lambda w, rule=rule, j=j: rule.to_hf(w)[j]))
    tensors.append(tensor("model.norm.weight", params["final_norm"]["scale"], lambda w: w))
    return tensors


# The text model's prefix in HF checkpoints: Gemma3ForCausalLM, then the multimodal
# Gemma3ForConditionalGeneration as transformers 5 and 4.x save it (4B and larger on the Hub).
_HF_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def _text_prefix(names: set[str]) -> str:
    for prefix in reversed(_HF_PREFIXES):
        if f"{prefix}embed_tokens.weight" in names:
            return prefix
    raise KeyError("no Gemma 3 text model in the checkpoint (no ...embed_tokens.weight)")


def hf_to_gemma(tensors: dict[str, np.ndarray], expected: Any,
                finish: Callable[[np.ndarray, Any], Any] | None = None) -> dict:
    """A gemma params tree shaped like ``expected`` (any tree of arrays or shape structs) from
    HF ``Gemma3ForCausalLM`` tensors; ``finish(value, expected leaf)`` makes each leaf (default:
    the numpy array). Raises KeyError for a missing tensor, ValueError for a shape that does not
    fit."""
    prefix = _text_prefix(set(tensors))
    finish = finish or (lambda value, leaf: value)

    def get(name: str) -> np.ndarray:
        return tensors[f"{prefix}{name}.weight"]

    def put(tree: dict, path: tuple[str, ...], value: np.ndarray, leaf: Any) -> None:
        if tuple(value.shape) != tuple(leaf.shape):
            raise ValueError(f"{'/'.join(path)}: shape {tuple(value.shape)} in the checkpoint, "
                             f"{tuple(leaf.shape)} in the model")
        _set(tree, path, finish(value, leaf))  # one leaf at a time: host memory stays small

    params: dict[str, Any] = {}
    embedding = expected["embedder"]["input_embedding"]
    # The multimodal checkpoints append 64 image-token rows the text model does not have.
    put(params, ("embedder", "input_embedding"), get("embed_tokens")[:embedding.shape[0]],
        embedding)
    put(params, ("final_norm", "scale"), get("norm"), expected["final_norm"]["scale"])
    rules = _block_rules(transpose_gating=True)  # to_gemma reads the layout off the shapes
    for i, layer_name in enumerate(_layer_names(expected)):
        for path, leaf in _flatten(expected[layer_name]).items():
            if path not in rules:
                raise KeyError(f"{layer_name}/{'/'.join(path)} has no Hugging Face counterpart")
            rule = rules[path]
            hf = tuple(get(f"layers.{i}.{module}") for module in rule.hf)
            put(params, (layer_name, *path), rule.to_gemma(hf, tuple(leaf.shape)), leaf)
    missing = set(_flatten(expected)) - set(_flatten(params))
    if missing:
        raise KeyError(f"no Hugging Face counterpart for {sorted(missing)[:4]}")
    return params


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ---------------------------------------------------------------------------------------------
# config.json and the tokenizer files.


def _query_pre_attn_scalar(model_config: Any) -> int:
    """HF scales queries by ``query_pre_attn_scalar ** -0.5``; gemma names the normalisation."""
    from gemma.gm.nn import _config

    norm = _config.QueryPreAttentionNormalisation
    if model_config.query_pre_attn_norm == norm.BY_ONE_OVER_SQRT_HEAD_DIM:
        return model_config.head_dim
    if model_config.query_pre_attn_norm == norm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS:
        return model_config.embed_dim // model_config.num_heads
    raise ConfigError("model_config", f"query_pre_attn_norm {model_config.query_pre_attn_norm} "
                      "has no Gemma3TextConfig equivalent", "export a Gemma 3 configuration")


def _layer_types(model_config: Any) -> list[str]:
    from gemma.gm.nn import _modules

    return ["sliding_attention" if t == _modules.AttentionType.LOCAL_SLIDING
            else "full_attention" for t in model_config.attention_types]


def _sliding_window_pattern(layer_types: list[str]) -> int | None:
    """transformers < 4.53 had no ``layer_types``: every ``pattern``-th layer was global."""
    if "full_attention" not in layer_types:
        return None
    pattern = layer_types.index("full_attention") + 1
    periodic = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(len(layer_types))]
    return pattern if periodic == layer_types else None


def _rope(base: int, factor: float) -> dict[str, Any]:
    if factor == 1.0:
        return {"rope_type": "default", "rope_theta": base}
    return {"rope_type": "linear", "factor": float(factor), "rope_theta": base}


def _require_gemma3_blocks(model_config: Any) -> None:
    # HF's Gemma 3 block always has QK-norm and both post-norms (gemma 3 configs always do).
    for field in ("use_qk_norm", "use_post_attn_norm", "use_post_ffw_norm"):
        if not getattr(model_config, field):
            raise ConfigError("model_config", f"{field}=False has no Gemma3ForCausalLM "
                              "equivalent", "export a Gemma 3 configuration")


def hf_config(model_config: Any, *, dtype: str = "bfloat16", bos_id: int = 2, eos_id: int = 1,
              pad_id: int = 0) -> dict[str, Any]:
    """``config.json`` of ``Gemma3ForCausalLM`` for a gemma ``TransformerConfig``.

    Written for transformers 5 (``rope_parameters``, ``dtype``) and, with the older keys beside
    them (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``, ``torch_dtype``), for 4.x.
    """
    _require_gemma3_blocks(model_config)
    layer_types = _layer_types(model_config)
    global_rope = _rope(model_config.global_base_frequency, model_config.global_scale_factor)
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": model_config.num_embed,
        "hidden_size": model_config.embed_dim,
        "intermediate_size": model_config.hidden_dim,
        "num_hidden_layers": model_config.num_layers,
        "num_attention_heads": model_config.num_heads,
        "num_key_value_heads": model_config.num_kv_heads,
        "head_dim": model_config.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",  # gemma's nn.gelu: the tanh approximation
        "rms_norm_eps": 1e-6,  # fixed in gemma's RMSNorm
        "query_pre_attn_scalar": _query_pre_attn_scalar(model_config),
        "sliding_window": model_config.sliding_window_size,
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": global_rope,
            "sliding_attention": _rope(model_config.local_base_frequency,
                                       model_config.local_scale_factor)},
        "rope_theta": model_config.global_base_frequency,
        "rope_local_base_freq": model_config.local_base_frequency,
        "rope_scaling": None if global_rope["rope_type"] == "default" else
        {"rope_type": "linear", "factor": global_rope["factor"]},
        # Gemma 3 trained 32k contexts, stretched to 128k by the 8x global RoPE scaling (4B+).
        "max_position_embeddings": 131_072 if model_config.global_scale_factor > 1 else 32_768,
        "final_logit_softcapping": model_config.final_logit_softcap,
        "attn_logit_softcapping": model_config.attn_logits_soft_cap,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_bidirectional_attention": False,
        "use_cache": True,
        "tie_word_embeddings": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    pattern = _sliding_window_pattern(layer_types)
    if pattern is not None:
        config["sliding_window_pattern"] = pattern
    return config


# Gemma's turn format; a leading system message is folded into the first user turn, as Gemma
# has no system role. ("assistant" is accepted for "model".)
CHAT_TEMPLATE = (
    "{{ bos_token }}{%- set ns = namespace(prefix='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.prefix = message['content'] | trim"
    " + '\n\n' -%}"
    "{%- else -%}{{ '<start_of_turn>' + ('model' if message['role'] in ['model', 'assistant']"
    " else 'user') + '\n' + ns.prefix + (message['content'] | trim) + '<end_of_turn>\n' }}"
    "{%- set ns.prefix = '' -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


@dataclasses.dataclass(frozen=True)
class _Vocabulary:
    proto: bytes
    size: int
    special: dict[str, str]  # bos_token, eos_token, pad_token, unk_token -> piece
    ids: dict[str, int]
    end_of_turn: int | None  # the chat turn's end, a second stop token when present


def _read_vocabulary(tokenizer: str | Path | bytes) -> _Vocabulary:
    import sentencepiece as spm

    from gemmalab import storage

    fix = "give the SentencePiece .model file of the run's tokenizer (or its bytes)"
    try:
        proto = tokenizer if isinstance(tokenizer, bytes) else storage.read_bytes(tokenizer)
        processor = spm.SentencePieceProcessor()
        processor.LoadFromSerializedProto(proto)
    except Exception as error:  # noqa: BLE001 - missing file and bad bytes get the same fix
        raise ConfigError("tokenizer", f"not a readable SentencePiece model ({error})",
                          fix) from None
    ids = {"bos_token": processor.bos_id(), "eos_token": processor.eos_id(),
           "pad_token": processor.pad_id(), "unk_token": processor.unk_id()}
    special = {role: processor.IdToPiece(i) for role, i in ids.items() if i >= 0}
    end_of_turn = processor.PieceToId("<end_of_turn>")
    return _Vocabulary(proto, processor.GetPieceSize(), special, ids,
                       None if end_of_turn == processor.unk_id() else end_of_turn)


def _tokenizer_files(vocabulary: _Vocabulary, max_length: int) -> dict[str, Any]:
    has_turns = vocabulary.end_of_turn is not None
    config = {"tokenizer_class": "GemmaTokenizer", **vocabulary.special,
              "add_bos_token": True, "add_eos_token": False, "model_max_length": max_length,
              "padding_side": "left", "clean_up_tokenization_spaces": False,
              "spaces_between_special_tokens": False}
    if has_turns:
        config["chat_template"] = CHAT_TEMPLATE
    eos = vocabulary.ids["eos_token"]
    return {
        "tokenizer_config.json": config,
        "special_tokens_map.json": dict(vocabulary.special),
        "generation_config.json": {
            "bos_token_id": vocabulary.ids["bos_token"],
            "pad_token_id": vocabulary.ids["pad_token"],
            "eos_token_id": [eos, vocabulary.end_of_turn] if has_turns else eos},
    }


# ---------------------------------------------------------------------------------------------
# The exports.


def _require_new_dir(out_dir: str | Path, parameter: str = "out_dir") -> Path:
    path = Path(out_dir)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(parameter, f"{out_dir} exists and is not empty",
                          "choose a new directory, or remove this one first")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _require_dtype(dtype: str) -> None:
    if dtype not in EXPORT_DTYPES:
        raise ConfigError("dtype", f"unknown dtype {dtype!r}", f"use one of {list(EXPORT_DTYPES)}")


def _require_plain_params(params: dict) -> None:
    if any("lora" in path or any(k.startswith("_LoRA") for k in path)
           for path in _flatten(params)):
        raise ConfigError("params", "the tree holds LoRA adapters",
                          "merge them first (gemmalab.lora.merge), or export them with "
                          "export_peft")


def save_gemma_params(params: dict, path: str | Path) -> str:
    """Write ``params`` (LoRA runs: the merged tree) where ``gm.ckpts.load_params`` reads it."""
    from gemmalab import checkpoints

    _require_plain_params(params)
    return checkpoints.save_params(params, str(_require_new_dir(path, "path")))


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def export_hf(params: dict, model_config: Any, tokenizer: str | Path | bytes,
              out_dir: str | Path, *, dtype: str = "bfloat16",
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write a ``Gemma3ForCausalLM`` directory that ``from_pretrained`` loads.

    ``params``: a gemma params tree (LoRA runs: merged first); ``tokenizer``: the SentencePiece
    model (a path or its bytes). Returns the files written.
    """
    _require_dtype(dtype)
    if max_shard_bytes <= 0:
        raise ConfigError("max_shard_bytes", f"{max_shard_bytes} is not positive",
                          "give a size in bytes, e.g. 5_000_000_000")
    _require_plain_params(params)
    vocabulary = _read_vocabulary(tokenizer)
    if vocabulary.size > model_config.num_embed:
        raise ConfigError("tokenizer", f"{vocabulary.size} pieces but the model embeds "
                          f"{model_config.num_embed} tokens", "give the run's own tokenizer")
    config = hf_config(model_config, dtype=dtype, bos_id=vocabulary.ids["bos_token"],
                       eos_id=vocabulary.ids["eos_token"], pad_id=vocabulary.ids["pad_token"])
    tensors = hf_tensors(params, model_config, dtype)  # conversion errors before any write
    out = _require_new_dir(out_dir)
    written = safetensors_io.write_sharded(out, tensors, max_shard_bytes)
    _write_json(out / "config.json", config)
    (out / "tokenizer.model").write_bytes(vocabulary.proto)
    for name, value in _tokenizer_files(vocabulary, config["max_position_embeddings"]).items():
        _write_json(out / name, value)
    return sorted([*written, "config.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json"])


def load_hf_params(hf_dir: str | Path, expected_abstract_params: Any) -> dict:
    """A gemma params tree from an HF Gemma 3 safetensors directory (``model.safetensors`` or
    shards with their index), shaped and typed like ``expected_abstract_params``.

    Leaves that carry a ``sharding`` are read straight into it (each device's part only).
    Raises KeyError / ValueError when the checkpoint does not fit the expected tree.
    """
    directory = Path(hf_dir)
    if not safetensors_io.model_files(directory):
        raise ConfigError("checkpoint", f"no safetensors files in {hf_dir}",
                          "give a Hugging Face Gemma 3 directory (config.json + *.safetensors)")
    return hf_to_gemma(safetensors_io.read_directory(directory), expected_abstract_params,
                       finish=_place)


def _place(value: np.ndarray, leaf: Any) -> Any:
    """``value`` (a view of the mapped file) as a JAX array of ``leaf``'s dtype and sharding:
    each device's slice is read from the file on its own."""
    import jax

    dtype = getattr(leaf, "dtype", value.dtype)
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return jax.numpy.asarray(np.asarray(value, np.float32).astype(dtype))
    return jax.make_array_from_callback(
        value.shape, sharding, lambda index: np.asarray(value[index], np.float32).astype(dtype))


def is_hf_dir(path: str | Path) -> bool:
    """A directory with ``config.json`` and safetensors weights (an HF model)."""
    directory = Path(path)
    return (directory / "config.json").is_file() and bool(safetensors_io.model_files(directory))


# ---------------------------------------------------------------------------------------------
# PEFT adapters.


def _peft_tensors(module: str, a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """``(HF module, lora_A [r, in], lora_B [out, r])`` of one gemma adapter.

    gemma's adapter computes ``einsum(x, a, b)``: ``a`` holds the weight's input axes then the
    rank, ``b`` the rank then its output axes (``gemma.peft``), so both are reshapes of PEFT's
    matrices (K and V, gate and up share ``a``: it is copied to both).
    """
    rank = b.shape[0]
    if module in ("q_einsum", "linear"):
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
    from gemmalab import lora

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
                        base_model_name_or_path: str,
                        token_ids: tuple[int, ...] = ()) -> dict[str, Any]:
    """``adapter_config.json``: PEFT's LoraConfig fields that peft and vLLM read."""
    return {
        "trainable_token_indices": {"embed_tokens": list(token_ids)} if token_ids else None,
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "r": rank, "lora_alpha": alpha, "target_modules": target_modules,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
    }


def _hf_linear_shapes(model_config: Any) -> dict[str, tuple[int, int]]:
    """``[out, in]`` of each adaptable HF Linear of a block."""
    embed, ffw = model_config.embed_dim, model_config.hidden_dim
    q_out = model_config.num_heads * model_config.head_dim
    kv_out = model_config.num_kv_heads * model_config.head_dim
    return {"q_proj": (q_out, embed), "k_proj": (kv_out, embed), "v_proj": (kv_out, embed),
            "o_proj": (embed, q_out), "gate_proj": (ffw, embed), "up_proj": (ffw, embed),
            "down_proj": (embed, ffw)}


def _check_adapter_shapes(tensors: list[safetensors_io.Tensor], model_config: Any,
                          rank: int) -> None:
    """Each lora_A is [rank, in] and lora_B [out, rank] of its Linear in ``model_config``."""
    linears = _hf_linear_shapes(model_config)
    for tensor in tensors:
        parts = tensor.name.split(".")
        layer, module, kind = int(parts[4]), parts[-3], parts[-2]
        out, in_ = linears[module]
        want = (rank, in_) if kind == "lora_A" else (out, rank)
        if tensor.shape != want or layer >= model_config.num_layers:
            problem = (f"{tensor.name} has shape {tensor.shape}, the model's {want}"
                       if tensor.shape != want else f"{tensor.name}: the model has "
                       f"{model_config.num_layers} layers")
            raise ConfigError("lora_params", problem,
                              "give the run's lora_rank, its model config and its adapters")


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
    _require_dtype(dtype)
    if rank <= 0 or alpha <= 0:
        raise ConfigError("rank" if rank <= 0 else "alpha", f"{rank if rank <= 0 else alpha} "
                          "is not positive", "give the run's lora_rank and lora_alpha")
    tensors = peft_adapter_tensors(lora_params, dtype)
    if not tensors:
        raise ConfigError("lora_params", "no LoRA adapters in the tree",
                          "give the adapters of a run with lora_rank > 0 (gemmalab.lora.split)")
    ranks = {t.shape[0] for t in tensors if ".lora_A." in t.name}
    if ranks != {rank}:
        raise ConfigError("rank", f"{rank} differs from the adapters' rank {sorted(ranks)}",
                          "give the run's lora_rank")
    _check_adapter_shapes(tensors, model_config, rank)
    targets = sorted({t.name.split(".")[-3] for t in tensors})
    from gemmalab import lora

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
    out = _require_new_dir(out_dir)
    safetensors_io.write_file(out / "adapter_model.safetensors", tensors)
    _write_json(out / "adapter_config.json", peft_adapter_config(
        rank=rank, alpha=alpha, target_modules=targets,
        base_model_name_or_path=base_model_name_or_path, token_ids=tuple(token_ids)))
    return ["adapter_config.json", "adapter_model.safetensors"]


# ---------------------------------------------------------------------------------------------
# The command line: one export of a finished run's output_dir (params/ and summary.json).


def _read_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    if not path.is_file() or not (run_dir / "params").is_dir():
        raise ConfigError("run", f"{run_dir} has no summary.json and params/ of a finished run",
                          "give the output_dir of a run that completed")
    return json.loads(path.read_text())


def run_tokenizer(summary: dict[str, Any]) -> str | bytes:
    """The SentencePiece model a run used: its path, or (``gemma3``) its bytes."""
    from gemmalab import data, tokenizer
    from gemmalab.config import default_cache_dir

    params = summary["params"]
    spec = params["tokenizer"]
    if spec not in ("local", "gemma3") and not spec.endswith(".gguf"):
        return spec  # the run was given a .model path
    cache_dir = Path(params.get("cache_dir") or default_cache_dir()).expanduser()
    if spec != "local":  # Gemma 3's, or a GGUF's own (rebuilt): the bytes
        return tokenizer.load_tokenizer(spec, cache_dir=cache_dir, training_stories=None,
                                        vocab_size=0, corpus_fingerprint="")[1].model_proto
    # The local tokenizer is cached under its corpus' fingerprint: resolve the run's corpus.
    corpus = data.resolve_corpus(params["data_path"], cache_dir=cache_dir,
                                 embedded_stories=params["embedded_stories"], seed=params["seed"],
                                 skip_bad_records=params.get("skip_bad_records", False))
    path = tokenizer.local_tokenizer_path(cache_dir, corpus.fingerprint,
                                          params["tokenizer_vocab_size"])
    if not path.is_file():
        raise ConfigError("tokenizer", f"the run's local tokenizer is not at {path} (another "
                          "cache_dir, or its corpus changed)", "pass --tokenizer FILE.model")
    return str(path)


def export_run(run_dir: str | Path, fmt: str, out_dir: str | Path, *,
               dtype: str | None = None, tokenizer: str | None = None,
               base_model: str | None = None,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Export a finished run in ``fmt`` (``FORMATS``).

    A LoRA run saved its merged weights in ``params/`` (exported by hf and gemma) and its
    adapters alone in ``adapters/`` (exported by peft). ``dtype``: hf default bfloat16, peft
    float32, gemma the run's own.
    """
    from gemmalab import checkpoints, models

    if fmt not in FORMATS:
        raise ConfigError("format", f"unknown format {fmt!r}", f"use one of {list(FORMATS)}")
    run = Path(run_dir)
    summary = _read_summary(run)
    model_config = models.config_from_dict(summary["model_config"])
    if fmt == "peft":
        settings = summary["params"]
        if not (run / "adapters").is_dir():
            raise ConfigError("format", f"run {run_dir} has no LoRA adapters (adapters/)",
                              "export it as hf or gemma, or pick a run with lora_rank > 0")
        rank = settings["lora_rank"]
        token_ids = tuple(summary.get("lora_token_ids") or ())
        token_rows = None
        if token_ids:  # the trained rows' values: those of the merged embedding
            embedding = checkpoints.load_params(str(run / "params"))["embedder"]
            token_rows = np.asarray(embedding["input_embedding"])[list(token_ids)]
        return export_peft(checkpoints.load_params(str(run / "adapters")), model_config, out_dir,
                           rank=rank, alpha=settings.get("lora_alpha") or rank,
                           base_model_name_or_path=base_model or settings.get("checkpoint", ""),
                           dtype=dtype or "float32", token_ids=token_ids,
                           token_rows=token_rows)
    params = checkpoints.load_params(str(run / "params"))
    if fmt == "gemma":
        if dtype is not None:
            _require_dtype(dtype)
            params = _cast(params, dtype)
        return [save_gemma_params(params, out_dir)]
    return export_hf(params, model_config, tokenizer or run_tokenizer(summary), out_dir,
                     dtype=dtype or "bfloat16", max_shard_bytes=max_shard_bytes)


def run_is_lora(run_dir: str | Path) -> bool:
    """Whether a finished run trained LoRA adapters (and so has a peft export)."""
    return bool(_read_summary(Path(run_dir))["params"].get("lora_rank"))


def hf_round_trip(run_dir: str | Path, hf_dir: str | Path) -> dict[str, Any]:
    """The HF export read back into gemma's layout against the run's own params: how many
    tensors, and the largest absolute difference (0 for a float32 export; bf16 rounding
    otherwise)."""
    import jax

    from gemmalab import checkpoints

    params = checkpoints.load_params(str(Path(run_dir) / "params"))
    expected = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, np.float32), params)
    loaded = load_hf_params(hf_dir, expected)
    differences = [float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
                   for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True)]
    dtype = json.loads((Path(hf_dir) / "config.json").read_text()).get("torch_dtype")
    return {"weights": len(differences), "export dtype": dtype,
            "max abs difference": max(differences),
            "largest weight": max(float(np.max(np.abs(np.asarray(w)))) for w in
                                  jax.tree.leaves(params))}


def written_files(out_dir: str | Path) -> list[dict[str, Any]]:
    """One row per export directory under ``out_dir``: its top-level entries and total MB (not a
    file count: Orbax's varies from one save of the same tree to the next)."""
    rows = []
    for directory in sorted(p for p in Path(out_dir).iterdir() if p.is_dir()):
        files = [p for p in directory.rglob("*") if p.is_file()]
        rows.append({"export": directory.name,
                     "top level": ", ".join(sorted(p.name for p in directory.iterdir())),
                     "MB": round(sum(p.stat().st_size for p in files) / 1e6, 1)})
    return rows


def _cast(params: dict, dtype: str) -> dict:
    import jax

    return jax.tree.map(lambda w: w.astype(dtype), params)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gemmalab.export",
                                description="Export a finished run: Hugging Face Gemma3ForCausalLM "
                                "(hf), gemma's Orbax params (gemma) or PEFT LoRA adapters (peft).")
    p.add_argument("--run", required=True, help="the run's output_dir")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="a new (or empty) directory")
    p.add_argument("--dtype", choices=list(EXPORT_DTYPES),
                   help="hf: bfloat16 (default); peft: float32; gemma: the run's own")
    p.add_argument("--tokenizer", help="hf: the SentencePiece .model (default: the run's)")
    p.add_argument("--base-model", help="peft: base_model_name_or_path (default: the run's "
                   "checkpoint)")
    p.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES,
                   help="hf: split model.safetensors into shards of at most this size")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        written = export_run(args.run, args.format, args.out, dtype=args.dtype,
                             tokenizer=args.tokenizer, base_model=args.base_model,
                             max_shard_bytes=args.max_shard_bytes)
    except ConfigError as error:
        print(f"ConfigError: {error}", file=sys.stderr)
        return 2
    print(f"{args.format} export of {args.run} in {args.out}: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
