"""The corpus as documents: resolved, validated, read and split.

TinyStories format (UTF-8, stories separated by ``<|endoftext|>``) is streamed and split into a
deterministic held-out eval set and per-process train shards. Instruction/chat data (JSONL,
``gemmalab.data.records``) is read as conversations in Gemma's chat template
(``gemmalab.data.chat``). A file without any ``<|endoftext|>`` is rejected (it is almost always
the wrong file or format); a single document is written as ``text<|endoftext|>``.

Parquet (``gemmalab.data.parquet``: one file, a glob or a list, local or gs://) yields the same
documents, one a row. Its rows are numbered across its files before anything is read, so the
split goes by row: every process finds the eval rows and its own contiguous share of the train
rows without reading anyone else's row groups (a text file or JSONL is streamed whole by every
process, and its train documents dealt round-robin).
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gemmalab import storage
from gemmalab.config import EMBEDDED_INSTRUCTIONS, EMBEDDED_PREFERENCES, eval_period
from gemmalab.data import parquet, records
from gemmalab.data.chat import Conversation, PreferencePair
from gemmalab.data.corpus import SEPARATOR
from gemmalab.errors import ConfigError

READ_CHUNK_BYTES = 8 << 20
SEPARATOR_SCAN_BYTES = 64 << 20

# Corpus.format. A PREFERENCES corpus is cached as two chat documents per pair (chosen, then
# rejected) that are always packed into one row together.
TEXT, CHAT, PREFERENCES = "text", "chat", "preferences"
CONVERSATIONAL = (CHAT, PREFERENCES)  # formats in Gemma's chat template


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A resolved data source: where it is and what identifies its content."""

    path: str
    fingerprint: str
    embedded: bool
    # TEXT: <|endoftext|>-separated stories (or Parquet texts); CHAT: conversations; PREFERENCES:
    # preference pairs (JSONL records or Parquet rows)
    format: str = TEXT
    bad_records: int = 0  # JSONL records or Parquet rows skipped (skip_bad_records)

    @property
    def conversational(self) -> bool:
        return self.format in CONVERSATIONAL


def resolve_corpus(data_path: str, *, cache_dir: Path, embedded_stories: int, seed: int,
                   skip_bad_records: bool = False, preferences: bool = False) -> Corpus:
    """Validate ``data_path`` (or generate an embedded data set) before any expensive work.
    ``preferences`` (objective "dpo"): a JSONL file or Parquet must hold preference pairs."""
    from gemmalab.data import corpus

    if not data_path:
        path = corpus.embedded_corpus_path(cache_dir / "corpus", embedded_stories, seed=seed)
        return Corpus(str(path), _fingerprint(str(path)), embedded=True)
    if data_path == EMBEDDED_INSTRUCTIONS:  # generated as JSONL, then read like a user's file
        path = str(corpus.embedded_instructions_path(cache_dir / "corpus", embedded_stories,
                                                     seed=seed))
        return Corpus(path, _fingerprint(path), embedded=True, format=CHAT)
    if data_path == EMBEDDED_PREFERENCES:
        from gemmalab.data.preference_corpus import embedded_preferences_path

        path = str(embedded_preferences_path(cache_dir / "corpus", embedded_stories, seed=seed))
        return Corpus(path, _fingerprint(path), embedded=True, format=PREFERENCES)
    if parquet.names_parquet(data_path):
        return _parquet_corpus(data_path, skip_bad_records, preferences)
    _require_data_file(data_path)
    if parquet.is_parquet(data_path):
        return _parquet_corpus(data_path, skip_bad_records, preferences)
    if records.is_jsonl(data_path):
        counts = records.validate(data_path, skip_bad_records=skip_bad_records,
                                  preferences=preferences)
        return Corpus(data_path, _fingerprint(data_path), embedded=False,
                      format=PREFERENCES if preferences else CHAT,
                      bad_records=counts.bad_records)
    if preferences:
        raise ConfigError("data_path", f"{data_path} is not a JSONL file of preference pairs",
                          'write one {"prompt": ..., "chosen": ..., "rejected": ...} object per '
                          "line to a .jsonl file (or Parquet columns of those names)")
    validate_data_file(data_path)
    return Corpus(data_path, _fingerprint(data_path), embedded=False)


def _parquet_corpus(data_path: str, skip_bad_records: bool, preferences: bool) -> Corpus:
    """Footers and columns checked; chat and preference rows checked one by one as JSONL
    records are (every process reads them all, so all refuse a bad row alike)."""
    source = parquet.open_corpus(data_path, preferences=preferences)
    if source.layout == parquet.TEXT:
        return Corpus(data_path, source.fingerprint, embedded=False)
    located = ((where, records.checked(values, preferences=preferences))
               for _, where, values in parquet.iter_rows(source))
    counts = records.count_records(located, data_path, in_file=False,
                                   skip_bad_records=skip_bad_records, preferences=preferences)
    return Corpus(data_path, source.fingerprint, embedded=False,
                  format=PREFERENCES if preferences else CHAT, bad_records=counts.bad_records)


