"""Tests for the embedded TinyStories-style corpus generator."""

import os
import re

import pytest

from gemmalab import corpus
from gemmalab.corpus import (
    GENERATOR_VERSION,
    PLOT_TYPES,
    SEPARATOR,
    embedded_corpus_path,
    generate_labeled_stories,
    generate_stories,
    write_corpus,
)

SAMPLE = 2000
# write_corpus(path, 300, seed=0) of generator version 1 (the instruction layer must not move it).
STORIES_V1_300_SEED0_SHA256 = "086836b52a31a3c58806413d230fd37f6d0a446cc90e52148b73953a4f1fc15c"


@pytest.fixture(scope="module")
def labeled() -> list[tuple[str, str]]:
    return list(generate_labeled_stories(SAMPLE, seed=0))


@pytest.fixture(scope="module")
def stories(labeled: list[tuple[str, str]]) -> list[str]:
    return [story for _, story in labeled]


def test_deterministic_per_seed() -> None:
    assert list(generate_stories(300, seed=0)) == list(generate_stories(300, seed=0))
    assert list(generate_stories(300, seed=0)) != list(generate_stories(300, seed=1))


def test_prefix_stable_and_labels_match(stories: list[str]) -> None:
    assert list(generate_stories(50, seed=0)) == stories[:50]


@pytest.mark.parametrize("n", [0, 1, 7, 123])
def test_count(n: int) -> None:
    assert len(list(generate_stories(n, seed=5))) == n


def test_negative_count_rejected() -> None:
    with pytest.raises(ValueError):
        list(generate_stories(-1))


def test_stories_nonempty_clean(stories: list[str]) -> None:
    for s in stories:
        assert s and s == s.strip()
        assert SEPARATOR not in s
        assert "{" not in s and "}" not in s
        assert s[0].isupper()
        assert s[-1] in '.!?"'
        assert "  " not in s and " ." not in s and " ," not in s


def test_lengths(stories: list[str]) -> None:
    words = [len(s.split()) for s in stories]
    assert min(words) >= 60 and max(words) <= 300
    assert 80 <= sum(words) / len(words) <= 250


def test_write_corpus_round_trips(tmp_path: os.PathLike) -> None:
    path = write_corpus(tmp_path / "sub" / "c.txt", 200, seed=3)
    data = path.read_bytes()
    text = data.decode("utf-8")
    assert text.endswith("\n" + SEPARATOR + "\n")
    assert text.count(SEPARATOR) == 200
    parsed = [p.strip() for p in text.split(SEPARATOR)]
    assert [p for p in parsed if p] == list(generate_stories(200, seed=3))
    assert write_corpus(tmp_path / "again.txt", 200, seed=3).read_bytes() == data


def test_embedded_corpus_path_caches(tmp_path: os.PathLike, monkeypatch) -> None:
    cache = tmp_path / "cache"
    p1 = embedded_corpus_path(cache, 100, seed=2)
    assert p1.is_file()
    assert p1.name == f"stories-v{GENERATOR_VERSION}-n100-s2.txt"
    assert p1.read_text(encoding="utf-8").count(SEPARATOR) == 100
    mtime = p1.stat().st_mtime_ns

    def boom(*args, **kwargs):
        raise AssertionError("cached corpus was regenerated")

    monkeypatch.setattr(corpus, "write_corpus", boom)
    p2 = embedded_corpus_path(cache, 100, seed=2)
    assert p2 == p1 and p2.stat().st_mtime_ns == mtime
    assert sorted(x.name for x in cache.iterdir()) == [p1.name]  # no temp files left
    with pytest.raises(AssertionError):
        embedded_corpus_path(cache, 100, seed=3)  # a different seed is a different file
    assert sorted(x.name for x in cache.iterdir()) == [p1.name]


def test_amy_opening_present(stories: list[str]) -> None:
    opening = "Once upon a time, there was a girl named Amy."
    assert sum(s.startswith(opening) for s in stories) >= 5
    starts = {s.split(",")[0].split(" ")[0] for s in stories}
    assert {"Once", "One", "There"} <= starts


def test_diversity(labeled: list[tuple[str, str]], stories: list[str]) -> None:
    assert len(set(stories)) > 0.95 * len(stories)
    plots = {plot for plot, _ in labeled}
    assert plots == set(PLOT_TYPES) and len(plots) >= 8
    sentences = {x for s in stories for x in re.split(r"(?<=[.!?])\s+", s)}
    assert len(sentences) > 2000
    names = {m.group(1) for s in stories for m in re.finditer(r"(?:girl|boy) named (\w+)", s)}
    assert len(names) >= 40


