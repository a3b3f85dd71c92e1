"""The safetensors file format, read and written with numpy alone (no torch, no extra package).

A file is: 8 bytes (little-endian u64) giving the header's length, the header (JSON: for each
tensor its ``dtype``, ``shape`` and ``data_offsets`` into the data; ``__metadata__`` a map of
strings), then the tensors' raw little-endian bytes, back to back in header order. Hugging Face
splits large models into ``model-0000k-of-0000n.safetensors`` shards listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file).

Writing streams one tensor at a time (a tensor is converted only when its bytes are written), or
lays the file out for its parts to be written in place, in parallel (``create_file``, then
``write_at``); reading maps the file, so a tensor is only read when it is used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

# safetensors dtype names <-> numpy dtypes (bfloat16 from ml_dtypes, which JAX uses too).
DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
          "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
          "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# transformers refuses files whose metadata names no known framework.
METADATA = {"format": "pt"}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor to write: its name, shape and dtype now, its values only when written (none for
    a file whose tensors are written in place: ``create_file``)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    values: Callable[[], np.ndarray] | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def write_file(path: Path, tensors: list[Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` into one safetensors file, one after the other (each converted only when
    its bytes are written)."""
    encoded, _ = _encoded_header(tensors, metadata)
    with open(path, "wb") as f:
        f.write(encoded)
        for tensor in tensors:
            f.write(_checked_bytes(tensor))


def create_file(path: Path, tensors: list[Tensor], metadata: dict[str, str] | None = None
                ) -> list[int]:
    """Start a safetensors file of ``tensors`` at ``path`` to be filled in place, in any order and
    from any number of threads (``write_at``): its header written, the file its full size (the
    data not yet written reads as zeros). Returns where each tensor's bytes start in the file."""
    encoded, offsets = _encoded_header(tensors, metadata)
    end = len(encoded) + sum(tensor.nbytes for tensor in tensors)
    with open(path, "wb") as f:
        f.write(encoded)
        f.truncate(end)
    return [len(encoded) + offset for offset in offsets]


def write_at(fd: int, values: np.ndarray, offset: int) -> None:
    """``values``' bytes (little-endian, C order) written at ``offset`` of the open file ``fd``."""
    values = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
    view = memoryview(values.reshape(-1).view(np.uint8))  # bfloat16 has no buffer format
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _encoded_header(tensors: list[Tensor], metadata: dict[str, str] | None
                    ) -> tuple[bytes, list[int]]:
    """The file's first bytes (the header's length, the header) and each tensor's offset into
    the data that follows them."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or METADATA)}
    offsets = []
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offsets.append(offset)
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the library writes
    return struct.pack("<Q", len(encoded)) + encoded, offsets


def _checked_bytes(tensor: Tensor) -> bytes:
    if tensor.values is None:
        raise ValueError(f"{tensor.name}: no values to write")
    values = np.ascontiguousarray(tensor.values(), dtype=tensor.dtype.newbyteorder("<"))
    if values.shape != tensor.shape:
        raise ValueError(f"{tensor.name}: values of shape {values.shape}, declared {tensor.shape}")
    return values.tobytes()


def write_sharded(directory: Path, tensors: list[Tensor], max_shard_bytes: int) -> list[str]:
    """Write ``tensors`` as ``model.safetensors``, or as shards of at most ``max_shard_bytes``
    (a larger tensor gets a shard of its own) plus the index. Returns the files written."""
    shards = _split(tensors, max_shard_bytes)
    if len(shards) == 1:
        write_file(directory / SINGLE_FILE, shards[0])
        return [SINGLE_FILE]
    names = [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        write_file(directory / name, shard)
        weight_map.update({tensor.name: name for tensor in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX_FILE]


def _split(tensors: list[Tensor], max_shard_bytes: int) -> list[list[Tensor]]:
    shards: list[list[Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def read_header(path: Path) -> dict[str, Any]:
    """The header of a safetensors file (without ``__metadata__``)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def read_file(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, as read-only arrays mapped from the file."""
    header = read_header(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = DTYPES[entry["dtype"]].newbyteorder("<")
        tensors[name] = data[begin:end].view(dtype).reshape(entry["shape"])
    return tensors


def read_directory(directory: Path) -> dict[str, np.ndarray]:
    """The tensors of a Hugging Face model directory: ``model.safetensors``, or the shards its
    index lists (or, without an index, every ``*.safetensors`` file in it)."""
    tensors: dict[str, np.ndarray] = {}
    for path in model_files(directory):
        tensors.update(read_file(path))
    return tensors


def model_files(directory: Path) -> list[Path]:
    if (directory / INDEX_FILE).exists():
        index = json.loads((directory / INDEX_FILE).read_text())
        return [directory / name for name in sorted(set(index["weight_map"].values()))]
    if (directory / SINGLE_FILE).exists():
        return [directory / SINGLE_FILE]
    return sorted(directory.glob("*.safetensors"))


def layout(path: Path) -> Iterator[tuple[str, list[int], str]]:
    """``(name, shape, dtype name)`` of each tensor in a file, in name order."""
    for name, entry in sorted(read_header(path).items()):
        yield name, entry["shape"], entry["dtype"]
