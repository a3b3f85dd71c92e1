"""A finished run's weights as one llama.cpp GGUF file (``general.architecture = gemma3``).

What ``gguf`` and ``gguf_vocab`` undo on import, done again: llama.cpp's tensor names (the
reader's table, reversed), ggml's axis order (numpy's, as Hugging Face's ``[out, in]`` already
is), every RMSNorm weight stored plus one, the vocabulary typed and spelled as llama.cpp's
converter does. The metadata is what llama.cpp's gemma3 loader reads (src/models/gemma3.cpp and
the loader's common keys): context, embedding and feed-forward lengths, block count, heads and
kv heads, key/value length, RMS epsilon, the global and sliding RoPE bases (and a linear
scaling factor), the sliding window and its period, a final logit soft-cap when the model has
one, and the tokenizer (``llama``, i.e. SentencePiece); a chat run's also carries Gemma's chat
template.

Types (``TYPES``): ``bf16``, ``f16``, ``f32`` and ``q8_0`` are written by the ``gguf`` package's
own writer and quantizers; as llama.cpp's converter does, 1-D tensors and norms stay F32 and a
tensor whose rows are not whole blocks of the type falls back to F16. ``q4_k_m`` needs
llama.cpp's own ``llama-quantize`` (its mix of K-quants per tensor is not in the ``gguf``
package): refused, with that fix.

Every check runs before any byte is written: the type, an architecture llama.cpp's gemma3 has
(Gemma 4 is refused), the tokenizer against the embedding, an existing file (unless ``force``),
the free space against the file's computed size. The file is written beside its destination
and renamed into place, so a failure leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gemmalab.errors import ConfigError
from gemmalab.model import gemma4
from gemmalab.weights import gguf as gguf_reader
from gemmalab.weights import gguf_vocab, hf_layout

TYPES = ("bf16", "f16", "f32", "q8_0", "q4_k_m")
WRITTEN_TYPES = ("bf16", "f16", "f32", "q8_0")  # by the gguf package; q4_k_m needs llama.cpp
Q4_K_M_FIX = ("export bf16, then run llama.cpp's quantizer: `llama-quantize FILE-bf16.gguf "
              "FILE-q4_k_m.gguf Q4_K_M` (node-llama-cpp's prebuilt binaries ship no quantizer)")
RMS_NORM_EPS = 1e-6  # fixed in gemma's RMSNorm (hf_layout's config says the same)
# Rows of a tensor converted at a time: the float32 temporaries stay ~16 MB whatever its size.
CHUNK_VALUES = 1 << 22
# The header besides the vocabulary (the metadata, ~2.5 kB of tensor entries per layer): a
# generous bound, so the free-space check never passes a disk the file then overflows.
HEADER_SLACK_BYTES = 1 << 20


def _ggml_types() -> dict[str, Any]:
    from gguf import GGMLQuantizationType as Q

    return {"bf16": Q.BF16, "f16": Q.F16, "f32": Q.F32, "q8_0": Q.Q8_0}


def _file_types() -> dict[str, Any]:
    from gguf import LlamaFileType as F

    return {"bf16": F.MOSTLY_BF16, "f16": F.MOSTLY_F16, "f32": F.ALL_F32, "q8_0": F.MOSTLY_Q8_0}


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the file: llama.cpp's name, numpy's shape, its ggml type and bytes, and
    how to make its float32 values (norms already plus one)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: Any  # gguf.GGMLQuantizationType
    values: Callable[[], np.ndarray]

    @property
    def n_bytes(self) -> int:
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape)) // block * size


def require_type(gguf_type: str) -> None:
    if gguf_type not in TYPES:
        raise ConfigError("type", f"unknown GGUF type {gguf_type!r}", f"use one of {list(TYPES)}")
    if gguf_type not in WRITTEN_TYPES:
        raise ConfigError("type", f"{gguf_type} needs llama.cpp's own quantizer", Q4_K_M_FIX)


def require_llamacpp_architecture(model_config: Any) -> None:
    """One line naming ``model`` unless llama.cpp's gemma3 architecture computes this model."""
    if gemma4.is_gemma4(model_config):
        raise ConfigError("model", "a Gemma 4 run: the GGUF export writes llama.cpp's gemma3 "
                          "architecture only", "export it as hf (transformers, vLLM) instead")
    hf_layout._require_gemma3_blocks(model_config)  # QK-norm and both post-norms: gemma3's graph
    if model_config.attn_logits_soft_cap is not None:
        raise ConfigError("model", "attention logit soft-capping has no place in llama.cpp's "
                          "gemma3", "export it as hf instead")
    if model_config.local_scale_factor != 1.0:  # llama.cpp's SWA layers are never scaled
        raise ConfigError("model", "RoPE scaling of the local layers has no place in llama.cpp's "
                          "gemma3", "export it as hf instead")
    _sliding_window_period(model_config)
    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 62-layer (27B) model, where
    # it uses 1/sqrt(embed_dim / num_heads); the model's own normalisation must agree.
    theirs = (model_config.embed_dim // model_config.num_heads if model_config.num_layers == 62
              else model_config.head_dim)
    if hf_layout._query_pre_attn_scalar(model_config) != theirs:
        raise ConfigError("model", "its query scaling is not the one llama.cpp's gemma3 applies "
                          f"for {model_config.num_layers} layers", "export it as hf instead")