def _require_data_file(path: str) -> None:
    """Missing, unreadable or empty files fail here with a one-line fix."""
    if storage.is_gcs(path):
        storage.require_gcs_credentials("data_path", path)
    if not storage.exists(path):
        raise ConfigError("data_path", f"{path} does not exist",
                          "point data_path at a TinyStories-format text file, a JSONL "
                          "instruction file or Parquet, or '' for the embedded corpus")
    if not storage.is_gcs(path) and not os.path.isfile(path):
        raise ConfigError("data_path", f"{path} is not a file", "name the text file itself")
    if storage.file_size(path) == 0:
        raise ConfigError("data_path", f"{path} is empty",
                          "write stories separated by <|endoftext|> into it")


def validate_data_file(path: str) -> None:
    """Missing, empty, non-UTF-8 or separator-less text files fail here with a one-line fix."""
    _require_data_file(path)
    with storage.open_binary(path) as f:
        head = f.read(SEPARATOR_SCAN_BYTES)
    try:
        text = codecs.getincrementaldecoder("utf-8")("strict").decode(head)
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e.start) from None
    if SEPARATOR not in text:
        scope = "" if len(head) < SEPARATOR_SCAN_BYTES else " in its first 64 MB"
        raise ConfigError("data_path", f"{path} has no {SEPARATOR} separator{scope}",
                          f"end every story (even a single document) with {SEPARATOR}, or "
                          "give instruction data as .jsonl")
    if not text.replace(SEPARATOR, "").strip():
        raise ConfigError("data_path", f"{path} holds only separators and whitespace",
                          "add story text between the separators")


def _not_utf8(path: str, offset: int) -> ConfigError:
    return ConfigError("data_path", f"{path} is not UTF-8 text (invalid byte at offset {offset})",
                       "convert it, e.g. `iconv -f LATIN1 -t UTF-8 in.txt > out.txt`")


