"""Deterministic generator of TinyStories-style children's stories.

Used as the offline, embedded training corpus: no download is needed, and the same
``(num_stories, seed)`` always gives byte-identical text. The on-disk format matches
``TinyStories-train.txt``: each story is followed by a line holding ``<|endoftext|>``.

The same stories also make the embedded instruction set (``generate_instructions``): each is
asked for by a prompt naming facts it contains, written as JSONL ``{"prompt", "response",
"facts"}`` records (``data_path="embedded:instructions"``).

The wording, word lists and plot structure are data: ``corpus_templates.json`` beside this
module, read on first use (:func:`_templates` describes it). This module holds what is logic:
the story's context (pronouns, articles), the plot interpreter and the story's frame.

Only the standard library is used (gemmalab.data.fact_matching is too), so importing this is cheap.
"""

import functools
import json
import os
import pathlib
import random
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any, NamedTuple

from gemmalab.data.fact_matching import Reply, follows, mentions, stem, words

__all__ = [
    "GENERATOR_VERSION",
    "PLOT_TYPES",
    "SEPARATOR",
    "INSTRUCTIONS_VERSION",
    "corpus_file_name",
    "embedded_corpus_path",
    "embedded_instructions_path",
    "generate_instructions",
    "generate_labeled_stories",
    "generate_stories",
    "instructions_file_name",
    "write_corpus",
    "write_instructions",
]

SEPARATOR = "<|endoftext|>"
# Bump whenever the generated text changes, so cached corpus files are invalidated.
GENERATOR_VERSION = 1

# The plots, in the order a story draws from (corpus_templates.json's "plots" has these keys in
# this order).
PLOT_TYPES: tuple[str, ...] = (
    "lost_toy", "new_friend", "sharing", "fear", "trip", "birthday", "helping", "rainy_day",
    "mistake", "growing", "keep_trying", "lost_animal",
)  # fmt: skip

_TEMPLATES_FILE = "corpus_templates.json"
_PARA = "\n\n"  # the template that marks a possible paragraph break

_Ctx = dict[str, str]
# A template node as read from JSON (see _templates).
_Node = str | list[Any] | dict[str, Any]

# --------------------------------------------------------------------------------------
# The templates
# --------------------------------------------------------------------------------------


class _Request(NamedTuple):
    """A prompt's request ("requests" per plot, most specific first, and "extras": second
    sentences asking for one more fact). It fits a story when the story contains the marker
    (any of its "|"-separated alternatives; "" always fits), every field it names is known and
    the story states every fact (``task_metric.mentions``). Wordings are ways to say it,
    written to follow "a girl named Mia who ..."; they paraphrase the story rather than quote
    it, since a reply's words copied from its prompt do not count (``task_metric``)."""

    marker: str
    wordings: list[str]
    facts: dict[str, str]  # fact -> template of its value


@dataclass(frozen=True)
class _Templates:
    """corpus_templates.json, as read by _templates."""

    lists: dict[str, list[Any]]  # named lists of alternatives (words or nodes)
    plots: dict[str, _Node]  # PLOT_TYPES -> node
    openings: list[tuple[str, int]]  # (template, weight)
    opening_cum: list[int]  # the weights' running sums
    intro_prefixes: list[str]  # can replace a plot's leading "{OneDay} {name} "
    trait_lines: list[str]
    morals: dict[str, list[str]]  # per plot
    closers: list[str]
    intros: list[str]  # how a prompt names its hero (never at the start of a sentence)
    asks: list[str]  # prompts around a request's wording
    fallback: str  # the prompt of a story no request fits
    requests: dict[str, list[_Request]]  # per plot, most specific first
    extras: list[_Request]
    # What a story's own choices are called in a prompt (third person) and as a fact; skills
    # are keyed by the goal's first word.
    indoor_asks: dict[str, list[str]]
    plant_asks: dict[str, list[str]]
    skill_asks: dict[str, list[str]]
    trip_sights: dict[str, list[str]]  # place -> what can be seen there


