"""Tests for the embedded TinyStories-style corpus generator."""

import os
import re
from collections.abc import Iterator

import pytest

from gemmalab.data import corpus
from gemmalab.data.corpus import (
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
    from gemmalab.data.fact_matching import Reply, follows, judge, mentions

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
    from gemmalab.data import records

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


# --- the templates as data (corpus_templates.json) reproduce the generator byte for byte -----

# sha256 fingerprints recorded from the pre-data generator (templates and plots as Python code)
# at commit b4c800f130cf7b4f7d8bcc745e75c94fa8f42db3, before they moved to
# gemmalab/corpus_templates.json. Stories: "".join(f"{plot}\n{story}\n{SEPARATOR}\n") over
# generate_labeled_stories(3000, seed).
LABELED_STORIES_3000_SHA256 = {
    0: "527ae622d5bd3afa730b578fe5b785c241a7a14c95b72a49c2773d999e0d7fd1",
    1: "9c3c75a6c7b8fa7c72896559c86be21f541df533be251f171d0fa13cfb3c41b2",
    7: "153e68c545090c54ec57c30b0996b3ee9f07c16830f3d17704f6b6502711b65f",
}
# The bytes of write_corpus(path, n, seed) and write_instructions(path, n, seed), by (n, seed).
CORPUS_FILE_SHA256 = {
    (300, 0): STORIES_V1_300_SEED0_SHA256,
    (1000, 5): "2a52d5faa0c5e85fbe538dbe24617777b497fc1a00881da9c54a41704df124da",
}
INSTRUCTIONS_FILE_SHA256 = {
    (3000, 0): "093935c76c747b6469de32ece432f08f18733acd860c4039022bcb0dc33b1b1b",
    (3000, 1): "03b46a81afef283cb541267e89469338c5fc50b49b8ea539c33534cd51526b75",
    (500, 7): "f1b833371d89b2a733a9a0c26bb6e22f781de9f48be10be7e783fdf4c766f494",
}


def _sha256(data: str | bytes) -> str:
    import hashlib

    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@pytest.mark.parametrize("seed", sorted(LABELED_STORIES_3000_SHA256))
def test_labeled_stories_match_the_pre_data_generator(seed: int) -> None:
    data = "".join(f"{plot}\n{story}\n{SEPARATOR}\n"
                   for plot, story in generate_labeled_stories(3000, seed))
    assert _sha256(data) == LABELED_STORIES_3000_SHA256[seed]


@pytest.mark.parametrize(("n", "seed"), sorted(CORPUS_FILE_SHA256))
def test_corpus_file_matches_the_pre_data_generator(tmp_path, n: int, seed: int) -> None:
    path = write_corpus(tmp_path / "stories.txt", n, seed)
    assert _sha256(path.read_bytes()) == CORPUS_FILE_SHA256[n, seed]


@pytest.mark.parametrize(("n", "seed"), sorted(INSTRUCTIONS_FILE_SHA256))
def test_instructions_match_the_pre_data_generator(tmp_path, n: int, seed: int) -> None:
    path = corpus.write_instructions(tmp_path / "instructions.jsonl", n, seed)
    assert _sha256(path.read_bytes()) == INSTRUCTIONS_FILE_SHA256[n, seed]


def test_the_pinned_stories_use_every_template(monkeypatch) -> None:
    """Seeds 0 and 1's 3000 stories (pinned above) walk every template the plots can reach,
    so every plot and branch of the data is under the fingerprints."""
    templates = corpus._templates()
    walked: set[str] = set()
    walk = corpus._walk

    def recording_walk(r, node, *args) -> None:
        if isinstance(node, str):
            walked.add(node)
        walk(r, node, *args)

    monkeypatch.setattr(corpus, "_walk", recording_walk)
    stories = [story for seed in (0, 1) for story in generate_stories(3000, seed)]
    monkeypatch.undo()

    def reachable(node) -> Iterator[str]:
        """The templates under ``node``, following named lists (not names, fields, values)."""
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for child in node:
                yield from reachable(child)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key in ("one_of", "sample"):
                    named = isinstance(value, str)  # a list of the file, else a local
                    yield from reachable(templates.lists.get(value, []) if named else value)
                elif key in ("set", "let"):
                    yield from reachable(list(value.values()))
                elif key == "cases":
                    yield from reachable([then for _, then in value])
                elif key in ("then", "else", "to"):
                    yield from reachable(value)

    reached = set(reachable(list(templates.plots.values())))
    assert len(reached) > 600
    # The trip's activities and sights are drawn into fields ("as"), never walked themselves.
    drawn = {phrase for trip in templates.lists["trips"]
             for phrase in trip["let"]["activities"] + trip["let"]["sights"]}
    assert reached - walked - drawn == set()
    assert [phrase for phrase in drawn if not any(phrase in story for story in stories)] == []


def test_the_templates_are_read_on_first_use_only() -> None:
    import pathlib
    import subprocess
    import sys

    root = str(pathlib.Path(corpus.__file__).resolve().parents[2])  # this checkout's gemmalab
    code = f"""if True:
        import sys
        sys.path.insert(0, {root!r})
        import gemmalab.data.corpus as c
        assert c.__file__ == {corpus.__file__!r}, c.__file__
        assert c._templates.cache_info().currsize == 0  # not read by the import
        next(c.generate_stories(1))
        assert c._templates.cache_info().currsize == 1
    """
    subprocess.run([sys.executable, "-c", code], check=True)
