"""The task metric on known answers: no model, just texts and facts."""

import pytest

from gemmalab.task_metric import fact_share, follows, mentions, missing_facts, task_score

FACTS = {"name": "Mia", "kind": "girl", "toy": "kite"}


def test_whole_words_in_any_case():
    assert mentions("Once upon a time, MIA flew a kite.", "Mia")
    assert not mentions("Miami is far away.", "Mia")
    assert mentions("She went to the beach today.", "the beach")
    assert not mentions("She went to the beaches.", "the beach")
    assert mentions("Her toy (a yo-yo) was red.", "yo-yo")


def test_a_reply_follows_when_every_fact_is_there():
    story = "There was a girl named Mia. One day, Mia lost her red kite."
    assert follows(story, FACTS) and missing_facts(story, FACTS) == []
    assert missing_facts("There was a boy named Tom. He lost his kite.", FACTS) == ["name", "kind"]


def test_scores_on_known_answers():
    replies = ["A girl named Mia flew her kite.",  # all 3 facts
               "A girl named Mia flew her ball.",  # 2 of 3
               "Tom played."]  # none
    assert task_score(replies, [FACTS] * 3) == pytest.approx(1 / 3)
    assert fact_share(replies, [FACTS] * 3) == pytest.approx(5 / 9)
    with pytest.raises(ValueError, match="2 replies for 3 instructions"):
        task_score(replies[:2], [FACTS] * 3)
