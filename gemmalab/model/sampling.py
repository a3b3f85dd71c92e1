"""Text generation with gemma's sampler (BOS added, stops at EOS).

Greedy continuations also say how much of them float noise cannot change: the part where each
chosen token beat every other by at least ``decision_margin`` logits. Another CPU's rounding
moves logits by far less than that margin, so two machines agree on that part; past the first
closer call they may legitimately diverge (the notebook regression tests rely on this).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any

import numpy as np

from gemmalab import gemma_lib
from gemmalab.errors import require
from gemmalab.model import presets

SAMPLER_CACHE_LENGTH = 1024
# Logit gap a greedy choice must win by to count as decided. Cross-CPU differences of a short
# run's logits were measured at ~1e-5 in float32 and up to ~0.06 in bfloat16 (whose spacing
# is 0.125 at |logit| ~ 20); these margins stay one to three orders of magnitude above that.
DECISION_MARGIN = {4: 0.01, 2: 0.5}
# Teacher-forced scoring pads sequences to a multiple of this to reuse compilations.
SCORING_BUCKET = 64


@dataclasses.dataclass(frozen=True)
class Continuation:
    """What a model wrote after ``prompt``.

    ``decided`` is the prefix of ``text`` made of greedy choices that won by at least the
    decision margin; ``complete`` says that every choice, including where to stop, did.
    Sampled (temperature > 0) and chat continuations have no decided part. ``ended``: the
    model stopped by itself (EOS or end of turn), not at ``max_new_tokens``.
    """

    prompt: str
    text: str
    decided: str = ""
    complete: bool = False
    ended: bool = False

    def __str__(self) -> str:
        return self.text

    def record(self, label: str = "") -> dict[str, Any]:
        """A JSON-able description (the notebooks attach it to the output's metadata)."""
        return {"label": label, "prompt": self.prompt, "text": self.text,
                "decided": self.decided, "complete": self.complete}


def decision_margin(compute_dtype: Any) -> float:
    return DECISION_MARGIN[4 if np.dtype(compute_dtype).itemsize >= 4 else 2]


def sampling_method(temperature: float, top_p: float) -> Any:
    """gemma's greedy sampling when ``temperature`` is 0, else nucleus (top-p) sampling."""
    gm = gemma_lib.gm()
    if temperature == 0.0:
        return gm.text.Greedy()
    return gm.text.TopPSampling(p=top_p, temperature=temperature)


def checked_prompts(prompts: str | list[str], *, max_new_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0) -> list[str]:
    """The prompts as a list (a string is one prompt, not its characters), with the sampling
    settings checked: one line naming the parameter, before any compile."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    require(bool(prompts) and all(isinstance(p, str) and p for p in prompts), "prompts",
            f"{prompts!r} is not a list of prompts", "give non-empty strings, e.g. ['Once upon']")
    require(isinstance(max_new_tokens, numbers.Integral) and not isinstance(max_new_tokens, bool)
            and max_new_tokens >= 1, "max_new_tokens",
            f"{max_new_tokens!r} is not a positive whole number", "use e.g. 48")
    require(isinstance(temperature, numbers.Real) and math.isfinite(temperature)
            and temperature >= 0, "temperature", f"{temperature!r} is not a number >= 0",
            "use 0 (greedy) or e.g. 0.8")
    require(isinstance(top_p, numbers.Real) and 0 < top_p <= 1, "top_p",
            f"{top_p!r} is outside (0, 1]", "use e.g. 0.9 (1.0 keeps every token)")
    return prompts


def continue_prompts(model: Any, params: Any, tokenizer: Any, prompts: list[str], *,
                     max_new_tokens: int = 64, compute_dtype: Any = None,
                     temperature: float = 0.0, top_p: float = 1.0, seed: int = 0
                     ) -> list[Continuation]:
    """Continue each prompt: greedy when ``temperature`` is 0, else nucleus with ``seed``.

    Each text is exactly what follows its prompt, so ``prompt + text`` reads right
    (SentencePiece drops the leading space of a decoded word; it is restored here).
    """
    prompts = checked_prompts(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p)
    gm = gemma_lib.gm()
    if compute_dtype is not None:
        params = presets.cast_params(params, compute_dtype)
    sampler = gm.text.Sampler(model=model, params=params, tokenizer=tokenizer,
                              sampling=sampling_method(temperature, top_p),
                              cache_length=SAMPLER_CACHE_LENGTH, max_out_length=max_new_tokens)
    output = sampler.sample(list(prompts), max_new_tokens=max_new_tokens, rng=seed,
                            return_state=True)
    predicted = np.asarray(output.state.predicted_tokens)
    steps = int(output.state.step)
    specials = tokenizer.special_tokens
    stops = {int(specials.EOS), int(specials.END_OF_TURN), int(specials.BEGIN_OF_TOOL_RESPONSE)}
    continuations = []
    for prompt, text, row in zip(prompts, output.text, predicted, strict=True):
        generated = _generated_tokens(row, steps, stops)
        text = _restore_leading_space(tokenizer, text, generated)
        ended = bool(generated) and generated[-1] in stops
        if temperature != 0.0:
            continuations.append(Continuation(prompt, text, ended=ended))
            continue
        margins = greedy_margins(model, params, tokenizer.encode(prompt, add_bos=True), generated)
        continuations.append(_decided(tokenizer, prompt, text, generated, margins,
                                      stopped=ended, threshold=decision_margin(_dtype_of(params))))
    return continuations


def sample(model: Any, params: Any, tokenizer: Any, prompts: str | list[str], **kwargs: Any
           ) -> str | list[str]:
    """The texts of ``continue_prompts`` (one string for one prompt)."""
    single = isinstance(prompts, str)
    texts = [c.text for c in continue_prompts(model, params, tokenizer,
                                              [prompts] if single else list(prompts), **kwargs)]
    return texts[0] if single else texts


def greedy_margins(model: Any, params: Any, prompt_tokens: list[int], generated: list[int]
                   ) -> np.ndarray:
    """For each generated token: its logit minus the best other logit, teacher-forced."""
    import jax.numpy as jnp

    if not generated:
        return np.zeros((0,), np.float32)
    tokens = list(prompt_tokens) + list(generated)
    length = math.ceil(len(tokens) / SCORING_BUCKET) * SCORING_BUCKET
    ids = np.zeros((1, length), np.int32)
    ids[0, : len(tokens)] = tokens
    margins = np.asarray(_scorer(model)(params, jnp.asarray(ids)), np.float32)
    # Position i predicts token i + 1: the generated tokens are predicted from len(prompt) - 1.
    first = len(prompt_tokens) - 1
    return margins[first: first + len(generated)]


_SCORERS: dict[int, tuple[Any, Any]] = {}


def _scorer(model: Any) -> Any:
    """One jit-compiled margins function per model (flax modules are not hashable)."""
    import functools

    import jax

    if id(model) not in _SCORERS:
        # Holding the model keeps its id from being reused by another object.
        _SCORERS[id(model)] = (model, jax.jit(functools.partial(_next_token_margins, model)))
    return _SCORERS[id(model)][1]


def _next_token_margins(model: Any, params: Any, ids: Any) -> Any:
    """``[L - 1]``: at each position, the next token's logit minus the best other logit.

    Computed on the device: only L numbers come back, not L x vocabulary logits.
    """
    import jax.numpy as jnp

    length = ids.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))[None]
    logits = model.apply({"params": params}, ids, positions=jnp.arange(length)[None],
                         attention_mask=causal).logits[0, :-1].astype(jnp.float32)
    targets = ids[0, 1:]
    rows = jnp.arange(length - 1)
    chosen = logits[rows, targets]
    return chosen - logits.at[rows, targets].set(-jnp.inf).max(axis=-1)


def _generated_tokens(row: np.ndarray, steps: int, stops: set[int]) -> list[int]:
    """The tokens a row produced: up to and including its stop token, else ``steps`` of them."""
    generated = []
    for token in row[:steps].tolist():
        generated.append(int(token))
        if token in stops:
            break
    return generated


def _restore_leading_space(tokenizer: Any, text: str, generated: list[int]) -> str:
    if (generated and text and not text.startswith(" ")
        and tokenizer.tokens[generated[0]].startswith(" ")):
        return " " + text
    return text


def _decided(tokenizer: Any, prompt: str, text: str, generated: list[int], margins: np.ndarray,
             *, stopped: bool, threshold: float) -> Continuation:
    weak = np.flatnonzero(margins < threshold)
    count = int(weak[0]) if weak.size else len(generated)
    complete = count == len(generated)
    content = generated[:-1] if stopped else generated  # the stop token has no text
    prefix = _restore_leading_space(tokenizer, tokenizer.decode(content[:count]), content)
    if complete:
        prefix = text
    elif not text.startswith(prefix):
        # Decoding a prefix of the tokens is not always a prefix of the text (a piece may merge
        # with its neighbour); keep only the characters both agree on.
        prefix = os.path.commonprefix([prefix, text])
    return Continuation(prompt, text, decided=prefix, complete=complete, ended=stopped)


def _dtype_of(params: Any) -> Any:
    import jax

    return jax.tree.leaves(params)[0].dtype
