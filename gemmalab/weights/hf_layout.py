"""Hugging Face Gemma weights: gemma's params <-> HF ``Gemma3ForCausalLM`` and
``Gemma4ForCausalLM`` safetensors.

- ``export_hf``: a Hugging Face directory (``config.json``, safetensors, sharded past a size,
  tokenizer files, ``generation_config.json``);
- ``load_hf_params``: an HF Gemma 3 or Gemma 4 directory as a gemma params tree (a run's
  ``checkpoint``);
- ``hf_family``: which of the two a directory holds, read from its ``config.json``, so a
  mismatch with the run's model is refused before any weight is read (``require_hf_family``).

Gemma 4's own layout is ``hf_gemma4``; this module dispatches to it on the config's (export)
or the params tree's (import) family.

The two layouts, as transformers' Gemma 3 modeling code and its converter from gemma's
checkpoints define them: HF ``Linear`` weights are ``[out, in]`` and a projection's heads are
flattened head-major (``n * head_dim + h``); both libraries' RMSNorm compute ``x * (1 + w)``, so
norm scales copy as they are; both multiply the embedding by ``sqrt(hidden)`` at the input and
reuse it, tied, as the output head (HF saves no ``lm_head.weight``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gemmalab.errors import ConfigError
from gemmalab.model import gemma4
from gemmalab.weights import hf_gemma4, safetensors_io
from gemmalab.weights.hf_shapes import config_constants
from gemmalab.weights.hf_shapes import flatten as _flatten
from gemmalab.weights.hf_shapes import heads_in_to_linear as _heads_in_to_linear
from gemmalab.weights.hf_shapes import layer_names as _layer_names
from gemmalab.weights.hf_shapes import linear_to_heads_in as _linear_to_heads_in

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


def hf_tensors(params: dict, model_config: Any, dtype: str = "bfloat16"
               ) -> list[safetensors_io.Tensor]:
    """The ``Gemma3ForCausalLM`` (``Gemma4ForCausalLM``) tensors of a gemma params tree, in
    ``dtype``, converted lazily."""
    import jax

    out_dtype = safetensors_io.DTYPES[EXPORT_DTYPES[dtype]]

    def tensor(name: str, leaf: Any, convert: Callable[[Any], Any]) -> safetensors_io.Tensor:
        shape = jax.eval_shape(convert, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)).shape
        return safetensors_io.Tensor(
            name, tuple(shape), out_dtype,
            lambda: np.asarray(convert(np.asarray(leaf, np.float32))).astype(out_dtype))

    if gemma4.is_gemma4(model_config):
        return hf_gemma4.export_tensors(
            params, model_config,
            lambda name, leaf, convert: tensor(f"model.{name}", leaf, convert))
    rules = _block_rules(model_config.transpose_gating_einsum)
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
    raise KeyError("no Gemma text model in the checkpoint (no ...embed_tokens.weight)")


def _is_gemma4_tree(params: Any) -> bool:
    """Gemma 4's blocks scale their output (``skip_scale``); Gemma 3's do not."""
    layers = _layer_names(params)
    return bool(layers) and "skip_scale" in params[layers[0]]


def hf_to_gemma(tensors: dict[str, np.ndarray], expected: Any,
                finish: Callable[[np.ndarray, Any], Any] | None = None, *,
                kv_shared_layers: int = 0) -> dict:
    """A gemma params tree shaped like ``expected`` (any tree of arrays or shape structs) from
    HF ``Gemma3ForCausalLM`` or ``Gemma4ForCausalLM`` tensors (the family is ``expected``'s);
    ``finish(value, expected leaf)`` makes each leaf (default: the numpy array).
    ``kv_shared_layers``: Gemma 4's ``num_kv_shared_layers`` (config.json), the last layers that
    saved no keys and values of their own. Raises KeyError for a missing tensor, ValueError for a
    shape that does not fit."""
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
    if _is_gemma4_tree(expected):
        hf_gemma4.import_params(
            lambda name: tensors[f"{prefix}{name}"], lambda name: f"{prefix}{name}" in tensors,
            lambda path, value, leaf: put(params, path, value, leaf), expected,
            kv_shared_layers)
        _require_complete(expected, params)
        return params
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
    _require_complete(expected, params)
    return params


def _require_complete(expected: Any, params: dict) -> None:
    missing = set(_flatten(expected)) - set(_flatten(params))
    if missing:
        raise KeyError(f"no Hugging Face counterpart for {sorted(missing)[:4]}")


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


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
    """``config.json`` of ``Gemma3ForCausalLM`` for a gemma ``TransformerConfig`` (Gemma 4's:
    ``hf_gemma4.hf_config``).

    Written for transformers 5 (``rope_parameters``, ``dtype``) and, with the older keys beside
    them (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``, ``torch_dtype``), for 4.x.
    """
    if gemma4.is_gemma4(model_config):
        return hf_gemma4.hf_config(model_config, dtype=dtype, bos_id=bos_id, eos_id=eos_id,
                                   pad_id=pad_id)
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
        "use_bidirectional_attention": False,
        **config_constants(bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, dtype=dtype),
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
    chat_template: str | None  # the turns' template, from the pieces the vocabulary holds


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
    # The template follows the turn pieces the run's tokenizer has (what its chat data was
    # encoded with): Gemma 4's <|turn>/<turn|>, else Gemma 3's <start_of_turn>/<end_of_turn>.
    for end, template in ((hf_gemma4.END_OF_TURN, hf_gemma4.CHAT_TEMPLATE),
                          ("<end_of_turn>", CHAT_TEMPLATE)):
        end_of_turn = processor.PieceToId(end)
        if end_of_turn != processor.unk_id():
            return _Vocabulary(proto, processor.GetPieceSize(), special, ids, end_of_turn,
                               template)
    return _Vocabulary(proto, processor.GetPieceSize(), special, ids, None, None)


def _tokenizer_files(vocabulary: _Vocabulary, max_length: int) -> dict[str, Any]:
    has_turns = vocabulary.end_of_turn is not None
    config = {"tokenizer_class": "GemmaTokenizer", **vocabulary.special,
              "add_bos_token": True, "add_eos_token": False, "model_max_length": max_length,
              "padding_side": "left", "clean_up_tokenization_spaces": False,
              "spaces_between_special_tokens": False}
    if has_turns:
        config["chat_template"] = vocabulary.chat_template
    eos = vocabulary.ids["eos_token"]
    return {
        "tokenizer_config.json": config,
        "special_tokens_map.json": dict(vocabulary.special),
        "generation_config.json": {
            "bos_token_id": vocabulary.ids["bos_token"],
            "pad_token_id": vocabulary.ids["pad_token"],
            "eos_token_id": [eos, vocabulary.end_of_turn] if has_turns else eos},
    }


def require_new_dir(out_dir: str | Path, parameter: str = "out_dir") -> Path:
    path = Path(out_dir)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(parameter, f"{out_dir} exists and is not empty",
                          "choose a new directory, or remove this one first")
    path.mkdir(parents=True, exist_ok=True)
    return path


def require_dtype(dtype: str) -> None:
    if dtype not in EXPORT_DTYPES:
        raise ConfigError("dtype", f"unknown dtype {dtype!r}", f"use one of {list(EXPORT_DTYPES)}")


def require_plain_params(params: dict) -> None:
    if any("lora" in path or any(k.startswith("_LoRA") for k in path)
           for path in _flatten(params)):
        raise ConfigError("params", "the tree holds LoRA adapters",
                          "merge them first (gemmalab.model.lora.merge), or export them with "
                          "export_peft")


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def export_hf(params: dict, model_config: Any, tokenizer: str | Path | bytes,
              out_dir: str | Path, *, dtype: str = "bfloat16",
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write a ``Gemma3ForCausalLM`` directory that ``from_pretrained`` loads.

    ``params``: a gemma params tree (LoRA runs: merged first); ``tokenizer``: the SentencePiece
    model (a path or its bytes). Returns the files written.
    """
    require_dtype(dtype)
    if max_shard_bytes <= 0:
        raise ConfigError("max_shard_bytes", f"{max_shard_bytes} is not positive",
                          "give a size in bytes, e.g. 5_000_000_000")
    require_plain_params(params)
    vocabulary = _read_vocabulary(tokenizer)
    if vocabulary.size > model_config.num_embed:
        raise ConfigError("tokenizer", f"{vocabulary.size} pieces but the model embeds "
                          f"{model_config.num_embed} tokens", "give the run's own tokenizer")
    config = hf_config(model_config, dtype=dtype, bos_id=vocabulary.ids["bos_token"],
                       eos_id=vocabulary.ids["eos_token"], pad_id=vocabulary.ids["pad_token"])
    tensors = hf_tensors(params, model_config, dtype)  # conversion errors before any write
    out = require_new_dir(out_dir)
    written = safetensors_io.write_sharded(out, tensors, max_shard_bytes)
    write_json(out / "config.json", config)
    (out / "tokenizer.model").write_bytes(vocabulary.proto)
    for name, value in _tokenizer_files(vocabulary, config["max_position_embeddings"]).items():
        write_json(out / name, value)
    return sorted([*written, "config.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json"])


def load_hf_params(hf_dir: str | Path, expected_abstract_params: Any) -> dict:
    """A gemma params tree from an HF Gemma 3 or Gemma 4 safetensors directory
    (``model.safetensors`` or shards with their index), shaped and typed like
    ``expected_abstract_params``.

    Leaves that carry a ``sharding`` are read straight into it (each device's part only).
    Raises KeyError / ValueError when the checkpoint does not fit the expected tree.
    """
    directory = Path(hf_dir)
    if not safetensors_io.model_files(directory):
        raise ConfigError("checkpoint", f"no safetensors files in {hf_dir}",
                          "give a Hugging Face Gemma directory (config.json + *.safetensors)")
    text = _text_config(_read_config(directory) or {})
    return hf_to_gemma(safetensors_io.read_directory(directory), expected_abstract_params,
                       finish=_place, kv_shared_layers=int(text.get("num_kv_shared_layers") or 0))


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


# config.json's model_type (the text model's, or the multimodal wrapper's) -> gemma's family.
_FAMILIES = {"gemma3_text": "gemma3", "gemma3": "gemma3",
             "gemma4_text": "gemma4", "gemma4": "gemma4"}


def _read_config(directory: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's settings: the Hub's multimodal configs nest them in ``text_config``."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _model_type(config: dict[str, Any]) -> str | None:
    return _text_config(config).get("model_type") or config.get("model_type")


def hf_family(path: str | Path) -> str | None:
    """``"gemma3"`` or ``"gemma4"``: the family of the model an HF directory holds, from its
    ``config.json`` alone; None when that names neither (or cannot be read)."""
    config = _read_config(Path(path))
    return None if config is None else _FAMILIES.get(_model_type(config) or "")


def require_hf_family(path: str | Path, preset_name: str) -> None:
    """Refuse, in one line naming ``checkpoint``, an HF directory whose model is not of the
    preset's family (a Gemma 3 checkpoint for a Gemma 4 model, or the reverse), before any
    weight is read."""
    from gemmalab.model import presets

    wanted = presets.PRESETS[preset_name].family
    found = hf_family(path)
    if found == wanted:
        return
    config = _read_config(Path(path))
    holds = ("no readable config.json" if config is None else
             f"a {_FAMILY_NAMES[found]} model" if found else "no Gemma 3 or Gemma 4 text model")
    problem = (f"{path} holds {holds}" + ("" if config is None else
               f" (config.json model_type {_model_type(config)!r})") +
               f", but model {preset_name!r} is {_FAMILY_NAMES[wanted]}")
    fits = [n for n, p in presets.PRESETS.items() if p.family == found and not p.tiny]
    fix = f"give a Hugging Face {_FAMILY_NAMES[wanted]} directory"
    if found:
        fix += f", or a {_FAMILY_NAMES[found]} model for this one ({', '.join(fits)})"
    raise ConfigError("checkpoint", problem, fix)


_FAMILY_NAMES = {"gemma3": "Gemma 3", "gemma4": "Gemma 4"}


def unexported_paths(model_config: Any) -> set[tuple[str, ...]]:
    """The params HF's layout has no place for (their import fills them; see ``hf_gemma4``):
    Gemma 4's KV-sharing layers' own keys and values, unused by gemma; none in Gemma 3."""
    if not gemma4.is_gemma4(model_config):
        return set()
    return hf_gemma4.unexported_paths(model_config)
