"""Array reshapes and tree walks that both Gemma generations' Hugging Face layouts share
(``hf_layout`` for Gemma 3 and the entry points, ``hf_gemma4`` for Gemma 4's blocks).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def heads_in_to_linear(w: Any) -> Any:
    """``[heads, embed, head_dim]`` (q/k/v einsum) -> HF ``[heads * head_dim, embed]``."""
    return w.transpose(0, 2, 1).reshape(-1, w.shape[1])


def linear_to_heads_in(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    heads, embed, head_dim = shape
    return x.reshape(heads, head_dim, embed).transpose(0, 2, 1)


def flatten(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, (*prefix, key)))
        else:
            flat[(*prefix, key)] = value
    return flat


def config_constants(*, bos_id: int, eos_id: Any, pad_id: int, dtype: str) -> dict[str, Any]:
    """The ``config.json`` fields every Gemma text model shares: no biases or dropout, tied
    embeddings, the special ids and the weights' dtype."""
    return {"attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
            "use_cache": True, "tie_word_embeddings": True, "bos_token_id": bos_id,
            "eos_token_id": eos_id, "pad_token_id": pad_id, "dtype": dtype, "torch_dtype": dtype}


def layer_names(params: dict) -> list[str]:
    return sorted((k for k in params if k.startswith("layer_")), key=lambda k: int(k[6:]))
