"""What a config leaves open, decided from its checkpoint: a step of the weights stage.

A ``TrainConfig`` is a pure value: ``model=None``, ``tokenizer=None``, ``num_layers=None``,
``batch_size=None`` and an empty ``data_path`` mean "the checkpoint's", "the model's" or "the
objective's"; a config that names neither a model nor a checkpoint fine-tunes the default base
(``DEFAULT_CHECKPOINT``: the embedded pretrained Gemma 3 270M), never a toy. ``resolve`` decides
them, partly from what lies on disk (a gemmalab run's ``summary.json`` beside its params, a
Hugging Face directory's ``tokenizer.model`` and ``config.json``), and returns the decided config
with a record of each decision, which the run writes to ``summary.json`` (``resolved``). The
checks that need those files run here too.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from gemmalab.config import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_BATCH_SIZES,
    DEFAULT_CHECKPOINT,
    EMBEDDED_BASES,
    EMBEDDED_PREFERENCES,
    PRESET_NAMES,
    TrainConfig,
)
from gemmalab.errors import require


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The decided config and, per decided flat name, its value and what decided it."""

    config: TrainConfig
    decisions: dict[str, dict[str, Any]]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return self.decisions


def resolve(config: TrainConfig) -> Resolved:
    """Decide the model, tokenizer, depth, batch and data set that ``config`` leaves open.
    Idempotent: a resolved config resolves to itself."""
    model, trainer, data = config.model, config.trainer, config.data
    decisions: dict[str, dict[str, Any]] = {}

    def decide(name: str, given: Any, value: Any, source: str) -> Any:
        decided = (given, "given") if given is not None else (value, source)
        decisions[name] = {"value": decided[0], "from": decided[1]}
        return decided[0]

    # Random init only for a model named without weights; nothing named: the default base.
    checkpoint = decide("checkpoint", model.checkpoint or None,
                        "" if model.preset is not None else DEFAULT_CHECKPOINT,
                        "random init of the named model" if model.preset is not None
                        else "the default base (no model or checkpoint named)")
    run = run_params_of(checkpoint)
    preset = decide("model", model.preset, *((None, "") if model.preset is not None
                                              else _model_of_checkpoint(checkpoint, run)))
    tokenizer = decide("tokenizer", model.tokenizer, *_tokenizer_of_checkpoint(checkpoint, run))
    run_depth = None if run is None else run.get("num_layers")
    num_layers = decide("num_layers", model.num_layers, run_depth,
                        "the run's summary.json" if run is not None else "the preset")
    batch_size = decide("batch_size", trainer.batch_size,
                        DEFAULT_BATCH_SIZES.get(preset, DEFAULT_BATCH_SIZE),
                        f"{preset}'s default")
    data_path = decide("data_path", data.path or None,
                       EMBEDDED_PREFERENCES if trainer.objective == "dpo" else "",
                       f"the {trainer.objective} objective's embedded set")

    if not model.checkpoint and model.preset is None:  # the default base: random init's asks
        for name, asks in (("num_layers", model.num_layers is not None),
                           ("tokenizer", model.tokenizer == "local")):
            require(not asks, name, f"is set for random init, but no model is named, so the run "
                    f"fine-tunes the default base {DEFAULT_CHECKPOINT}",
                    "name the model to initialise (e.g. model='gemma3-tiny'), or leave "
                    f"{name} unset")
    require(num_layers is None or not checkpoint
            or (run is not None and run.get("num_layers") == num_layers), "num_layers",
            f"a cut model ({num_layers} layers) cannot load {checkpoint!r}, which holds every "
            "layer of its model", "leave num_layers None to load a checkpoint")
    if _preset_of_name(checkpoint) is not None:  # before the tokenizer it implies is checked
        from gemmalab.weights import sources

        sources.require_name_fits(checkpoint, preset)
    family = preset.split("-")[0]
    require(not (tokenizer in ("gemma3", "gemma4") and tokenizer != family
                 and is_pretrained(checkpoint)), "tokenizer",
            f"{tokenizer}'s vocabulary is not the one {preset}'s pretrained weights were trained "
            "with", f"use tokenizer='{family}' (or leave it unset: the checkpoint's own)")
    require(not (tokenizer == "local" and is_pretrained(checkpoint)), "tokenizer",
            "a tokenizer trained on the corpus cannot read a pretrained checkpoint's "
            "embeddings", "leave tokenizer unset (None: the checkpoint's own) or use 'gemma3'")
    decided = dataclasses.replace(
        config,
        model=dataclasses.replace(model, preset=preset, checkpoint=checkpoint,
                                  tokenizer=tokenizer, num_layers=num_layers),
        trainer=dataclasses.replace(trainer, batch_size=batch_size),
        data=dataclasses.replace(data, path=data_path))
    return Resolved(decided, decisions)


