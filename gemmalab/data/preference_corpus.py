"""The embedded preference set: the embedded instructions, each with a chosen and a rejected story.

The chosen reply is the instruction's own story, which states every fact the prompt asks for
(``corpus.generate_instructions``). The rejected reply is the same story with one of those facts
broken: the value swapped, word for word, for another value of the same fact from another
instruction (the wrong name, another toy, another place), so it fails the task metric on exactly
that fact while reading as fluently as the chosen one. The replacement is drawn as often as the
instructions state that value, so every value is rejected about as often as it is chosen.
Offline and deterministic by seed; only the standard library, like the corpus.
"""

from __future__ import annotations

import os
import pathlib
import random
import re
from collections import defaultdict
from collections.abc import Iterator

from gemmalab.data.corpus import (
    GENERATOR_VERSION,
    INSTRUCTIONS_VERSION,
    cached,
    generate_instructions,
    write_jsonl,
)
from gemmalab.data.fact_matching import Reply, follows, mentions

PREFERENCES_VERSION = 2  # bump whenever the pairs change for the same instructions
LOOKAHEAD = 2  # instructions drawn per pair wanted: some have no fact that can be swapped


def generate_preferences(num_pairs: int, seed: int = 0) -> Iterator[dict]:
    """Yield ``num_pairs`` ``{"prompt", "chosen", "rejected", "facts", "broken"}`` records
    (``broken``: the fact the rejected story gets wrong), in TRL's standard form."""
    instructions = list(generate_instructions(LOOKAHEAD * num_pairs + 16, seed))
    # Each value as often as the instructions state it: a replacement drawn from this pool is a
    # value as often as it is chosen, so no value is preferred for itself (a prior a model
    # could learn instead of reading the prompt); only the prompt tells the two stories apart.
    pools: dict[str, list[str]] = defaultdict(list)
    for record in instructions:
        for key, value in record["facts"].items():
            pools[key].append(value)
    draws = random.Random(f"preferences-{seed}")
    made = 0
    for record in instructions:
        if made == num_pairs:
            return
        pair = _broken(record, pools, draws)
        if pair is not None:
            made += 1
            yield pair
    raise RuntimeError(f"only {made} of {num_pairs} instructions had a fact to break")


def _broken(record: dict, pools: dict[str, list[str]], draws: random.Random) -> dict | None:
    """``record`` as a pair whose rejected story breaks one of its facts, or None."""
    prompt, story, facts = record["prompt"], record["response"], record["facts"]
    if not follows(Reply(story, prompt, ended=True), facts):
        return None
    keys = sorted(facts)
    draws.shuffle(keys)
    for key in keys:
        value = facts[key]
        pattern = re.compile(rf"\b{re.escape(value)}\b")
        if not pattern.search(story):
            continue  # stated in other words (a plural, another form): not swapped word for word
        others = [v for v in pools[key] if v != value and not mentions(story, v)]
        if not others:
            continue
        replacement = draws.choice(others)
        rejected = pattern.sub(replacement, story)
        if mentions(rejected, value) or follows(Reply(rejected, prompt, ended=True), facts):
            continue  # the fact survives elsewhere in the story: not a clean break
        return {"prompt": prompt, "chosen": story, "rejected": rejected, "facts": facts,
                "broken": key}
    return None


def write_preferences(path: str | os.PathLike, num_pairs: int, seed: int = 0) -> pathlib.Path:
    """Write the pairs to ``path`` as JSONL, the format ``data_path`` takes for DPO."""
    return write_jsonl(path, generate_preferences(num_pairs, seed))


def preferences_file_name(num_pairs: int, seed: int = 0) -> str:
    return (f"preferences-v{GENERATOR_VERSION}.{INSTRUCTIONS_VERSION}.{PREFERENCES_VERSION}"
            f"-n{num_pairs}-s{seed}.jsonl")


def embedded_preferences_path(cache_dir: str | os.PathLike, num_pairs: int, seed: int = 0
                              ) -> pathlib.Path:
    """The cached preference set's path, generated once (atomically) if missing."""
    return cached(pathlib.Path(cache_dir) / preferences_file_name(num_pairs, seed),
                  lambda tmp: write_preferences(tmp, num_pairs, seed))
