"""Text generation with gemma's sampler (BOS added, stops at EOS)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gemmalab import gemma_lib, training

SAMPLER_CACHE_LENGTH = 1024


def sampling_method(temperature: float, top_p: float) -> Any:
    """gemma's greedy sampling when ``temperature`` is 0, else nucleus (top-p) sampling."""
    gm = gemma_lib.gm()
    if temperature == 0.0:
        return gm.text.Greedy()
    return gm.text.TopPSampling(p=top_p, temperature=temperature)


def sample(model: Any, params: Any, tokenizer: Any, prompts: str | list[str], *,
           max_new_tokens: int = 64, compute_dtype: Any = None, temperature: float = 0.0,
           top_p: float = 1.0, seed: int = 0) -> str | list[str]:
    """Continue ``prompts``: greedy when ``temperature`` is 0, else nucleus with ``seed``.

    The returned text is exactly what follows the prompt, so ``prompt + text`` reads right
    (SentencePiece drops the leading space of a decoded word; it is restored here).
    """
    gm = gemma_lib.gm()

    if compute_dtype is not None:
        params = training.cast_params(params, compute_dtype)
    sampler = gm.text.Sampler(model=model, params=params, tokenizer=tokenizer,
                              sampling=sampling_method(temperature, top_p),
                              cache_length=SAMPLER_CACHE_LENGTH, max_out_length=max_new_tokens)
    output = sampler.sample(prompts, max_new_tokens=max_new_tokens, rng=seed, return_state=True)
    texts = [output.text] if isinstance(output.text, str) else list(output.text)
    first_tokens = np.asarray(output.state.predicted_tokens)[:, 0]
    fixed = [(" " + text if text and tokenizer.tokens[int(first)].startswith(" ")
              and not text.startswith(" ") else text)
             for text, first in zip(texts, first_tokens, strict=True)]
    return fixed[0] if isinstance(output.text, str) else fixed
