"""llama.cpp GGUF files as a base to fine-tune: checked, dequantized once, cached, read in shards.

A Gemma 3 GGUF (``general.architecture = gemma3``) holds the text model's weights under
llama.cpp's names, in ggml's axis order (the reverse of Hugging Face's ``[out, in]``), quantized
per tensor, with every RMSNorm weight stored plus one (llama.cpp's converter adds the 1 that
Gemma's ``x * (1 + w)`` adds at run time). ``convert`` undoes all three into a Hugging Face
Gemma 3 safetensors file in ``cache_dir`` (keyed by the GGUF's sha256 and the dtype), writing
its tensors in parallel; the run then reads that file like any HF checkpoint, each device's
part straight into its shard (``export.load_hf_params``). A second run skips the conversion.

Everything that can be wrong with the file is found by ``inspect`` before any conversion:
another architecture, a vision projector (``mmproj``), a truncated file, a quant type that
``gguf.quants`` cannot dequantize, a model that is not ``model``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gemmalab import safetensors_io
from gemmalab.errors import ConfigError

ARCHITECTURE = "gemma3"
# The quant types dequantized (gguf.quants does the arithmetic, in numpy).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                   "Q4_K", "Q5_K", "Q6_K")
CACHE_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
_FIX = "give a Gemma 3 text model's .gguf file (llama.cpp's gemma3 architecture)"

# llama.cpp's tensor names -> Hugging Face Gemma3ForCausalLM's (in a block: model.layers.N.*).
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
# The model's shape as the GGUF states it, against gemma's TransformerConfig fields.
_SHAPE_KEYS = {
    "block_count": "num_layers", "embedding_length": "embed_dim",
    "feed_forward_length": "hidden_dim", "attention.head_count": "num_heads",
    "attention.head_count_kv": "num_kv_heads", "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window_size",
}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str  # llama.cpp's
    hf_name: str
    shape: tuple[int, ...]  # Hugging Face's axis order
    quant_type: str
    data: Any  # the raw (quantized) bytes, mapped from the file

    @property
    def is_norm(self) -> bool:
        return self.name.endswith("norm.weight")


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
        fields = {field: int(self.metadata[key]) for key, field in _SHAPE_KEYS.items()
                  if key in self.metadata}
        return {**fields, "num_embed": self.vocab_size}


def is_gguf(path: str | os.PathLike) -> bool:
    """A file that starts with GGUF's magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


@functools.lru_cache(maxsize=2)
def _reader(path: str, size: int, mtime_ns: int) -> Any:
    # Opening parses every key, the 262k-piece vocabulary included (seconds): once per file.
    from gguf import GGUFReader

    return GGUFReader(path)


def reader(path: str | os.PathLike) -> Any:
    """gguf's ``GGUFReader`` of ``path`` (memory-mapped), shared by the weights and the
    vocabulary (``gguf_vocab``); one line naming ``checkpoint`` for a file it cannot read."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("checkpoint", f"no GGUF file at {path}", _FIX)
    stat = path.stat()
    try:
        return _reader(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    except Exception as error:  # noqa: BLE001 - a bad header, whatever the reader trips on
        reason = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
        raise ConfigError("checkpoint", f"{path} is not a readable GGUF file, or it is truncated "
                          f"({reason})", _FIX + "; copy or download it again") from None


def field(gguf_reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value (strings decoded, arrays as lists)."""
    entry = gguf_reader.fields.get(key)
    return default if entry is None else entry.contents()


