"""Did a reply do what its instruction asked? Facts checked in generated text.

An instruction such as "Write a story about a girl named Mia who loses her kite" carries facts
(``{"name": "Mia", "kind": "girl", "toy": "kite"}``). A :class:`Reply` follows it when

- it states every fact in words of its own: any run of ``COPY_WINDOW`` or more words that also
  occurs in the prompt is dropped first, so an echo of the instruction states nothing;
- a fact is stated when each of its content words is there: names (capitalised in the fact)
  as exact words ("Mia" is not in "Miami"), other words by stem, so "Sara painted a picture"
  states "paint pictures"; articles and other function words do not count;
- it ended by itself (the sampler stopped at ``<end_of_turn>``/EOS, not at max_new_tokens);
- it does not loop: no run of ``LOOP_NGRAM`` words, and no sentence of
  ``LOOP_SENTENCE_WORDS`` or more words, appears twice.

Only the standard library. Two users: the corpus generator (``gemmalab.data.corpus``) makes sure
each story states the facts its prompt asks for, and ``gemmalab.inspect.task_metric`` scores a
model's replies with the same tests.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

# A copied span is COPY_WINDOW words or more. 5 because the longest phrase an answer needs to
# restate one fact is 4 words ("a girl named Mia"): that must survive, while an echo, or any
# splice of the instruction longer than one fact, is removed.
COPY_WINDOW = 5


# Repeated runs of 8 words do not happen in a story told once (the embedded stories have none),
# but do as soon as a model starts its story, or the instruction, over again.
LOOP_NGRAM = 8


# Shorter repeated sentences ("She was happy.") count too, except very short ones ("Whee!").
LOOP_SENTENCE_WORDS = 3


# Words that say nothing about a fact: "her kite" and "the kite" state the same toy.
FUNCTION_WORDS = frozenset({
    "a", "an", "the", "some", "any", "this", "that", "these", "those",
    "her", "his", "their", "its", "my", "your", "our",
    "he", "she", "it", "they", "him", "them", "me", "you", "we", "us", "i",
    "herself", "himself", "itself", "themselves",
    "to", "of", "in", "on", "at", "with", "for", "by", "from", "into", "onto", "and", "or",
})  # fmt: skip


_WORD = re.compile(r"[a-z0-9]+(?:['’][a-z]+)?")


_SENTENCE_END = re.compile(r"[.!?\n]+")


_VOWELS = frozenset("aeiou")


@dataclasses.dataclass(frozen=True)
class Reply:
    """What a model wrote for one instruction.

    ``prompt`` is the instruction as the model saw it (text copied from it does not count);
    ``ended`` says the model stopped by itself, rather than being cut at max_new_tokens.
    """

    text: str
    prompt: str
    ended: bool


@dataclasses.dataclass(frozen=True)
class Verdict:
    """How one reply did: which facts it stated in its own words, and how it ended."""

    found: tuple[str, ...]
    missing: tuple[str, ...]
    ended: bool
    looped: bool
    own_words: int  # words left once the copies of the prompt are dropped

    @property
    def follows(self) -> bool:
        return self.ended and not self.looped and not self.missing and self.own_words > 0

    def describe(self) -> str:
        """"followed", or what went wrong: "missing toy; ran to the limit; looped"."""
        if self.follows:
            return "followed"
        problems = [f"missing {', '.join(self.missing)}"] if self.missing else []
        if not self.own_words:
            problems.append("no words of its own")
        if not self.ended:
            problems.append("ran to the limit")
        if self.looped:
            problems.append("looped")
        return "; ".join(problems)


def words(text: str) -> list[str]:
    """Lower-case words, a possessive "'s" dropped ("Mia's" is "mia"); hyphens split words."""
    return [_drop_possessive(w) for w in _WORD.findall(text.lower())]


def _drop_possessive(word: str) -> str:
    return word[:-2] if word.endswith(("'s", "’s")) else word


@functools.lru_cache(maxsize=1 << 16)  # a story's few hundred distinct words, stemmed often
def stem(word: str) -> str:
    """A crude stem that maps the inflections of one word together: paint, paints, painted,
    painting -> "paint"; puppy, puppies -> "puppi"; bake, baked, baking -> "bak"; run, running.
    Irregular forms (ran, made) are not handled; words of 3 letters keep their endings.
    """
    word = word.lower()
    if len(word) > 3:
        word = _strip_verb_ending(_strip_plural(word))
        if word.endswith("e") and len(word) > 3:
            word = word[:-1]  # bake/baked, cookie/cookies, kite/kites
    if word.endswith("y") and len(word) > 2:
        word = word[:-1] + "i"  # puppy/puppies, play/played, toy/toys
    return word


def _strip_plural(word: str) -> str:
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "i"
    if word.endswith("es") and word[:-2].endswith(("s", "x", "z", "ch", "sh", "o")) \
            and len(word) > 4:
        return word[:-2]  # boxes, dishes, tomatoes
    if word.endswith("s") and not word.endswith(("ss", "us", "is")) and len(word) > 3:
        return word[:-1]
    return word


def _strip_verb_ending(word: str) -> str:
    if word.endswith("ied"):
        return word[:-3] + "i" if len(word) > 4 else word[:-1]  # cried -> cri (cry); tied -> tie
    for ending in ("ing", "ed"):
        base = word[: -len(ending)]
        if word.endswith(ending) and len(base) >= 3 and _has_vowel(base):
            return _undouble(base)
    return word


def _has_vowel(base: str) -> bool:
    return any(ch in _VOWELS or ch == "y" for ch in base)  # "string" is not "str" + "ing"


def _undouble(base: str) -> str:
    """running -> run, hopped -> hop; but rolled -> roll, passed -> pass, added -> add."""
    if len(base) > 3 and base[-1] == base[-2] and base[-1] not in _VOWELS | set("lsz"):
        return base[:-1]
    return base


def mentions(text: str, fact: str) -> bool:
    """``text`` states ``fact``: every content word of it, names exactly, other words by stem
    (no copies are dropped here: that needs a prompt, see :func:`judge`)."""
    return _states(_text_vocabulary(text), fact)


@functools.lru_cache(maxsize=16)  # the corpus generator asks about one story many times
def _text_vocabulary(text: str) -> _Vocabulary:
    return _Vocabulary.of(words(text))


@dataclasses.dataclass(frozen=True)
class _Vocabulary:
    """The words of a text, and their stems, for looking facts up."""

    exact: frozenset[str]
    stems: frozenset[str]

    @classmethod
    def of(cls, text_words: Iterable[str]) -> _Vocabulary:
        exact = frozenset(text_words)
        return cls(exact, frozenset(stem(w) for w in exact))


def _states(vocabulary: _Vocabulary, fact: str) -> bool:
    return all(_has_word(vocabulary, word, is_name) for word, is_name in _content_words(fact))


def _has_word(vocabulary: _Vocabulary, word: str, is_name: bool) -> bool:
    return word in vocabulary.exact if is_name else stem(word) in vocabulary.stems


def _content_words(fact: str) -> list[tuple[str, bool]]:
    """``(word, is_name)`` for each word of ``fact`` that matters; a name is capitalised."""
    tokens = [(_drop_possessive(t.lower()), t[:1].isupper())
              for t in re.findall(r"[A-Za-z0-9]+(?:['’][A-Za-z]+)?", fact)]
    content = [t for t in tokens if t[0] not in FUNCTION_WORDS]
    return content or tokens  # a fact of function words only is matched as it is


def own_words(reply: Reply, window: int = COPY_WINDOW) -> list[str]:
    """The reply's words outside runs of ``window`` or more words that the prompt also has.

    Runs are compared by stem, so an echo with its verbs inflected is still an echo. A prompt
    shorter than ``window`` is a run by itself: repeating it whole is copying it.
    """
    reply_words, prompt_words = words(reply.text), words(reply.prompt)
    size = min(window, len(prompt_words))
    if size == 0:
        return reply_words
    reply_stems = [stem(w) for w in reply_words]
    prompt_runs = set(_ngrams([stem(w) for w in prompt_words], size))
    copied = [False] * len(reply_words)
    for start, run in enumerate(_ngrams(reply_stems, size)):
        if run in prompt_runs:
            copied[start: start + size] = [True] * size
    return [w for w, is_copy in zip(reply_words, copied, strict=True) if not is_copy]


def _ngrams(items: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(items[i: i + n]) for i in range(len(items) - n + 1)]


def loops(text: str) -> bool:
    """The text repeats itself: a run of ``LOOP_NGRAM`` words, or a sentence of
    ``LOOP_SENTENCE_WORDS`` or more words, occurs twice (case and punctuation aside)."""
    return _repeats_a_run(words(text), LOOP_NGRAM) or _repeats_a_sentence(text)


def _repeats_a_run(text_words: Sequence[str], n: int) -> bool:
    runs = _ngrams(text_words, n)
    return len(set(runs)) < len(runs)


def _repeats_a_sentence(text: str) -> bool:
    sentences = (tuple(words(s)) for s in _SENTENCE_END.split(text))
    counts = Counter(s for s in sentences if len(s) >= LOOP_SENTENCE_WORDS)
    return any(count > 1 for count in counts.values())


def judge(reply: Reply, facts: Mapping[str, str]) -> Verdict:
    """Which of ``facts`` the reply states in its own words, and whether it ended and looped."""
    own = own_words(reply)
    vocabulary = _Vocabulary.of(own)
    stated = {name: _states(vocabulary, value) for name, value in facts.items()}
    return Verdict(found=tuple(n for n, ok in stated.items() if ok),
                   missing=tuple(n for n, ok in stated.items() if not ok),
                   ended=reply.ended, looped=loops(reply.text), own_words=len(own))


def missing_facts(reply: Reply, facts: Mapping[str, str]) -> list[str]:
    """The names of the facts the reply does not state in its own words."""
    return list(judge(reply, facts).missing)


def follows(reply: Reply, facts: Mapping[str, str]) -> bool:
    """States every fact in its own words, ended by itself, and does not loop."""
    return judge(reply, facts).follows