def _sliding_window_period(model_config: Any) -> int:
    """llama.cpp's ``sliding_window_pattern``: every ``period``-th layer global, the others
    local (Gemma 3: 6); a model whose layers follow no such period has no gemma3 GGUF."""
    layer_types = hf_layout._layer_types(model_config)
    period = hf_layout._sliding_window_pattern(layer_types)
    if period is None:
        raise ConfigError("model", "its global and local layers do not repeat with a period, "
                          "which llama.cpp's gemma3 needs", "export it as hf instead")
    return period


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face Gemma3ForCausalLM tensor: ``gguf``'s table, reversed."""
    stem, _, suffix = hf_name.rpartition(".")
    for gguf_stem, hf_stem in gguf_reader.TOP_NAMES.items():
        if stem == hf_stem:
            return f"{gguf_stem}.{suffix}"
    layer, _, kind = stem.removeprefix("model.layers.").partition(".")
    for gguf_kind, hf_kind in gguf_reader.BLOCK_NAMES.items():
        if stem.startswith("model.layers.") and layer.isdigit() and kind == hf_kind:
            return f"blk.{layer}.{gguf_kind}.{suffix}"
    raise ValueError(f"{hf_name} has no llama.cpp gemma3 name")


def tensor_type(name: str, shape: tuple[int, ...], gguf_type: str) -> Any:
    """The ggml type of one tensor in a file of ``gguf_type``, by llama.cpp's converter's rules:
    1-D tensors and norms F32 (llama.cpp's kernels for them take F32 only); a tensor whose rows
    are not whole blocks of the type F16."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if len(shape) <= 1 or gguf_reader.is_norm_name(name):
        return GGMLQuantizationType.F32
    ggml_type = _ggml_types()[gguf_type]
    if shape[-1] % GGML_QUANT_SIZES[ggml_type][0]:
        return GGMLQuantizationType.F16
    return ggml_type


def plan_tensors(params: dict, model_config: Any, gguf_type: str, vocab_size: int
                 ) -> list[PlannedTensor]:
    """The file's tensors, from the params' Hugging Face tensors (``hf_layout.hf_tensors``, in
    float32, converted lazily). The embedding keeps the tokenizer's rows only (as llama.cpp's
    converter cuts the out-of-vocabulary ones): llama.cpp takes its vocabulary size from the
    token list. Its output head is the embedding, tied, so none is written."""
    planned = []
    for tensor in hf_layout.hf_tensors(params, model_config, "float32"):
        name = gguf_name(tensor.name)
        shape = tuple(tensor.shape)
        rows = None
        if name == "token_embd.weight":
            shape, rows = (vocab_size, *shape[1:]), vocab_size
        planned.append(PlannedTensor(name, shape, tensor_type(name, shape, gguf_type),
                                     _values(tensor.values, rows, gguf_reader.is_norm_name(name))))
    return planned


def _values(load: Callable[[], np.ndarray], rows: int | None, norm: bool
            ) -> Callable[[], np.ndarray]:
    def values() -> np.ndarray:
        array = load()[:rows]
        return array + np.float32(1.0) if norm else array

    return values


def _encoded(tensor: PlannedTensor) -> np.ndarray:
    """The tensor's bytes in its ggml type, converted a block of rows at a time."""
    from gguf import quants

    values = tensor.values()
    rows = values.reshape(-1, values.shape[-1]) if values.ndim > 1 else values[None]
    out = np.empty(tensor.n_bytes, np.uint8)
    row_bytes = tensor.n_bytes // len(rows)
    step = max(1, CHUNK_VALUES // rows.shape[-1])
    for start in range(0, len(rows), step):
        chunk = np.ascontiguousarray(rows[start:start + step], np.float32)
        encoded = quants.quantize(chunk, tensor.ggml_type)
        out[start * row_bytes:(start + len(chunk)) * row_bytes] = \
            np.ascontiguousarray(encoded).view(np.uint8).reshape(-1)
    return out


def file_size_bound(planned: list[PlannedTensor], vocabulary: gguf_vocab.GGUFVocabulary,
                    chat_template: str | None, alignment: int = gguf_reader.DEFAULT_ALIGNMENT
                    ) -> int:
    """An upper bound of the file's size: the tensors' bytes, each padded to the alignment, the
    vocabulary's strings (8-byte lengths), scores and types, and a slack for the rest."""
    tensors = sum(-(-t.n_bytes // alignment) * alignment for t in planned)
    strings = sum(len(token.encode("utf-8")) + 8 for token in vocabulary.tokens)
    return (tensors + strings + 8 * len(vocabulary.tokens) + len(chat_template or "")
            + HEADER_SLACK_BYTES)


def require_new_file(path: Path, force: bool) -> None:
    if path.exists() and not force:
        raise ConfigError("out", f"{path} exists", "choose another path, or pass --force "
                          "(force=True) to replace it")
    if path.exists() and not path.is_file():
        raise ConfigError("out", f"{path} exists and is not a file", "choose another path")


def require_free_space(path: Path, needed: int) -> None:
    """One line naming ``out`` when the disk holding ``path`` has less than ``needed`` bytes."""
    directory = path.parent
    while not directory.exists():  # the directories to create: the disk they would be on
        directory = directory.parent
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise ConfigError("out", f"the GGUF needs {needed / 1e6:,.1f} MB but {directory} has "
                          f"{free / 1e6:,.1f} MB free", "free some space, or write it to another "
                          "disk")


def _add_model_metadata(writer: Any, model_config: Any, gguf_type: str, name: str) -> None:
    from gguf import GGML_QUANT_VERSION, GGUFType

    arch = gguf_reader.ARCHITECTURE
    writer.add_type(GGUFType.MODEL)
    if name:
        writer.add_name(name)
    writer.add_file_type(_file_types()[gguf_type])
    writer.add_quantization_version(GGML_QUANT_VERSION)
    # The shape keys the import reads (gguf.SHAPE_KEYS), written from the same table.
    for key, field in gguf_reader.SHAPE_KEYS.items():
        writer.add_uint32(f"{arch}.{key}", int(getattr(model_config, field)))
    writer.add_uint32(f"{arch}.attention.value_length", model_config.head_dim)
    writer.add_sliding_window_pattern(_sliding_window_period(model_config))
    hf = hf_layout.hf_config(model_config)
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
    writer.add_rope_freq_base(float(model_config.global_base_frequency))
    writer.add_rope_freq_base_swa(float(model_config.local_base_frequency))
    # llama.cpp applies the scaling to the global layers only (its SWA scale stays 1), as
    # Gemma 3 does: its local layers are never scaled.
    if model_config.global_scale_factor != 1.0:
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(model_config.global_scale_factor))
    if model_config.final_logit_softcap is not None:
        writer.add_final_logit_softcapping(float(model_config.final_logit_softcap))


def _add_vocabulary(writer: Any, vocabulary: gguf_vocab.GGUFVocabulary,
                    chat_template: str | None) -> None:
    writer.add_tokenizer_model("llama")  # llama.cpp's SentencePiece tokenizer
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_scores(vocabulary.scores.tolist())
    writer.add_token_types(vocabulary.token_types.tolist())
    ids = vocabulary.special_ids
    for role, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if role in ids:
            add(ids[role])
    writer.add_add_bos_token(True)  # gemmalab trains and samples every document after <bos>
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(vocabulary.add_space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
        if vocabulary.end_of_turn is not None:  # a chat reply stops there
            writer.add_eot_token_id(vocabulary.end_of_turn)


def export_gguf(params: dict, model_config: Any, tokenizer: str | Path | bytes,
                path: str | Path, *, gguf_type: str = "bf16", chat: bool = False,
                name: str = "", force: bool = False,
                timings: dict[str, float] | None = None) -> Path:
    """Write ``params`` (a LoRA run's: merged) as the GGUF file ``path``; returns it.

    ``tokenizer``: the run's SentencePiece model (a path or its bytes); ``chat``: the run
    trained on chat data, so the file carries Gemma's chat template. ``timings``, when given,
    receives ``seconds`` and ``bytes`` of the write.
    """
    require_type(gguf_type)
    require_llamacpp_architecture(model_config)
    hf_layout.require_plain_params(params)
    proto = hf_layout._read_vocabulary(tokenizer).proto
    vocabulary = gguf_vocab.gguf_vocabulary(proto)
    if len(vocabulary.tokens) > model_config.num_embed:
        raise ConfigError("tokenizer", f"{len(vocabulary.tokens)} pieces but the model embeds "
                          f"{model_config.num_embed} tokens", "give the run's own tokenizer")
    chat_template = hf_layout.CHAT_TEMPLATE if chat else None
    path = Path(path)
    require_new_file(path, force)
    planned = plan_tensors(params, model_config, gguf_type, len(vocabulary.tokens))
    require_free_space(path, file_size_bound(planned, vocabulary, chat_template))
    started = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        _write(partial, planned, model_config, vocabulary, chat_template, gguf_type, name)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if timings is not None:
        timings.update(seconds=time.perf_counter() - started, bytes=path.stat().st_size)
    return path


def _write(partial: Path, planned: list[PlannedTensor], model_config: Any,
           vocabulary: gguf_vocab.GGUFVocabulary, chat_template: str | None, gguf_type: str,
           name: str) -> None:
    """The header through ``gguf.GGUFWriter``, then each tensor's bytes as it is converted (one
    tensor in memory at a time, not the whole model)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(partial, gguf_reader.ARCHITECTURE)
    try:
        _add_model_metadata(writer, model_config, gguf_type, name)
        _add_vocabulary(writer, vocabulary, chat_template)
        for tensor in planned:
            writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(np.float32),
                                   tensor.n_bytes, raw_dtype=tensor.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in planned:
            writer.write_tensor_data(_encoded(tensor))
    finally:
        writer.close()
