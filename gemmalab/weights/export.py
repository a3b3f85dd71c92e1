"""Export a finished run's weights for other tools: ``FORMATS``.

- ``gemma``: gemma's own format (the Orbax tree ``gm.ckpts.load_params`` reads);
- ``hf``: a Hugging Face ``Gemma3ForCausalLM`` or ``Gemma4ForCausalLM`` directory
  (``gemmalab.weights.hf_layout``);
- ``peft``: LoRA adapters alone in PEFT's layout (``gemmalab.weights.peft_adapters``);
- ``gguf``: one llama.cpp GGUF file (``gemmalab.weights.gguf_export``; a LoRA run's merged
  weights) for llama.cpp, Ollama, LM Studio.

    python -m gemmalab.weights --run runs/x --format hf|gemma|peft --out DIR
    python -m gemmalab.weights --run runs/x --format gguf --type bf16|f16|f32|q8_0 --out DIR|FILE
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gemmalab.errors import ConfigError
from gemmalab.model import presets
from gemmalab.weights import gguf_export, hf_layout, orbax_params, peft_adapters

FORMATS = ("hf", "gemma", "peft", "gguf")
# The run's tokenizer, beside its params: what the HF export ships.
TOKENIZER_FILE = "tokenizer.model"


def save_gemma_params(params: dict, path: str | Path) -> str:
    """Write ``params`` (LoRA runs: the merged tree) where ``gm.ckpts.load_params`` reads it."""
    hf_layout.require_plain_params(params)
    return orbax_params.save_params(params, str(hf_layout.require_new_dir(path, "path")))


def _read_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    if not path.is_file() or not (run_dir / "params").is_dir():
        raise ConfigError("run", f"{run_dir} has no summary.json and params/ of a finished run",
                          "give the output_dir of a run that completed")
    return json.loads(path.read_text())


def run_tokenizer(run_dir: str | Path) -> Path:
    """The SentencePiece model a run trained with: its ``tokenizer.model``, written by
    ``Experiment.save`` beside the params (so a run exports anywhere, without its cache)."""
    path = Path(run_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise ConfigError("tokenizer", f"{run_dir} has no {TOKENIZER_FILE} (a run saved "
                          "before runs kept their tokenizer)", "pass --tokenizer FILE.model")
    return path


def export_run(run_dir: str | Path, fmt: str, out_dir: str | Path, *,
               dtype: str | None = None, tokenizer: str | None = None,
               base_model: str | None = None,
               max_shard_bytes: int = hf_layout.DEFAULT_MAX_SHARD_BYTES,
               gguf_type: str = "bf16", force: bool = False,
               timings: dict[str, float] | None = None) -> list[str]:
    """Export a finished run in ``fmt`` (``FORMATS``).

    A LoRA run saved its merged weights in ``params/`` (exported by hf, gemma and gguf) and its
    adapters alone in ``adapters/`` (exported by peft). ``dtype``: hf default bfloat16, peft
    float32, gemma the run's own. gguf: ``gguf_type`` (``gguf_export.TYPES``), ``out_dir`` a
    directory (the file is ``<run name>-<type>.gguf`` there) or a ``.gguf`` path; an existing
    file is replaced only with ``force``; ``timings`` receives the write's seconds and bytes.
    """

    if fmt not in FORMATS:
        raise ConfigError("format", f"unknown format {fmt!r}", f"use one of {list(FORMATS)}")
    run = Path(run_dir)
    summary = _read_summary(run)
    model_config = presets.config_from_dict(summary["model_config"])
    if fmt == "peft":
        settings = summary["params"]
        if not (run / "adapters").is_dir():
            raise ConfigError("format", f"run {run_dir} has no LoRA adapters (adapters/)",
                              "export it as hf or gemma, or pick a run with lora_rank > 0")
        rank = settings["lora_rank"]
        token_ids = tuple(summary.get("lora_token_ids") or ())
        token_rows = None
        if token_ids:  # the trained rows' values: those of the merged embedding
            embedding = orbax_params.load_params(str(run / "params"))["embedder"]
            token_rows = np.asarray(embedding["input_embedding"])[list(token_ids)]
        adapters = orbax_params.load_params(str(run / "adapters"))
        return peft_adapters.export_peft(
            adapters, model_config, out_dir, rank=rank, alpha=settings.get("lora_alpha") or rank,
            base_model_name_or_path=base_model or settings.get("checkpoint", ""),
            dtype=dtype or "float32", token_ids=token_ids, token_rows=token_rows)
    if fmt == "gguf":
        return [str(_export_gguf(run, summary, model_config, out_dir, gguf_type=gguf_type,
                                 tokenizer=tokenizer, force=force, timings=timings))]
    params = orbax_params.load_params(str(run / "params"))
    if fmt == "gemma":
        if dtype is not None:
            hf_layout.require_dtype(dtype)
            params = _cast(params, dtype)
        return [save_gemma_params(params, out_dir)]
    return hf_layout.export_hf(params, model_config, tokenizer or run_tokenizer(run), out_dir,
                     dtype=dtype or "bfloat16", max_shard_bytes=max_shard_bytes)


def gguf_path(run_dir: str | Path, out: str | Path, gguf_type: str) -> Path:
    """Where a run's GGUF goes: ``out`` itself when it names a ``.gguf`` file, else
    ``<run name>-<type>.gguf`` in the directory ``out``."""
    out = Path(out)
    if out.suffix == ".gguf":
        return out
    return out / f"{Path(run_dir).resolve().name}-{gguf_type}.gguf"


def run_is_chat(summary: dict[str, Any]) -> bool:
    """Whether a run trained on chat (or preference) data, in Gemma's chat template."""
    return summary.get("data", {}).get("data_format") in ("chat", "preferences")