@functools.cache
def _templates() -> _Templates:
    """The templates, read from ``corpus_templates.json`` on first use.

    The file has word lists and other named lists (``"lists"``), a node per plot
    (``"plots"``), the frame around a plot (``"story"``: see _story) and the prompts' wording
    (``"instructions"``: see _Request). Templates are ``str.format_map`` strings, filled from
    the story's context (_context, plus what its plot sets) and its plot's locals.

    Walking a plot's node (``_walk``) draws from the story's random generator and appends
    templates to the story's beats. Node kinds:

    - ``"template"``: appended; ``"\\n\\n"`` marks a possible paragraph break.
    - ``[node, ...]``: each node in turn.
    - ``{"one_of": alternatives}``: one of them (``r.choice``), walked.
    - ``{"cases": [[bound, node], ...], "else": node}``: one ``r.random()``; the first node
      whose bound is above it (bounds ascending), else ``else``.
    - ``{"sample": alternatives, "k": [k, ...]}``: ``r.sample`` of ``r.choice(k)`` of them,
      walked in the order drawn.
    - ``{"set": {field: node}, "let": {name: node}}`` (either or both): ``set`` walks each
      node now, its templates joined and filled become a context field (the instructions are
      written from the context); then ``let`` binds plot locals to nodes as they are.
    - ``{"use": name}``: walks the node bound to ``name``.
    - ``{"if": name, "then": node}``: walks ``node`` only if ``name`` is bound.
    - ``{"reroll": field, "while_in": [value, ...], "to": node}``: while the field holds one
      of the values, sets it anew from ``node`` (as ``set`` does).

    Any dict node may carry ``"p": probability``: then it is walked only if
    ``r.random() < p``. ``one_of``, ``cases`` and ``sample`` may carry ``"as"``: what they
    draw is bound to that local (for ``sample``, a list of names: one per draw) instead of
    walked. Alternatives are a list or the name of one: a local, else one of ``"lists"``.
    """
    text = resources.files("gemmalab.data").joinpath(_TEMPLATES_FILE).read_text(encoding="utf-8")
    data = json.loads(text)
    story, asks = data["story"], data["instructions"]
    for what, keys in (("plots", data["plots"]), ("morals", story["morals"]),
                       ("requests", asks["requests"])):  # fmt: skip
        if tuple(keys) != PLOT_TYPES:
            raise ValueError(f"{_TEMPLATES_FILE}: {what} must be {PLOT_TYPES}, not {tuple(keys)}")
    openings = [(template, weight) for template, weight in story["openings"]]
    cum: list[int] = []
    for _, weight in openings:
        cum.append((cum[-1] if cum else 0) + weight)

    def requests(items: list[dict]) -> list[_Request]:
        return [_Request(x["marker"], x["wordings"], x["facts"]) for x in items]

    return _Templates(
        lists=data["lists"],
        plots=data["plots"],
        openings=openings,
        opening_cum=cum,
        intro_prefixes=story["intro_prefixes"],
        trait_lines=story["trait_lines"],
        morals=story["morals"],
        closers=story["closers"],
        intros=asks["intros"],
        asks=asks["asks"],
        fallback=asks["fallback"],
        requests={plot: requests(items) for plot, items in asks["requests"].items()},
        extras=requests(asks["extras"]),
        indoor_asks=asks["indoor_asks"],
        plant_asks=asks["plant_asks"],
        skill_asks=asks["skill_asks"],
        trip_sights={t["set"]["place"]: t["let"]["sights"] for t in data["lists"]["trips"]},
    )


# --------------------------------------------------------------------------------------
# The plot interpreter
# --------------------------------------------------------------------------------------


