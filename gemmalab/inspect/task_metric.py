"""The task metric: the share of held-out instructions a model follows, and of their facts.

Each reply is judged by ``gemmalab.data.fact_matching`` (facts stated in words of its own,
ended by itself, no loop); ``score_summary`` gives the table's columns (``SCORE_COLUMNS``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gemmalab.data.fact_matching import Reply, Verdict, judge

SCORE_COLUMNS = ("instructions followed", "facts found", "ended by itself", "looped")


def judge_all(replies: Sequence[Reply], facts: Sequence[Mapping[str, str]]) -> list[Verdict]:
    if len(replies) != len(facts):
        raise ValueError(f"{len(replies)} replies for {len(facts)} instructions")
    if not replies:
        raise ValueError("no instructions to score")
    return [judge(r, f) for r, f in zip(replies, facts, strict=True)]


def task_score(replies: Sequence[Reply], facts: Sequence[Mapping[str, str]]) -> float:
    """Share of replies that follow their instruction (the task metric)."""
    verdicts = judge_all(replies, facts)
    return sum(v.follows for v in verdicts) / len(verdicts)


def fact_share(replies: Sequence[Reply], facts: Sequence[Mapping[str, str]]) -> float:
    """Share of all requested facts stated in the replies' own words (partial credit, whether
    or not the reply ended or looped)."""
    return _fact_share(judge_all(replies, facts))


def _fact_share(verdicts: Sequence[Verdict]) -> float:
    found = sum(len(v.found) for v in verdicts)
    return found / max(1, found + sum(len(v.missing) for v in verdicts))


def score_summary(replies: Sequence[Reply], facts: Sequence[Mapping[str, str]]
                  ) -> dict[str, float]:
    """The shares of ``SCORE_COLUMNS``: instructions followed, facts found, replies that ended
    by themselves, replies that looped."""
    verdicts = judge_all(replies, facts)
    count = len(verdicts)
    values = (sum(v.follows for v in verdicts) / count, _fact_share(verdicts),
              sum(v.ended for v in verdicts) / count, sum(v.looped for v in verdicts) / count)
    return dict(zip(SCORE_COLUMNS, values, strict=True))