def _export_gguf(run: Path, summary: dict[str, Any], model_config: Any, out: str | Path, *,
                 gguf_type: str, tokenizer: str | None, force: bool,
                 timings: dict[str, float] | None) -> Path:
    # What needs no weights is checked before the params are read (seconds for a large run).
    gguf_export.require_type(gguf_type)
    gguf_export.require_llamacpp_architecture(model_config)
    path = gguf_path(run, out, gguf_type)
    gguf_export.require_new_file(path, force)
    params = orbax_params.load_params(str(run / "params"))
    return gguf_export.export_gguf(
        params, model_config, tokenizer or run_tokenizer(run), path, gguf_type=gguf_type,
        chat=run_is_chat(summary), name=run.resolve().name, force=force, timings=timings)


def chosen_formats(formats: str | Sequence[str], run_dir: str | Path, *,
                   log: Callable[[str], None] = print) -> list[str]:
    """export.ipynb's ``formats`` for this run: one name or a list, each checked; ``peft`` left
    out (said through ``log``) for a run without LoRA adapters."""
    names = [formats] if isinstance(formats, str) else list(formats)
    unknown = [name for name in names if name not in FORMATS]
    if unknown or not names:
        raise ConfigError("formats", f"{formats!r} names {unknown or 'no format'}",
                          f"use some of {list(FORMATS)}, e.g. -y 'formats: [hf, peft]'")
    if "peft" in names and not run_is_lora(run_dir):
        log(f"peft skipped: {run_dir} trained every weight (lora_rank 0), it has no adapters")
        names.remove("peft")
    return names


def run_is_lora(run_dir: str | Path) -> bool:
    """Whether a finished run trained LoRA adapters (and so has a peft export)."""
    return bool(_read_summary(Path(run_dir))["params"].get("lora_rank"))


def hf_round_trip(run_dir: str | Path, hf_dir: str | Path) -> dict[str, Any]:
    """The HF export read back into gemma's layout against the run's own params: how many
    tensors, and the largest absolute difference (0 for a float32 export; bf16 rounding
    otherwise)."""
    import jax


    params = orbax_params.load_params(str(Path(run_dir) / "params"))
    expected = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, np.float32), params)
    loaded = hf_layout.load_hf_params(hf_dir, expected)
    # Gemma 4's KV-sharing layers' own keys and values: unused, not exported, filled on import.
    model_config = presets.config_from_dict(_read_summary(Path(run_dir))["model_config"])
    skipped = hf_layout.unexported_paths(model_config)
    ours, theirs = hf_layout._flatten(params), hf_layout._flatten(loaded)
    differences = [float(np.max(np.abs(np.asarray(ours[path], np.float32)
                                       - np.asarray(theirs[path], np.float32))))
                   for path in ours if path not in skipped]
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
    p = argparse.ArgumentParser(prog="python -m gemmalab.weights",
                                description="Export a finished run: Hugging Face Gemma3ForCausalLM "
                                "(hf), gemma's Orbax params (gemma), PEFT LoRA adapters (peft) or "
                                "one llama.cpp GGUF file (gguf).")
    p.add_argument("--run", required=True, help="the run's output_dir")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="a new (or empty) directory; gguf: a directory "
                   "or a .gguf file path")
    p.add_argument("--dtype", choices=list(hf_layout.EXPORT_DTYPES),
                   help="hf: bfloat16 (default); peft: float32; gemma: the run's own")
    p.add_argument("--tokenizer", help="hf: the SentencePiece .model (default: the run's)")
    p.add_argument("--base-model", help="peft: base_model_name_or_path (default: the run's "
                   "checkpoint)")
    p.add_argument("--max-shard-bytes", type=int, default=hf_layout.DEFAULT_MAX_SHARD_BYTES,
                   help="hf: split model.safetensors into shards of at most this size")
    p.add_argument("--type", default="bf16", dest="gguf_type",
                   help=f"gguf: one of {', '.join(gguf_export.TYPES)} (default bf16)")
    p.add_argument("--force", action="store_true", help="gguf: replace an existing file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        written = export_run(args.run, args.format, args.out, dtype=args.dtype,
                             tokenizer=args.tokenizer, base_model=args.base_model,
                             max_shard_bytes=args.max_shard_bytes, gguf_type=args.gguf_type,
                             force=args.force)
    except ConfigError as error:
        print(f"ConfigError: {error}", file=sys.stderr)
        return 2
    print(f"{args.format} export of {args.run} in {args.out}: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