def _walk(r: random.Random, node: _Node, c: _Ctx, local: dict[str, Any], out: list[str]) -> None:
    """Walk ``node`` (see _templates): draw from ``r``, set context fields in ``c`` and plot
    locals in ``local``, and append templates to ``out``."""
    if isinstance(node, str):
        out.append(node)
        return
    if isinstance(node, list):
        for child in node:
            _walk(r, child, c, local, out)
        return
    p = node.get("p", 1.0)
    if p < 1.0 and r.random() >= p:
        return
    if "one_of" in node:
        _drawn(r, node, r.choice(_alternatives(node["one_of"], local)), c, local, out)
    elif "cases" in node:
        x = r.random()
        chosen = next((then for bound, then in node["cases"] if x < bound), node["else"])
        _drawn(r, node, chosen, c, local, out)
    elif "sample" in node:
        picks = r.sample(_alternatives(node["sample"], local), r.choice(node["k"]))
        if "as" in node:
            local.update(zip(node["as"], picks, strict=False))
        else:
            _walk(r, picks, c, local, out)
    elif "use" in node:
        _walk(r, local[node["use"]], c, local, out)
    elif "if" in node:
        if node["if"] in local:
            _walk(r, node["then"], c, local, out)
    elif "reroll" in node:
        while c[node["reroll"]] in node["while_in"]:
            c[node["reroll"]] = _text(r, node["to"], c, local)
    elif "set" in node or "let" in node:
        for field, value in node.get("set", {}).items():
            c[field] = _text(r, value, c, local)
        local.update(node.get("let", {}))
    else:
        raise ValueError(f"{_TEMPLATES_FILE}: unknown node {node!r}")


def _drawn(r: random.Random, node: dict[str, Any], chosen: _Node, c: _Ctx,
           local: dict[str, Any], out: list[str]) -> None:
    """What ``node`` drew: bound to its ``as`` local if it has one, else walked."""
    if "as" in node:
        local[node["as"]] = chosen
    else:
        _walk(r, chosen, c, local, out)


def _alternatives(ref: str | list[Any], local: Mapping[str, Any]) -> list[Any]:
    """A list of alternatives, or the one named ``ref`` (a local, else a list of the file)."""
    if not isinstance(ref, str):
        return ref
    return local[ref] if ref in local else _templates().lists[ref]


def _text(r: random.Random, node: _Node, c: _Ctx, local: dict[str, Any]) -> str:
    """``node``'s templates, walked now, joined and filled in."""
    out: list[str] = []
    _walk(r, node, c, local, out)
    return "".join(out).format_map({**local, **c})


# --------------------------------------------------------------------------------------
# The story's context: who is in it, their pronouns, and the things they have
# --------------------------------------------------------------------------------------


def _a(phrase: str) -> str:
    """Prefix ``phrase`` with the right indefinite article."""
    low = phrase.lower()
    if low.startswith(("uni", "use", "one", "eu")):
        return "a " + phrase
    if low[0] in "aeiou" or low.startswith(("hon", "hour")):
        return "an " + phrase
    return "a " + phrase


def _cap(text: str) -> str:
    """Capitalise the first letter (also after a leading quote)."""
    i = 1 if text.startswith('"') else 0
    return text[:i] + text[i : i + 1].upper() + text[i + 1 :]


def _pronouns(prefix: str, female: bool) -> _Ctx:
    he, him, his, himself = ("she", "her", "her", "herself") if female else (
        "he", "him", "his", "himself")  # fmt: skip
    return {
        prefix + "he": he,
        prefix + "He": he.capitalize(),
        prefix + "him": him,
        prefix + "his": his,
        prefix + "His": his.capitalize(),
        prefix + "himself": himself,
    }


# Amy (the project's sampling prompt) is drawn more often than the other girls.
_AMY_WEIGHT = 0.08


