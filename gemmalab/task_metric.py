"""Did a reply do what its instruction asked? Facts checked in generated text.

An instruction such as "Write a story about a girl named Mia who loses her kite" carries facts
(``{"name": "Mia", "kind": "girl", "toy": "kite"}``); a reply follows it when it mentions every
fact, as a whole word or phrase, in any case. The task metric is the share of instructions
followed. Only the standard library: the corpus generator uses the same test.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence


def mentions(text: str, phrase: str) -> bool:
    """``phrase`` appears in ``text`` as whole words, ignoring case."""
    return re.search(rf"\b{re.escape(phrase)}\b", text, re.IGNORECASE) is not None


def missing_facts(text: str, facts: Mapping[str, str]) -> list[str]:
    """The names of the facts ``text`` does not mention."""
    return [name for name, value in facts.items() if not mentions(text, value)]


def follows(text: str, facts: Mapping[str, str]) -> bool:
    return not missing_facts(text, facts)


def task_score(texts: Sequence[str], facts: Sequence[Mapping[str, str]]) -> float:
    """Share of replies that mention all their instruction's facts."""
    if len(texts) != len(facts):
        raise ValueError(f"{len(texts)} replies for {len(facts)} instructions")
    if not texts:
        raise ValueError("no instructions to score")
    return sum(follows(t, f) for t, f in zip(texts, facts, strict=True)) / len(texts)


def fact_share(texts: Sequence[str], facts: Sequence[Mapping[str, str]]) -> float:
    """Share of all requested facts mentioned (partial credit, beside ``task_score``)."""
    found = sum(len(f) - len(missing_facts(t, f)) for t, f in zip(texts, facts, strict=True))
    return found / max(1, sum(len(f) for f in facts))