def _model_of_checkpoint(checkpoint: str, run: dict[str, Any] | None) -> tuple[str, str]:
    """The preset a checkpoint names by itself (an embedded base, GEMMA3_270M_PT -> gemma3-270m,
    a gemmalab run's params: the model that run trained). Other paths name none: their model
    must be given (read only when ``model`` is not)."""
    if checkpoint in EMBEDDED_BASES:
        return EMBEDDED_BASES[checkpoint], "the embedded base"
    if run is not None and run.get("model") in PRESET_NAMES:
        return run["model"], "the run's summary.json"
    preset = _preset_of_name(checkpoint)
    require(preset is not None, "model", f"the checkpoint {checkpoint!r} does not say which "
            "model it holds", "name it, e.g. model='gemma3-270m' (one of "
            f"{', '.join(PRESET_NAMES)})")
    return preset, "the checkpoint's name"


def _preset_of_name(checkpoint: str) -> str | None:
    """The preset whose weights a ``gm.ckpts.CheckpointPath`` name holds (GEMMA3_270M_PT ->
    gemma3-270m, GEMMA4_26B_A4B_IT -> gemma4-26b-a4b), else None."""
    from gemmalab.model import presets

    upper = checkpoint.upper()
    return next((name for name, preset in presets.PRESETS.items()
                 if upper in preset.checkpoints), None)


def _tokenizer_of_checkpoint(checkpoint: str, run: dict[str, Any] | None) -> tuple[str, str]:
    """The tokenizer that goes with a checkpoint: its own vocabulary (a gemmalab run's params:
    the tokenizer that run used), never a freshly trained one."""
    if not checkpoint:
        return "local", "random init"
    if checkpoint.endswith(".gguf"):
        return checkpoint, "the GGUF's own vocabulary"  # gemmalab.weights.gguf_vocab
    if checkpoint.startswith(("gs://", "embedded:")):
        return "gemma3", "the checkpoint's kind"
    named = _preset_of_name(checkpoint)
    if named is not None:
        return named.split("-")[0], "the checkpoint's name"  # gemma3 or gemma4
    own = Path(checkpoint) / "tokenizer.model"  # a Hugging Face directory's
    if own.is_file():
        return str(own), "the checkpoint's tokenizer.model"
    if run is not None:
        # The very tokenizer the run saved beside its params: a "local" one is trained per
        # corpus, so naming "local" again would train another on a continuing run's new data.
        saved = Path(checkpoint).parent / "tokenizer.model"
        if saved.is_file():
            return str(saved), "the run's saved tokenizer.model"
        return run.get("tokenizer", "gemma3"), "the run's summary.json"
    return "gemma3", "the default for pretrained weights"


def run_params_of(checkpoint: str) -> dict[str, Any] | None:
    """The parameters of the gemmalab run whose ``output_dir/params`` ``checkpoint`` is (its
    ``summary.json`` beside them), else None."""
    if not checkpoint or checkpoint.startswith(("gs://", "embedded:")):
        return None
    run_summary = Path(checkpoint).parent / "summary.json"
    if not run_summary.is_file():
        return None
    return json.loads(run_summary.read_text()).get("params", {})


def is_pretrained(checkpoint: str) -> bool:
    """Weights trained with their own vocabulary elsewhere (not a gemmalab run's params, which
    may come from a local tokenizer)."""
    if not checkpoint:
        return False
    if checkpoint in EMBEDDED_BASES or checkpoint.endswith(".gguf"):
        return True
    if _preset_of_name(checkpoint) is not None:
        return True
    return (Path(checkpoint) / "config.json").is_file()  # a Hugging Face directory