def _context(r: random.Random) -> _Ctx:
    w = _templates().lists
    female = r.random() < 0.5
    amy = female and r.random() < _AMY_WEIGHT
    name = "Amy" if amy else r.choice(w["girls"] if female else w["boys"])
    c: _Ctx = {"name": name, "kind": "girl" if female else "boy"}
    c.update(_pronouns("", female))

    f_female = r.random() < 0.5
    friend = name
    while friend == name:
        friend = r.choice(w["girls"] if f_female else w["boys"])
    c["friend"] = friend
    c["fkind"] = "girl" if f_female else "boy"
    c.update(_pronouns("f", f_female))

    mom = r.random() < 0.6
    c["par"] = "mom" if mom else "dad"
    c["Par"] = "Mom" if mom else "Dad"
    c.update(_pronouns("par", mom))

    pet_female = r.random() < 0.5
    c["pet"] = r.choice(w["pets"])
    c["petname"] = r.choice(w["pet_names"])
    c.update(_pronouns("pet", pet_female))

    o_female = r.random() < 0.5
    c["oldperson"] = "old woman" if o_female else "old man"
    c.update(_pronouns("o", o_female))

    toyn = r.choice(w["toys"])
    toy = f"{r.choice(w['toy_adjectives'])} {toyn}" if r.random() < 0.6 else toyn
    c["toyn"] = toyn
    c["toy"] = toy
    c["a_toy"] = _a(toy)
    c["gift"] = _a(r.choice(w["toys"]) if r.random() < 0.7 else r.choice(w["things"]))
    c["food"] = r.choice(w["share_foods"])
    c["a_food"] = _a(c["food"])
    c["find"] = r.choice(w["shiny_finds"])

    c["trait"] = r.choice(w["traits"])
    c["hobby"] = r.choice(w["hobbies"]).format_map(c)
    c["a_home"] = r.choice(w["homes"])
    c["age"], c["ordinal"] = r.choice(w["ages"])
    c["OneDay"] = r.choice(w["one_day"])
    c["spot"] = r.choice(w["find_spots"]).format_map(c)
    return c


# --------------------------------------------------------------------------------------
# The story: an opening, the plot's beats, a moral and/or a closer
# --------------------------------------------------------------------------------------

_INTRO_PROB = 0.2
_MIN_WORDS = 70


def _story(r: random.Random) -> tuple[str, str, _Ctx]:
    """``(plot, story, context)``: the context holds the facts the story was built from.

    The frame around the plot's beats (templates: "story"): an opening drawn by weight and up
    to two trait lines (not one naming what the opening does), or sometimes, for a plot that
    starts "{OneDay} {name} ", an intro prefix instead; then a moral and/or a closer (the last
    closer only after a moral, the first instead of "And they all ..." in a story without
    ``{friend}``); paragraph breaks are kept in about half the stories."""
    t = _templates()
    plot = PLOT_TYPES[r.randrange(len(PLOT_TYPES))]
    c = _context(r)
    local: dict[str, Any] = {}
    beats: list[str] = []
    _walk(r, t.plots[plot], c, local, beats)
    c["a_trait"] = _a(c["trait"])

    head = "{OneDay} {name} "
    if beats[0].startswith(head) and r.random() < _INTRO_PROB:
        beats[0] = r.choice(t.intro_prefixes) + beats[0][len(head) :]
        parts = beats
    else:
        k = r.randrange(t.opening_cum[-1])
        opening = next(o for (o, _), cum in zip(t.openings, t.opening_cum, strict=True) if k < cum)
        parts = [opening]
        for line in r.sample(t.trait_lines, r.choice((0, 1, 1, 1, 2))):
            clash = ("{trait}" in line and "trait}" in opening) or (
                "{a_home}" in line and "{a_home}" in opening)  # fmt: skip
            if not clash:
                parts.append(line)
        parts += beats

    ending: list[str] = []
    moral = r.random() < 0.8
    if moral:
        ending.append(r.choice(t.morals[plot]))
    if not moral or r.random() < 0.25:
        closer = r.choice(t.closers if moral else t.closers[:-1])
        if closer.startswith("And they all") and "{friend}" not in "".join(parts):
            closer = t.closers[0]
        ending.append(closer)
    parts.append(_PARA)
    parts += ending

    fields = {**local, **c}  # (no local is named like a field)
    paragraphs = r.random() < 0.5
    chunks: list[str] = []
    for p in parts:
        if p == _PARA:
            if paragraphs and chunks and chunks[-1] != _PARA:
                chunks.append(_PARA)
            continue
        if chunks and chunks[-1] != _PARA:
            chunks.append(" ")
        chunks.append(_cap(p.format_map(fields)))
    while chunks and chunks[-1] == _PARA:
        chunks.pop()
    return plot, "".join(chunks).strip(), c


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def _stories_with_context(num_stories: int, seed: int) -> Iterator[tuple[str, str, _Ctx]]:
    if num_stories < 0:
        raise ValueError(f"num_stories must be >= 0, got {num_stories}")
    r = random.Random(seed)
    for _ in range(num_stories):
        plot, story, c = _story(r)
        # Redraw the rare stories whose random choices all came out short.
        for _ in range(10):
            if len(story.split()) >= _MIN_WORDS:
                break
            plot, story, c = _story(r)
        yield plot, story, c