def test_pronoun_agreement(stories: list[str]) -> None:
    for s in stories:
        assert not re.search(r"\bgirl (?:named|called) \w+\.\s+He\b", s), s
        assert not re.search(r"\bboy (?:named|called) \w+\.\s+She\b", s), s
        m = re.match(r"Once upon a time, there was a (girl|boy) named (\w+)\.\s+(He|She)\b", s)
        if m:
            assert m.group(3) == ("She" if m.group(1) == "girl" else "He"), s


def test_articles(stories: list[str]) -> None:
    for s in stories:
        assert not re.search(r"\ba [aeiouAEIOU]", s), s
        assert not re.search(r"\ban [^aeiouhAEIOUH\s]", s), s


# --- the embedded instruction set ----------------------------------------------------------


def test_instructions_ask_for_the_facts_their_stories_contain(labeled) -> None:
    from gemmalab.task_metric import Reply, follows, judge, mentions

    records = list(corpus.generate_instructions(SAMPLE, seed=0))
    assert [r["response"] for r in records] == [story for _, story in labeled]  # same generator
    for record in records:
        facts, prompt, story = record["facts"], record["prompt"], record["response"]
        assert {"name", "kind"} <= facts.keys(), record
        assert all(mentions(prompt, value) for value in facts.values()), record  # all asked for
        # The story answers its prompt in words of its own (not copied from the prompt) ...
        assert follows(Reply(story, prompt, ended=True), facts), record
        # ... while echoing the prompt states none of them.
        assert judge(Reply(f"{prompt} {prompt}", prompt, ended=True), facts).found == ()
    assert sum(len(r["facts"]) > 2 for r in records) > 0.95 * SAMPLE  # nearly all name more
    assert len({r["prompt"] for r in records}) > 0.99 * SAMPLE


def test_instructions_are_varied(labeled) -> None:
    records = list(corpus.generate_instructions(SAMPLE, seed=0))
    openings = {" ".join(r["prompt"].split()[:3]) for r in records}
    assert len(openings) >= 10
    assert len({r["facts"]["name"] for r in records}) >= 50
    asked = {key for r in records for key in r["facts"]}
    assert len(asked) >= 15 and {"toy", "friend", "place", "pet name", "hobby"} <= asked
    values = {(key, value) for r in records for key, value in r["facts"].items()
              if key not in ("name", "kind")}
    assert len(values) >= 150
    # Every plot is asked for by facts of its own, not only "a story about a girl named Mia".
    for plot in PLOT_TYPES:
        plot_records = [r for (p, _), r in zip(labeled, records, strict=True) if p == plot]
        assert sum(len(r["facts"]) > 2 for r in plot_records) > 0.9 * len(plot_records), plot


def test_instructions_are_deterministic_per_seed() -> None:
    first = list(corpus.generate_instructions(100, seed=3))
    assert first == list(corpus.generate_instructions(100, seed=3))
    assert first[:40] == list(corpus.generate_instructions(40, seed=3))
    assert first != list(corpus.generate_instructions(100, seed=4))


def test_the_story_corpus_is_unchanged() -> None:
    """The stories are version 1 byte for byte (change them only with GENERATOR_VERSION)."""
    import hashlib

    data = "".join(s + "\n" + SEPARATOR + "\n" for s in generate_stories(300, seed=0))
    assert GENERATOR_VERSION == 1
    assert hashlib.sha256(data.encode()).hexdigest() == STORIES_V1_300_SEED0_SHA256


def test_embedded_instructions_round_trip_through_the_jsonl_reader(tmp_path) -> None:
    from gemmalab import records

    path = corpus.embedded_instructions_path(tmp_path, 50, seed=4)
    version = f"{GENERATOR_VERSION}.{corpus.INSTRUCTIONS_VERSION}"
    assert path.name == f"instructions-v{version}-n50-s4.jsonl"
    assert corpus.embedded_instructions_path(tmp_path, 50, seed=4) == path  # cached
    assert sorted(x.name for x in tmp_path.iterdir()) == [path.name]  # no temp files left
    assert records.validate(str(path), skip_bad_records=False).records == 50
    expected = list(corpus.generate_instructions(50, seed=4))
    for conversation, record in zip(records.iter_conversations(str(path)), expected, strict=True):
        assert conversation.turns == (("user", record["prompt"]), ("model", record["response"]))
        assert conversation.facts == record["facts"]