def iter_stories(path: str) -> Iterator[str]:
    """Stream stories (stripped, non-empty) without ever holding the file in memory."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    pending, offset = "", 0
    with storage.open_binary(path) as f:
        while chunk := f.read(READ_CHUNK_BYTES):
            try:
                pending += decoder.decode(chunk)
            except UnicodeDecodeError as e:
                raise _not_utf8(path, offset + e.start) from None
            offset += len(chunk)
            *complete, pending = pending.split(SEPARATOR)
            yield from _non_empty(complete)
        try:
            pending += decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise _not_utf8(path, offset + e.start) from None
    yield from _non_empty([pending])


def _non_empty(pieces: list[str]) -> Iterator[str]:
    for piece in pieces:
        story = piece.strip().lstrip("\ufeff").strip()
        if story:
            yield story


def _fingerprint(path: str) -> str:
    """Content identity for cache keys: size, mtime and the first and last 4 MB."""
    digest = hashlib.sha256()
    size = storage.file_size(path)
    digest.update(f"{size}".encode())
    if not storage.is_gcs(path):
        digest.update(str(os.stat(path).st_mtime_ns).encode())
    with storage.open_binary(path) as f:
        digest.update(f.read(4 << 20))
        if size > 8 << 20:
            f.seek(size - (4 << 20))
            digest.update(f.read())
    return digest.hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class SplitRule:
    """Deterministic assignment of story ``i`` to eval, or to one process's train shard.

    Every ``eval_period``-th document is held out, the first ``max_eval_stories`` of them; the
    rest are train documents, numbered in order (their ordinal). A stream (text, JSONL) deals
    them round-robin (``label_stories``); Parquet, whose rows are counted before they are read,
    gives each process a contiguous share (``train_share``) and goes by row.
    """

    eval_fraction: float
    max_eval_stories: int
    process_index: int = 0
    process_count: int = 1

    @property
    def eval_period(self) -> int:
        return eval_period(self.eval_fraction)

    def evals_before(self, i: int) -> int:
        """How many of documents ``0 .. i - 1`` are held out."""
        return min(i // self.eval_period, self.max_eval_stories)

    def is_eval(self, i: int) -> bool:
        return self.evals_before(i + 1) > self.evals_before(i)

    def train_share(self, documents: int) -> tuple[int, int]:
        """The train ordinals (``start``, ``stop``) this process takes of a corpus of
        ``documents``: contiguous, the processes' shares differing by one at most."""
        train = documents - self.evals_before(documents)
        return (train * self.process_index // self.process_count,
                train * (self.process_index + 1) // self.process_count)

    def label_stories(self, stories: Iterator[Any], datacount: int | None
                      ) -> Iterator[tuple[str, Any]]:
        """Yield ("eval" | "train", story) for the stories this process needs."""
        # islice: not one story past datacount is read (and counted as read)
        for i, story in enumerate(stories if datacount is None
                                  else itertools.islice(stories, datacount)):
            if self.is_eval(i):
                yield "eval", story
            elif (i - self.evals_before(i)) % self.process_count == self.process_index:
                yield "train", story


def iter_documents(path: str, format: str = TEXT
                   ) -> Iterator[str] | Iterator[Conversation] | Iterator[PreferencePair]:
    """Stories of a text file, the good conversations of a JSONL file, or its good preference
    pairs (``format`` PREFERENCES); of Parquet, the same from its rows."""
    if parquet.is_parquet(path):
        source = parquet.open_corpus(path, preferences=format == PREFERENCES)
        return (doc for _, _, values in parquet.iter_rows(source)
                if (doc := _row_document(source, values, format)) is not None)
    if format == PREFERENCES:
        return records.iter_pairs(path)
    return records.iter_conversations(path) if records.is_jsonl(path) else iter_stories(path)


@dataclasses.dataclass
class LabelledDocuments:
    """This process's ``("eval" | "train", document)`` pairs, streamed, and how many documents
    of the corpus they are drawn from (``read``: of Parquet, its rows up to ``datacount``)."""

    pairs: Iterator[tuple[str, Any]]
    _read: Callable[[], int]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self.pairs

    @property
    def read(self) -> int:
        return self._read()


def labelled_documents(path: str, format: str, rule: SplitRule, datacount: int | None, *,
                       train: bool = True) -> LabelledDocuments:
    """The documents ``rule``'s process needs, labelled (``train`` False: the eval split's
    alone). Of Parquet only the row groups that hold them are read."""
    if parquet.is_parquet(path):
        source = parquet.open_corpus(path, preferences=format == PREFERENCES)
        rows = source.num_rows if datacount is None else min(source.num_rows, datacount)
        return LabelledDocuments(_labelled_rows(source, format, rule, rows, train),
                                 lambda: rows)
    counter = _CountingIterator(iter_documents(path, format))
    return LabelledDocuments(rule.label_stories(counter, datacount), lambda: counter.count)


def _labelled_rows(source: parquet.ParquetCorpus, format: str, rule: SplitRule, rows: int,
                   train: bool) -> Iterator[tuple[str, Any]]:
    """Rows ``0 .. rows - 1`` split by row: a blank or (skipped) bad row keeps its place."""
    start, stop = rule.train_share(rows) if train else (0, 0)

    def ordinal(row: int) -> int:  # of the train rows before ``row``
        return row - rule.evals_before(row)

    def wanted(first: int, end: int) -> bool:  # a row group holding eval rows or our share
        end = min(end, rows)
        return first < end and (rule.evals_before(end) > rule.evals_before(first)
                                or max(ordinal(first), start) < min(ordinal(end), stop))

    for row, _, values in parquet.iter_rows(source, wanted):
        if row >= rows:
            return
        if rule.is_eval(row):
            label = "eval"
        elif start <= ordinal(row) < stop:
            label = "train"
        else:
            continue
        doc = _row_document(source, values, format)
        if doc is not None:
            yield label, doc


def _row_document(source: parquet.ParquetCorpus, values: dict[str, Any], format: str
                  ) -> str | Conversation | PreferencePair | None:
    """A Parquet row's story, conversation or preference pair; None for a blank text or a bad
    record (``resolve_corpus`` refused those, or counted them with ``skip_bad_records``)."""
    if source.layout == parquet.TEXT:
        return next(_non_empty([values.get("text", "")]), None)
    record = records.checked(values, preferences=format == PREFERENCES)
    return None if isinstance(record, records.BadRecord) else record


class _CountingIterator:
    def __init__(self, it: Iterator[Any]):
        self.it, self.count = it, 0

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        item = next(self.it)
        self.count += 1
        return item


def training_stories(path: str, rule: SplitRule, datacount: int | None, format: str = TEXT
                     ) -> Iterator[str]:
    """All train-split documents (every shard) as text: what a local tokenizer is trained on
    (conversations in their chat template, whose turn markers it keeps whole; both sides of a
    preference pair)."""
    from gemmalab.data.chat import format_text

    whole = dataclasses.replace(rule, process_index=0, process_count=1)
    for label, doc in labelled_documents(path, format, whole, datacount):
        if label != "train":
            continue
        if isinstance(doc, PreferencePair):
            yield format_text(doc.chosen)
            yield format_text(doc.rejected)
        else:
            yield doc if isinstance(doc, str) else format_text(doc)


def heldout_conversations(path: str, rule: SplitRule, datacount: int | None,
                          format: str = CHAT) -> Iterator[Conversation]:
    """The eval split's conversations (with their facts), as the token cache holds them (of
    preference pairs: the chosen sides)."""
    whole = dataclasses.replace(rule, process_index=0, process_count=1)
    labelled = labelled_documents(path, format, whole, datacount, train=False)
    return (doc.chosen if isinstance(doc, PreferencePair) else doc
            for label, doc in labelled if label == "eval")