def generate_labeled_stories(num_stories: int, seed: int = 0) -> Iterator[tuple[str, str]]:
    """Yield ``(plot_type, story)`` pairs; the stories are those of :func:`generate_stories`."""
    for plot, story, _ in _stories_with_context(num_stories, seed):
        yield plot, story


def generate_stories(num_stories: int, seed: int = 0) -> Iterator[str]:
    """Yield ``num_stories`` stories, deterministically for a given ``seed``."""
    for _, story in generate_labeled_stories(num_stories, seed):
        yield story


# --------------------------------------------------------------------------------------
# Instructions: the same stories, each asked for by a prompt that states its facts
# --------------------------------------------------------------------------------------

# Bump whenever the instruction wording or facts change (the stories follow GENERATOR_VERSION).
INSTRUCTIONS_VERSION = 2

# Optional second sentences (_templates: "extras") are used in about _EXTRA_SHARE of the prompts
# whose story allows one.
_EXTRA_SHARE = 0.4
_TRIES = 6  # wordings tried per request before a less specific one


def _instruction_context(plot: str, story: str, c: _Ctx) -> _Ctx:
    """``c`` plus what prompts need to name the story's choices (_Templates.indoor_asks ...)."""
    t = _templates()
    ctx = dict(c)
    if plot == "rainy_day":
        ctx["indoor_does"], ctx["indoor_fact"] = t.indoor_asks[c["indoor"]]
    elif plot == "growing":
        ctx["plant_ask"], ctx["plant_fact"] = t.plant_asks[c["plant"]]
    elif plot == "keep_trying":
        ask, ctx["skill_fact"] = t.skill_asks[c["goal"].split()[0]]
        ctx["skill_ask"] = ask.format_map(c)
    elif plot == "trip":
        # Longer sights ("a big cake in a window") could only be restated by copying them.
        sights = [s for s in t.trip_sights[c["place"]]
                  if f"saw {s}" in story and len(s.split()) <= 4]
        if sights:
            ctx["sight"] = sights[0]
    return ctx


def _fill(template: str, ctx: _Ctx) -> str | None:
    """``template`` with ``ctx``'s fields, or None where it names a field ``ctx`` lacks."""
    try:
        return template.format_map(ctx)
    except KeyError:
        return None


def _fits(request: _Request, story: str, ctx: _Ctx) -> dict[str, str] | None:
    """The request's facts, if the story has its marker and states them all."""
    marker, _, facts = request
    markers = _fill(marker, ctx)
    if markers is None or (markers and not any(m in story for m in markers.split("|"))):
        return None
    values = {}
    for fact, template in facts.items():
        value = _fill(template, ctx)
        if value is None or not mentions(story, value):
            return None
        values[fact] = value
    return values


def _prompt(predicate: str, ctx: _Ctx, wording: random.Random) -> str:
    intro = wording.choice(_templates().intros).format_map(ctx)
    return wording.choice(_templates().asks).format(intro=intro, predicate=predicate)


def _extra(story: str, ctx: _Ctx, facts: dict[str, str], wording: random.Random
           ) -> tuple[str, dict[str, str]]:
    """Maybe a second sentence asking for one more fact the story states ('' if none): one
    that says something new (no word in common with ``facts``)."""
    if wording.random() >= _EXTRA_SHARE:
        return "", {}
    asked = {stem(w) for value in facts.values() for w in words(value)}
    fitting = [(e, f) for e in _templates().extras if (f := _fits(e, story, ctx)) is not None
               and not asked & {stem(w) for value in f.values() for w in words(value)}]
    if not fitting:
        return "", {}
    (_, sentences, _), more = wording.choice(fitting)
    return " " + wording.choice(sentences).format_map(ctx), more


