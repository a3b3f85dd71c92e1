"""Text generation with gemma's sampler (BOS added, stops at EOS)."""

from __future__ import annotations

from typing import Any

import jax

SAMPLER_CACHE_LENGTH = 1024


def sample(model: Any, params: Any, tokenizer: Any, prompts: str | list[str], *,
           max_new_tokens: int = 64, compute_dtype: Any = None, temperature: float = 0.0,
           top_p: float = 1.0, seed: int = 0) -> str | list[str]:
    """Continue ``prompts``: greedy when ``temperature`` is 0, else nucleus with ``seed``."""
    from gemma import gm

    if compute_dtype is not None:
        params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    sampling = (gm.text.Greedy() if temperature == 0.0
                else gm.text.TopPSampling(p=top_p, temperature=temperature))
    sampler = gm.text.Sampler(model=model, params=params, tokenizer=tokenizer, sampling=sampling,
                              cache_length=SAMPLER_CACHE_LENGTH, max_out_length=max_new_tokens)
    return sampler.sample(prompts, max_new_tokens=max_new_tokens, rng=seed)
