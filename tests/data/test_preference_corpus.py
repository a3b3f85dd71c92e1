"""The embedded preference set: chosen follows every requested fact, rejected breaks exactly one."""

import json

from gemmalab.data import preference_corpus, records
from gemmalab.data.chat import PreferencePair
from gemmalab.data.fact_matching import Reply, follows, mentions


def test_pairs_are_deterministic_by_seed_and_differ_across_seeds():
    first = list(preference_corpus.generate_preferences(40, seed=0))
    assert first == list(preference_corpus.generate_preferences(40, seed=0))
    assert len(first) == 40
    assert first != list(preference_corpus.generate_preferences(40, seed=1))


def test_chosen_follows_the_prompt_and_rejected_breaks_the_named_fact():
    pairs = list(preference_corpus.generate_preferences(200, seed=0))
    for pair in pairs:
        facts, prompt = pair["facts"], pair["prompt"]
        assert follows(Reply(pair["chosen"], prompt, ended=True), facts)
        assert not follows(Reply(pair["rejected"], prompt, ended=True), facts)
        broken = pair["broken"]
        assert not mentions(pair["rejected"], facts[broken])
        # Every other fact the chosen story states word for word is still there.
        for key, value in facts.items():
            if key != broken and value in pair["chosen"] and not mentions(value, facts[broken]):
                assert mentions(pair["rejected"], value), (key, pair)
    # More than names: the broken facts span several kinds.
    assert len({pair["broken"] for pair in pairs}) >= 8


def test_the_written_set_is_valid_preference_data_and_cached(tmp_path):
    path = preference_corpus.embedded_preferences_path(tmp_path, 30, seed=0)
    counts = records.validate(str(path), skip_bad_records=False, preferences=True)
    assert counts.records == 30 and counts.bad_records == 0
    pair = next(records.iter_pairs(str(path)))
    assert isinstance(pair, PreferencePair) and pair.chosen.facts
    first_line = json.loads(path.read_text().splitlines()[0])
    assert pair.chosen.response == first_line["chosen"]
    stamp = path.stat().st_mtime_ns
    assert preference_corpus.embedded_preferences_path(tmp_path, 30, seed=0) == path
    assert path.stat().st_mtime_ns == stamp  # read from the cache, not written again