def _request(plot: str, story: str, c: _Ctx, wording: random.Random
             ) -> tuple[str, dict[str, str]]:
    """A prompt for ``story`` and its facts: the most specific request the story fulfils, in a
    wording the story answers in words of its own (``task_metric.follows``)."""
    ctx = _instruction_context(plot, story, c)
    hero = {"name": c["name"], "kind": c["kind"]}
    for request in _templates().requests[plot]:
        facts = _fits(request, story, ctx)
        if facts is None:
            continue
        facts = {**hero, **facts}
        for _ in range(_TRIES):
            prompt = _prompt(wording.choice(request.wordings).format_map(ctx), ctx, wording)
            if not _answers(story, prompt, facts):
                continue
            extra, more = _extra(story, ctx, facts, wording)
            if extra and _answers(story, prompt + extra, {**facts, **more}):
                return prompt + extra, {**facts, **more}
            return prompt, facts
    return _templates().fallback.format_map(c), hero


def _answers(story: str, prompt: str, facts: dict[str, str]) -> bool:
    return follows(Reply(story, prompt, ended=True), facts)


def generate_instructions(num_instructions: int, seed: int = 0) -> Iterator[dict]:
    """Yield ``{"prompt", "response", "facts"}`` records: the stories of
    :func:`generate_stories` with the same arguments, each asked for by a prompt naming facts
    (name, kind, plus the plot's object, place, ...) that its story states in words of its
    own, so the story itself follows the instruction under ``task_metric``."""
    wording = random.Random(f"instructions-{seed}")  # the stories' own draws stay untouched
    for plot, story, c in _stories_with_context(num_instructions, seed):
        prompt, facts = _request(plot, story, c, wording)
        yield {"prompt": prompt, "response": story, "facts": facts}


def write_instructions(path: str | os.PathLike, num_instructions: int, seed: int = 0
                       ) -> pathlib.Path:
    """Write instruction records to ``path`` as JSONL (one ``{"prompt", "response", "facts"}``
    object per line): the format ``data_path`` accepts for instruction data."""
    return write_jsonl(path, generate_instructions(num_instructions, seed))


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> pathlib.Path:
    """``records`` to ``path``, one JSON object a line (UTF-8, ``\\n`` line ends)."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return out


def instructions_file_name(num_instructions: int, seed: int = 0) -> str:
    return (f"instructions-v{GENERATOR_VERSION}.{INSTRUCTIONS_VERSION}-n{num_instructions}"
            f"-s{seed}.jsonl")


def embedded_instructions_path(cache_dir: str | os.PathLike, num_instructions: int,
                               seed: int = 0) -> pathlib.Path:
    """The cached instruction set's path, generated once (atomically) if missing."""
    return cached(pathlib.Path(cache_dir) / instructions_file_name(num_instructions, seed),
                   lambda tmp: write_instructions(tmp, num_instructions, seed))


def write_corpus(path: str | os.PathLike, num_stories: int, seed: int = 0) -> pathlib.Path:
    """Write stories to ``path`` in TinyStories format, each followed by the separator line."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tail = "\n" + SEPARATOR + "\n"
    with out.open("w", encoding="utf-8", newline="\n") as f:
        for story in generate_stories(num_stories, seed):
            f.write(story)
            f.write(tail)
    return out


def corpus_file_name(num_stories: int, seed: int = 0) -> str:
    """File name of a cached corpus; it encodes the generator version, size and seed."""
    return f"stories-v{GENERATOR_VERSION}-n{num_stories}-s{seed}.txt"


def embedded_corpus_path(
    cache_dir: str | os.PathLike, num_stories: int, seed: int = 0
) -> pathlib.Path:
    """Return the path of the cached corpus file, generating it once (atomic write: temp file
    + os.replace) if missing."""
    return cached(pathlib.Path(cache_dir) / corpus_file_name(num_stories, seed),
                   lambda tmp: write_corpus(tmp, num_stories, seed))


def cached(target: pathlib.Path, write: Callable[[str], object]) -> pathlib.Path:
    """``target``, written once by ``write(temporary path)`` then renamed into place."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return target