def inspect(path: str | os.PathLike) -> GGUFModel:
    """The file's Gemma 3 text model, or one line naming ``checkpoint`` and the fix."""
    from gguf import GGMLQuantizationType

    gguf_reader = reader(path)
    architecture = field(gguf_reader, "general.architecture", "")
    if field(gguf_reader, "general.type") == "mmproj" or architecture == "clip":
        raise ConfigError("checkpoint", f"{path} is a vision projector (mmproj), not a language "
                          "model", "give the text model's .gguf (the mmproj file only adds "
                          "image input, which gemmalab does not train)")
    if architecture != ARCHITECTURE:
        raise ConfigError("checkpoint", f"{path} holds a {architecture or 'unnamed'} model, "
                          f"not Gemma 3 (general.architecture = {ARCHITECTURE})", _FIX)
    end = os.path.getsize(path)
    tensors = []
    for tensor in gguf_reader.tensors:
        quant = GGMLQuantizationType(tensor.tensor_type).name
        if quant not in SUPPORTED_TYPES:
            raise ConfigError("checkpoint", f"{path}: tensor {tensor.name} is {quant}, which "
                              "gemmalab cannot dequantize", f"use a GGUF in one of "
                              f"{', '.join(SUPPORTED_TYPES)} (e.g. llama-quantize to Q4_K_M)")
        if tensor.data_offset + tensor.n_bytes > end or tensor.data.nbytes != tensor.n_bytes:
            raise ConfigError("checkpoint", f"{path} is truncated: tensor {tensor.name} ends "
                              f"past the file's {end:,} bytes", "copy or download it again")
        tensors.append(GGUFTensor(tensor.name, _hf_name(tensor.name, path),
                                  tuple(int(n) for n in reversed(tensor.shape)), quant,
                                  tensor.data))
    prefix = f"{ARCHITECTURE}."
    metadata = {key.removeprefix(prefix): field(gguf_reader, key)
                for key in gguf_reader.fields if key.startswith(prefix)}
    embedding = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ConfigError("checkpoint", f"{path} has no token_embd.weight", _FIX)
    return GGUFModel(Path(path), metadata, tuple(tensors), embedding.shape[0])


def _hf_name(name: str, path: Any) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    block, _, layer_and_kind = stem.partition(".")
    layer, _, kind = layer_and_kind.partition(".")
    if block == "blk" and layer.isdigit() and kind in _BLOCK_NAMES:
        return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"
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
        _write_atomically(memo, json.dumps(known, indent=1).encode())
    return known[key]


def converted_path(path: str | os.PathLike, cache_dir: Path, dtype: str) -> Path:
    """Where ``convert`` caches the file's weights in ``dtype``."""
    return cache_dir / "gguf" / f"{file_sha256(path, cache_dir)[:20]}-{dtype}" / \
        safetensors_io.SINGLE_FILE


def dequantized(tensor: GGUFTensor) -> np.ndarray:
    """One tensor in float32, Hugging Face's layout, norms back to Gemma's ``w``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(np.asarray(tensor.data), GGMLQuantizationType[tensor.quant_type])
    values = np.asarray(values, np.float32).reshape(tensor.shape)
    return values - 1.0 if tensor.is_norm else values


def convert(model: GGUFModel, cache_dir: Path, dtype: str = "float32", *,
            workers: int | None = None, progress: bool = True) -> Path:
    """The model's weights as a Hugging Face safetensors file in ``cache_dir`` (converted once
    per file and dtype; a later call returns the cached file)."""
    if dtype not in CACHE_DTYPES:
        raise ConfigError("param_dtype", f"unknown dtype {dtype!r}",
                          f"use one of {list(CACHE_DTYPES)}")
    target = converted_path(model.path, cache_dir, dtype)
    if target.is_file():
        return target
    out_dtype = safetensors_io.DTYPES[CACHE_DTYPES[dtype]]
    tensors = [safetensors_io.Tensor(t.hf_name, t.shape, out_dtype,
                                     functools.partial(_converted, t, out_dtype))
               for t in model.tensors]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.tmp{os.getpid()}")
    with _progress_bar(len(tensors), f"GGUF -> {dtype}", progress) as advance:
        safetensors_io.write_file(partial, tensors, workers=workers or os.cpu_count() or 1,
                                  on_tensor=advance)
    os.replace(partial, target)
    return target


def _converted(tensor: GGUFTensor, dtype: np.dtype) -> np.ndarray:
    return dequantized(tensor).astype(dtype)


class _progress_bar:  # noqa: N801 - a context manager used like a function
    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled = total, desc, enabled
        self.lock = threading.Lock()

    def __enter__(self) -> Callable[[], None]:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=self.total, desc=self.desc, unit="tensor", disable=not self.enabled)

        def advance() -> None:
            with self.lock:
                self.bar.update(1)

        return advance

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(f"{path.name}.tmp{os.getpid()}")
    partial.write_bytes(data)
    os.replace(partial, path)
