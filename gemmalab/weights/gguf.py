"""llama.cpp GGUF files as a base to fine-tune: checked, dequantized once, cached, read in shards.

A Gemma 3 GGUF (``general.architecture = gemma3``) holds the text model's weights under
llama.cpp's names, in ggml's axis order (the reverse of Hugging Face's ``[out, in]``), quantized
per tensor, with every RMSNorm weight stored plus one (llama.cpp's converter adds the 1 that
Gemma's ``x * (1 + w)`` adds at run time). ``convert`` undoes all three into a Hugging Face
Gemma 3 safetensors file in ``cache_dir`` (keyed by the GGUF's sha256 and the dtype), in
parallel over blocks of rows of every tensor, each block written straight to its place in the
file; the run then reads that file like any HF checkpoint, each device's part straight into its
shard (``hf_layout.load_hf_params``). A second run skips the conversion.

Everything that can be wrong with the file is found by ``inspect`` before any conversion:
another architecture, a vision projector (``mmproj``), a truncated file, a quant type that
``gguf.quants`` cannot dequantize, a model that is not ``model``.

``read_header`` is the one GGUF header reader of the package, for the weights here and the
vocabulary (``gguf_vocab``): a straight walk of the key/value fields and tensor entries, cached
per file, with each tensor's data a view of one memory map of the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import mmap
import os
import struct
import threading
import time
import types
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gemmalab import storage
from gemmalab.errors import ConfigError
from gemmalab.weights import safetensors_io

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

ARCHITECTURE = "gemma3"
# The quant types dequantized (gguf.quants does the arithmetic, in numpy).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                   "Q4_K", "Q5_K", "Q6_K")
CACHE_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
_FIX = "give a Gemma 3 text model's .gguf file (llama.cpp's gemma3 architecture)"

# llama.cpp's tensor names -> Hugging Face Gemma3ForCausalLM's (in a block: model.layers.N.*).
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
# The model's shape as the GGUF states it, against gemma's TransformerConfig fields.
SHAPE_KEYS = {
    "block_count": "num_layers", "embedding_length": "embed_dim",
    "feed_forward_length": "hidden_dim", "attention.head_count": "num_heads",
    "attention.head_count_kv": "num_kv_heads", "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window_size",
}


def is_norm_name(name: str) -> bool:
    """A Gemma RMSNorm weight under llama.cpp's name: stored as ``1 + w`` (its converter adds the
    1 that Gemma's ``x * (1 + w)`` adds at run time; the export adds it again)."""
    return name.endswith("norm.weight")


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str  # llama.cpp's
    hf_name: str
    shape: tuple[int, ...]  # Hugging Face's axis order
    quant_type: str
    data: Any  # the raw (quantized) bytes, mapped from the file

    @property
    def is_norm(self) -> bool:
        return is_norm_name(self.name)


@dataclasses.dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file holds, checked to be a Gemma 3 text model gemmalab can read."""

    path: Path
    metadata: dict[str, Any]  # the architecture's own keys, without the "gemma3." prefix
    tensors: tuple[GGUFTensor, ...]
    vocab_size: int  # rows of the token embedding

    @property
    def quant_types(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for tensor in self.tensors:
            counts[tensor.quant_type] = counts.get(tensor.quant_type, 0) + 1
        return dict(sorted(counts.items()))

    def shape_fields(self) -> dict[str, int]:
        """gemma ``TransformerConfig`` fields as the file states them."""
        fields = {field: int(self.metadata[key]) for key, field in SHAPE_KEYS.items()
                  if key in self.metadata}
        return {**fields, "num_embed": self.vocab_size}


def is_gguf(path: str | os.PathLike) -> bool:
    """A file that starts with GGUF's magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# The header, parsed once per file.
#
# gguf's own GGUFReader builds a numpy view for each of the ~790,000 parts of a vocabulary's
# arrays (14 s for gemma-3-270m); the header is a few megabytes that one straight walk reads in a
# fraction of a second, and the tensors are then views of one memory map of the file.

GGML_MAX_DIMS = 4  # ggml.h: llama.cpp refuses a tensor of more
DEFAULT_ALIGNMENT = 32  # of the data section and each tensor in it, unless the file says
ALIGNMENT_KEY = "general.alignment"  # a uint32 power of two (GGUF spec, llama.cpp's gguf.cpp)
SUPPORTED_VERSIONS = (2, 3)  # v1 had 32-bit counts; v3 only adds big-endian files

# GGUFValueType names -> struct/numpy formats of the fixed-width values.
_SCALAR_FORMATS = {"UINT8": "B", "INT8": "b", "UINT16": "H", "INT16": "h", "UINT32": "I",
                   "INT32": "i", "FLOAT32": "f", "BOOL": "?", "UINT64": "Q", "INT64": "q",
                   "FLOAT64": "d"}
# The ggml types GGUFReader maps as numbers (in the file's byte order); the rest are raw bytes.
_NUMBER_FORMATS = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4",
                   "I64": "i8"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the header."""

    name: str
    dims: tuple[int, ...]  # ggml's order: dims[0] varies fastest (numpy's last axis)
    ggml_type: GGMLQuantizationType
    offset: int  # from the start of the data section

    @property
    def n_dims(self) -> int:
        return len(self.dims)

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def n_bytes(self) -> int:
        from gguf import GGML_QUANT_SIZES

        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return self.n_elements // block_size * type_size

    @property
    def array_shape(self) -> tuple[int, ...]:
        """The data's numpy shape, as GGUFReader's: dims reversed, quantized rows as bytes."""
        from gguf.quants import quant_shape_to_byte_shape

        shape = tuple(reversed(self.dims))
        if self.ggml_type.name in _NUMBER_FORMATS:
            return shape
        return quant_shape_to_byte_shape(shape, self.ggml_type)


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFHeader:
    """A GGUF file's header: its key/value fields, its tensors' entries, where their data is.

    Shared by every caller (``read_header`` caches it), so read-only: ``fields`` is a mapping
    proxy, arrays of numbers are read-only numpy arrays and arrays of strings are tuples.
    """

    path: Path
    version: int
    byte_order: str  # "<" or ">", as struct and numpy spell it
    fields: Mapping[str, Any]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_start: int  # where the data section starts in the file, aligned
    file_size: int
    buffer: Any = dataclasses.field(repr=False)  # the file's mmap, kept open by the views

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def tensor_end(self, tensor: TensorInfo) -> int:
        """Where the tensor's bytes end in the file; past ``file_size``, the file was cut."""
        return self.data_start + tensor.offset + tensor.n_bytes

    def tensor_data(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's bytes, mapped (not copied), typed and shaped as GGUFReader's
        ``tensor.data``: what ``gguf.quants.dequantize`` takes."""
        number_format = _NUMBER_FORMATS.get(tensor.ggml_type.name)
        dtype = np.dtype(self.byte_order + number_format) if number_format else np.dtype(np.uint8)
        values = np.frombuffer(self.buffer, dtype, tensor.n_bytes // dtype.itemsize,
                               self.data_start + tensor.offset)
        return values.reshape(tensor.array_shape)


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """The header of the GGUF at ``path``, parsed once per version of the file (cached by path,
    size and mtime); one line naming ``checkpoint`` for a file it cannot read."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("checkpoint", f"no GGUF file at {path}", _FIX)
    stat = path.stat()
    try:
        return _cached_header(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    except (OSError, struct.error, ValueError, KeyError, OverflowError) as error:
        reason = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
        raise ConfigError("checkpoint", f"{path} is not a readable GGUF file, or it is truncated "
                          f"({reason})", _FIX + "; copy or download it again") from None


@functools.lru_cache(maxsize=4)
def _cached_header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    with open(path, "rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # ValueError if empty
    try:
        return _HeaderParser(buffer).header(Path(path))
    except BaseException:
        with contextlib.suppress(BufferError):
            buffer.close()
        raise


class _HeaderParser:
    """Walks a GGUF header front to back: magic, version, counts, key/value fields, tensor
    entries. A read past the end raises (struct.error or ValueError), so a cut header does."""

    def __init__(self, buffer: mmap.mmap):
        self.buffer = buffer
        self.offset = 0
        self.order = "<"
        self.kinds: dict[str, str] = {}  # each field's GGUFValueType name

    def header(self, path: Path) -> GGUFHeader:
        version = self.preamble()
        tensor_count, field_count = self.scalar("Q"), self.scalar("Q")
        fields = self.fields(field_count)
        alignment = self.alignment(fields)
        tensors = self.tensor_infos(tensor_count, alignment)
        data_start = -(-self.offset // alignment) * alignment  # rounded up
        return GGUFHeader(path, version, self.order, types.MappingProxyType(fields), tensors,
                          alignment, data_start, len(self.buffer), self.buffer)

    def preamble(self) -> int:
        if self.buffer[:4] != b"GGUF":
            raise ValueError("no GGUF magic number")
        self.offset = 4
        version = self.scalar("I")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self.order = ">"
            version = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version}; versions 2 and 3 are supported")
        return version

    def fields(self, count: int) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for _ in range(count):
            key, kind = self.string(), self.kind()
            if key in fields:
                raise ValueError(f"key {key} appears twice")
            fields[key], self.kinds[key] = self.value(kind), kind
        return fields

    def alignment(self, fields: dict[str, Any]) -> int:
        if ALIGNMENT_KEY not in fields:
            return DEFAULT_ALIGNMENT
        alignment = fields[ALIGNMENT_KEY]
        if self.kinds[ALIGNMENT_KEY] != "UINT32" or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{ALIGNMENT_KEY} {alignment!r} is not a uint32 power of two")
        return alignment

    def tensor_infos(self, count: int, alignment: int) -> tuple[TensorInfo, ...]:
        tensors: dict[str, TensorInfo] = {}
        for _ in range(count):
            tensor = self.tensor_info()
            if tensor.name in tensors:
                raise ValueError(f"tensor {tensor.name} appears twice")
            if tensor.offset % alignment:
                raise ValueError(f"tensor {tensor.name}'s offset is not a multiple of {alignment}")
            tensors[tensor.name] = tensor
        return tuple(tensors.values())

    def tensor_info(self) -> TensorInfo:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        name, n_dims = self.string(), self.scalar("I")
        if n_dims > GGML_MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        dims = tuple(self.scalar("Q") for _ in range(n_dims))
        ggml_type = GGMLQuantizationType(self.scalar("I"))  # ValueError for a type ggml lacks
        block_size, _ = GGML_QUANT_SIZES[ggml_type]
        if dims and dims[0] % block_size:  # a row must be whole blocks (llama.cpp checks too)
            raise ValueError(f"tensor {name}'s rows of {dims[0]} are not whole {ggml_type.name} "
                             f"blocks of {block_size}")
        return TensorInfo(name, dims, ggml_type, self.scalar("Q"))

    def kind(self) -> str:
        from gguf import GGUFValueType

        return GGUFValueType(self.scalar("I")).name  # ValueError for a type GGUF lacks

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("Q")
        end = self.offset + size
        if end > len(self.buffer):
            raise ValueError("the header ends inside a string")
        text = self.buffer[self.offset : end].decode("utf-8")
        self.offset = end
        return text

    def value(self, kind: str) -> Any:
        if kind == "STRING":
            return self.string()
        if kind == "ARRAY":
            return self.array()
        return self.scalar(_SCALAR_FORMATS[kind])

    def array(self) -> Any:
        kind, count = self.kind(), self.scalar("Q")
        if kind in _SCALAR_FORMATS:
            return self.numbers(_SCALAR_FORMATS[kind], count)
        if kind == "STRING":
            return self.strings(count)
        return tuple(self.value(kind) for _ in range(count))

    def numbers(self, fmt: str, count: int) -> np.ndarray:
        dtype = np.dtype(self.order + fmt)
        # A copy, so no field pins the mmap; read-only, as every caller shares it.
        values = np.frombuffer(self.buffer, dtype, count, self.offset).copy()
        values.flags.writeable = False
        self.offset += count * dtype.itemsize
        return values

    def strings(self, count: int) -> tuple[str, ...]:
        # The 262,144 pieces of Gemma's vocabulary go through here: one tight loop, no calls.
        unpack_size = struct.Struct(self.order + "Q").unpack_from
        buffer, offset, texts = self.buffer, self.offset, []
        for _ in range(count):
            (size,) = unpack_size(buffer, offset)
            offset += 8
            texts.append(buffer[offset : offset + size].decode("utf-8"))
            offset += size
        if offset > len(buffer):  # the last string was cut
            raise ValueError("the header ends inside a string array")
        self.offset = offset
        return tuple(texts)


def inspect(path: str | os.PathLike) -> GGUFModel:
    """The file's Gemma 3 text model, or one line naming ``checkpoint`` and the fix."""
    header = read_header(path)
    architecture = header.field("general.architecture", "")
    if header.field("general.type") == "mmproj" or architecture == "clip":
        raise ConfigError("checkpoint", f"{path} is a vision projector (mmproj), not a language "
                          "model", "give the text model's .gguf (the mmproj file only adds "
                          "image input, which gemmalab does not train)")
    if architecture != ARCHITECTURE:
        raise ConfigError("checkpoint", f"{path} holds a {architecture or 'unnamed'} model, "
                          f"not Gemma 3 (general.architecture = {ARCHITECTURE})", _FIX)
    tensors = tuple(_checked_tensor(header, info, path) for info in header.tensors)
    prefix = f"{ARCHITECTURE}."
    metadata = {key.removeprefix(prefix): value for key, value in header.fields.items()
                if key.startswith(prefix)}
    embedding = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ConfigError("checkpoint", f"{path} has no token_embd.weight", _FIX)
    return GGUFModel(Path(path), metadata, tensors, embedding.shape[0])


def _checked_tensor(header: GGUFHeader, info: TensorInfo, path: Any) -> GGUFTensor:
    quant = info.ggml_type.name
    if quant not in SUPPORTED_TYPES:
        raise ConfigError("checkpoint", f"{path}: tensor {info.name} is {quant}, which "
                          "gemmalab cannot dequantize", f"use a GGUF in one of "
                          f"{', '.join(SUPPORTED_TYPES)} (e.g. llama-quantize to Q4_K_M)")
    if header.tensor_end(info) > header.file_size:
        raise ConfigError("checkpoint", f"{path} is truncated: tensor {info.name} ends past "
                          f"the file's {header.file_size:,} bytes", "copy or download it again")
    return GGUFTensor(info.name, _hf_name(info.name, path), tuple(reversed(info.dims)), quant,
                      header.tensor_data(info))


def _hf_name(name: str, path: Any) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    block, _, layer_and_kind = stem.partition(".")
    layer, _, kind = layer_and_kind.partition(".")
    if block == "blk" and layer.isdigit() and kind in BLOCK_NAMES:
        return f"model.layers.{layer}.{BLOCK_NAMES[kind]}.{suffix}"
    raise ConfigError("checkpoint", f"{path}: tensor {name} is not part of a Gemma 3 text model",
                      _FIX)


def check_fits(model: GGUFModel, model_config: Any, preset_name: str,
               presets: dict[str, Any] | None = None) -> None:
    """One line naming ``model`` when the file's shape is not ``preset_name``'s (and the preset
    it is, among ``presets``: name -> TransformerConfig)."""
    stated = model.shape_fields()
    wrong = {name: value for name, value in stated.items()
             if getattr(model_config, name) != value}
    if not wrong:
        return
    fitting = [name for name, config in (presets or {}).items()
               if all(getattr(config, f) == v for f, v in stated.items())]
    described = ", ".join(f"{name} {value} (model: {getattr(model_config, name)})"
                          for name, value in wrong.items())
    raise ConfigError("model", f"{preset_name!r} does not fit the GGUF at {model.path}: "
                      f"{described}", f"use model={fitting[0]!r}" if fitting else
                      "give the GGUF of a Gemma 3 size gemmalab has a preset for")


# ---------------------------------------------------------------------------------------------
# Conversion, cached.


def file_sha256(path: str | os.PathLike, cache_dir: Path) -> str:
    """The file's sha256, remembered in ``cache_dir`` by path, size and mtime (a 27B file takes
    a minute to hash)."""
    path = Path(path).resolve()
    stat = path.stat()
    memo = cache_dir / "gguf" / "sha256.json"
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    known = json.loads(memo.read_text()) if memo.is_file() else {}
    if key not in known:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
        known[key] = digest.hexdigest()
        memo.parent.mkdir(parents=True, exist_ok=True)
        storage.write_bytes(memo, json.dumps(known, indent=1).encode())
    return known[key]


def converted_path(path: str | os.PathLike, cache_dir: Path, dtype: str) -> Path:
    """Where ``convert`` caches the file's weights in ``dtype``."""
    return cache_dir / "gguf" / f"{file_sha256(path, cache_dir)[:20]}-{dtype}" / \
        safetensors_io.SINGLE_FILE


def dequantized(tensor: GGUFTensor) -> np.ndarray:
    """One tensor in float32, Hugging Face's layout, norms back to Gemma's ``w``: the whole
    tensor through ``gguf.quants.dequantize`` (``convert`` gives the same bits, a block of rows at
    a time: ``dequantized_rows``)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = np.asarray(tensor.data)
    if not data.dtype.isnative:  # a big-endian file's floats: dequantize reinterprets the bytes
        data = data.astype(data.dtype.newbyteorder("="))
    values = dequantize(data, GGMLQuantizationType[tensor.quant_type])
    values = np.asarray(values, np.float32).reshape(tensor.shape)
    return values - 1.0 if tensor.is_norm else values


# A work item of the conversion: whole rows, about this many values (~1 MB in float32, which
# stays in the core's cache through gguf.quants' numpy steps). On gemma-3-270m's tensors, one
# core: 2^18 values dequantize 1.4-3.5x faster than the 16 rows at a time gguf.quants.dequantize
# takes (Python between numpy calls) and 2-7x faster than 2^20 or more (glibc maps the 4 MB
# temporaries afresh each time: 50x the page faults, which cost more than the arithmetic).
ROW_BLOCK_VALUES = 1 << 18


def row_count(tensor: GGUFTensor) -> int:
    """The tensor's rows: its last axis is a row (a 1-D tensor is one row)."""
    return math.prod(tensor.shape[:-1])


def _row_length(tensor: GGUFTensor) -> int:
    return tensor.shape[-1] if tensor.shape else 1


def row_blocks(tensor: GGUFTensor, block_values: int = ROW_BLOCK_VALUES
               ) -> list[tuple[int, int]]:
    """The tensor's rows as runs ``(start, stop)`` of whole rows, about ``block_values`` values
    each (at least one row). GGUF quantizes each row on its own, in whole blocks of 32 or 256
    values (a row of ``cols`` values is ``cols / block_size * type_size`` bytes), so each run
    dequantizes without the others."""
    rows = row_count(tensor)
    step = max(1, block_values // _row_length(tensor))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def dequantized_rows(tensor: GGUFTensor, start: int, stop: int) -> np.ndarray:
    """Rows ``start`` to ``stop`` of the tensor in float32, shape ``(stop - start, cols)``, norms
    back to Gemma's ``w``: bit for bit those rows of ``dequantized(tensor)``."""
    from gguf import GGMLQuantizationType, quants

    data = np.asarray(tensor.data)
    rows = data.reshape(row_count(tensor), -1)[start:stop]
    if not rows.dtype.isnative:  # a big-endian file's floats: dequantize reinterprets the bytes
        rows = rows.astype(rows.dtype.newbyteorder("="))
    kind = getattr(quants, tensor.quant_type, None)  # gguf.quants' class of the type: Q8_0, …
    if isinstance(kind, type) and hasattr(kind, "dequantize_rows"):
        # What gguf.quants.dequantize runs, 16 rows at a time; here on the whole run at once.
        kind.init_grid()  # the i-quants' lookup tables; nothing for the types supported here
        values = kind.dequantize_rows(rows)
    else:  # F32, F16: a view, a cast
        values = quants.dequantize(rows, GGMLQuantizationType[tensor.quant_type])
    values = np.asarray(values, np.float32)
    return values - 1.0 if tensor.is_norm else values


PHASES = ("dequantize_s", "cast_s", "write_s")  # each work item's steps, as ``convert`` times them


def convert(model: GGUFModel, cache_dir: Path, dtype: str = "float32", *,
            workers: int | None = None, progress: bool = True,
            block_values: int = ROW_BLOCK_VALUES,
            timings: dict[str, float] | None = None) -> Path:
    """The model's weights as a Hugging Face safetensors file in ``cache_dir`` (converted once
    per file and dtype; a later call returns the cached file).

    ``workers`` threads (default: one per core) dequantize blocks of about ``block_values``
    values (``row_blocks``), each cast to ``dtype`` and written straight to its place in the file;
    numpy releases the GIL in the arithmetic, so one large tensor (the token embedding) keeps
    every worker busy. ``timings``, when given, receives ``hash_s`` (the file's cache key),
    ``layout_s`` (the output file's header), ``convert_s`` (the workers' wall time) and ``PHASES``
    (seconds summed over the workers), ``values`` and ``bytes`` written.
    """
    if dtype not in CACHE_DTYPES:
        raise ConfigError("param_dtype", f"unknown dtype {dtype!r}",
                          f"use one of {list(CACHE_DTYPES)}")
    times = timings if timings is not None else {}
    started = time.perf_counter()
    target = converted_path(model.path, cache_dir, dtype)
    times["hash_s"] = time.perf_counter() - started
    if target.is_file():
        return target
    out_dtype = safetensors_io.DTYPES[CACHE_DTYPES[dtype]]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.tmp{os.getpid()}")
    started = time.perf_counter()
    offsets = safetensors_io.create_file(
        partial, [safetensors_io.Tensor(t.hf_name, t.shape, out_dtype) for t in model.tensors])
    times["layout_s"] = time.perf_counter() - started
    blocks = [_Block(tensor, start, stop, offset + start * _row_length(tensor) * out_dtype.itemsize)
              for tensor, offset in zip(model.tensors, offsets, strict=True)
              for start, stop in row_blocks(tensor, block_values)]
    total = sum(math.prod(t.shape) for t in model.tensors)
    try:
        with open(partial, "r+b") as f, _progress_bar(total, f"GGUF -> {dtype}",
                                                       progress) as advance:
            convert_block = functools.partial(_convert_block, fd=f.fileno(), dtype=out_dtype,
                                              advance=advance)
            workers = workers or os.cpu_count() or 1
            started = time.perf_counter()
            if workers == 1:
                spent = [convert_block(block) for block in blocks]
            else:
                with ThreadPoolExecutor(workers) as pool:  # in file order: the writes run forward
                    spent = list(pool.map(convert_block, blocks))
            times["convert_s"] = time.perf_counter() - started
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    times.update({phase: math.fsum(s[k] for s in spent) for k, phase in enumerate(PHASES)})
    times.update(values=total, bytes=total * out_dtype.itemsize, workers=workers)
    os.replace(partial, target)
    return target


@dataclasses.dataclass(frozen=True)
class _Block:
    """A work item of ``convert``: rows ``start`` to ``stop`` of a tensor, written at ``at``."""

    tensor: GGUFTensor
    start: int
    stop: int
    at: int  # in the output file


def _convert_block(block: _Block, *, fd: int, dtype: np.dtype, advance: Callable[[int], None]
                   ) -> tuple[float, float, float]:
    """Dequantize, cast and write one block; the seconds of each (``PHASES``)."""
    started = time.perf_counter()
    values = dequantized_rows(block.tensor, block.start, block.stop)
    dequantized_at = time.perf_counter()
    values = np.ascontiguousarray(values, dtype)
    cast_at = time.perf_counter()
    safetensors_io.write_at(fd, values, block.at)
    advance(values.size)
    return dequantized_at - started, cast_at - dequantized_at, time.perf_counter() - cast_at


class _progress_bar:  # noqa: N801 - a context manager used like a function
    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled = total, desc, enabled
        self.lock = threading.Lock()

    def __enter__(self) -> Callable[[int], None]:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=self.total, desc=self.desc, unit="weight", unit_scale=True,
                        disable=not self.enabled)

        def advance(count: int) -> None:
            with self.lock:
                self.bar.update(count)

        return advance

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()

