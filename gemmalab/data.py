"""Stories (or conversations) in, training rows out.

TinyStories format (UTF-8, stories separated by ``<|endoftext|>``) is streamed, split into a
deterministic held-out eval set and per-process train shards, tokenized once as BOS + ids + EOS
in worker processes and cached on disk. Rows are planned per epoch and gathered from the cache
in bulk (gemmalab.packing, wrapped for grain's prefetch and checkpoints by
gemmalab.grain_batches): packed (several stories per row, segment ids and per-story positions)
or one story per row, padded. Every row carries a loss mask: padding is never a target.

Instruction/chat data (JSONL, gemmalab.records) takes the same path: each conversation is one
document in Gemma's chat template (gemmalab.chat), cached with a per-token loss mask beside its
tokens (only the model's turns bear loss unless ``train_on_prompt``); packing keeps each
conversation whole in one segment where it fits.

A story longer than ``maxlen`` is never truncated: it is cut into consecutive windows of
``maxlen`` next-token pairs, so every token of the corpus is a target exactly once per epoch.

A file without any ``<|endoftext|>`` is rejected (it is almost always the wrong file or format);
a single document is written as ``text<|endoftext|>``.
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import hashlib
import json
import math
import mmap
import multiprocessing
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gemmalab import records, storage
from gemmalab.chat import Conversation
from gemmalab.config import EMBEDDED_INSTRUCTIONS
from gemmalab.corpus import SEPARATOR
from gemmalab.errors import ConfigError
from gemmalab.packing import FIELDS, Batch, assemble_rows, plan_rows
from gemmalab.tokenizer import (
    TokenizerInfo,
    encode_conversations,
    encode_stories,
    init_encoder,
)

READ_CHUNK_BYTES = 8 << 20
SEPARATOR_SCAN_BYTES = 64 << 20
CACHE_FORMAT_VERSION = 2  # 2: chat data, with a loss mask beside its tokens
STORIES_PER_TASK = 256
MAX_TOKENIZE_WORKERS = 32  # TPU hosts have 100+ vCPUs; beyond this, reading the file is the limit
# Every row: int32 [rows, maxlen] of each. ``loss_mask`` marks the targets that bear loss (never
# padding; for chat data only the model's turns unless train_on_prompt).
BATCH_FIELDS = FIELDS


# ---------------------------------------------------------------------------------------------
# Reading the corpus.


TEXT, CHAT = "text", "chat"  # Corpus.format


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A resolved data source: where it is and what identifies its content."""

    path: str
    fingerprint: str
    embedded: bool
    format: str = TEXT  # TEXT: <|endoftext|>-separated stories; CHAT: JSONL conversations
    bad_records: int = 0  # JSONL records skipped (skip_bad_records)


def resolve_corpus(data_path: str, *, cache_dir: Path, embedded_stories: int, seed: int,
                   skip_bad_records: bool = False) -> Corpus:
    """Validate ``data_path`` (or generate an embedded data set) before any expensive work."""
    from gemmalab import corpus

    if not data_path:
        path = corpus.embedded_corpus_path(cache_dir / "corpus", embedded_stories, seed=seed)
        return Corpus(str(path), _fingerprint(str(path)), embedded=True)
    if data_path == EMBEDDED_INSTRUCTIONS:  # generated as JSONL, then read like a user's file
        path = str(corpus.embedded_instructions_path(cache_dir / "corpus", embedded_stories,
                                                     seed=seed))
        return Corpus(path, _fingerprint(path), embedded=True, format=CHAT)
    _require_data_file(data_path)
    if records.is_jsonl(data_path):
        counts = records.validate(data_path, skip_bad_records=skip_bad_records)
        return Corpus(data_path, _fingerprint(data_path), embedded=False, format=CHAT,
                      bad_records=counts.bad_records)
    validate_data_file(data_path)
    return Corpus(data_path, _fingerprint(data_path), embedded=False)


def _require_data_file(path: str) -> None:
    """Missing, unreadable or empty files fail here with a one-line fix."""
    if storage.is_gcs(path):
        storage.require_gcs_credentials("data_path", path)
    if not storage.exists(path):
        raise ConfigError("data_path", f"{path} does not exist",
                          "point data_path at a TinyStories-format text file or a JSONL "
                          "instruction file, or '' for the embedded corpus")
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
    """Deterministic assignment of story ``i`` to eval, or to one process's train shard."""

    eval_fraction: float
    max_eval_stories: int
    process_index: int = 0
    process_count: int = 1

    @property
    def eval_period(self) -> int:
        return max(2, round(1 / self.eval_fraction))

    def label_stories(self, stories: Iterator[str], datacount: int | None
                      ) -> Iterator[tuple[str, str]]:
        """Yield ("eval" | "train", story) for the stories this process needs."""
        n_eval = n_train = 0
        for i, story in enumerate(stories):
            if datacount is not None and i >= datacount:
                return
            if i % self.eval_period == self.eval_period - 1 and n_eval < self.max_eval_stories:
                n_eval += 1
                yield "eval", story
            else:
                if n_train % self.process_count == self.process_index:
                    yield "train", story
                n_train += 1


def iter_documents(path: str) -> Iterator[str] | Iterator[Conversation]:
    """Stories of a text file, or the good conversations of a JSONL file."""
    return records.iter_conversations(path) if records.is_jsonl(path) else iter_stories(path)


def training_stories(path: str, rule: SplitRule, datacount: int | None) -> Iterator[str]:
    """All train-split documents (every shard) as text: what a local tokenizer is trained on
    (conversations in their chat template, whose turn markers it keeps whole)."""
    from gemmalab.chat import format_text

    whole = dataclasses.replace(rule, process_index=0, process_count=1)
    labelled = whole.label_stories(iter_documents(path), datacount)
    return (doc if isinstance(doc, str) else format_text(doc)
            for label, doc in labelled if label == "train")


def heldout_conversations(path: str, rule: SplitRule, datacount: int | None
                          ) -> Iterator[Conversation]:
    """The eval split's conversations (with their facts), as the token cache holds them."""
    whole = dataclasses.replace(rule, process_index=0, process_count=1)
    labelled = whole.label_stories(records.iter_conversations(path), datacount)
    return (doc for label, doc in labelled if label == "eval")


# ---------------------------------------------------------------------------------------------
# The token cache.


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
    """Documents as one flat int32 token array plus offsets (memory-mapped from the cache).

    Chat data also has ``response_mask`` (uint8, one per token): 1 where that token, as a
    target, is the model's (its turns' content and closing ``<end_of_turn>``).
    """

    tokens: np.ndarray
    offsets: np.ndarray  # int64 [num_docs + 1]
    response_mask: np.ndarray | None = None  # None: every target bears loss (stories)
    train_on_prompt: bool = False  # chat: every target bears loss, the prompt's too

    @property
    def loss_mask(self) -> np.ndarray | None:
        """Per token: does it bear loss as a target? ``None``: all do."""
        return None if self.train_on_prompt else self.response_mask

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def doc(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]])

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled for grain's worker processes: they reopen the cache files, not receive copies.
        return (_reopened_split, (_file_or_array(self.tokens), self.offsets,
                                  _file_or_array(self.response_mask), self.train_on_prompt))


def _file_or_array(array: np.ndarray | None) -> Any:
    if isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap):  # a whole file
        return (array.filename, array.dtype.str)
    return array


def _reopened_split(tokens: Any, offsets: np.ndarray, mask: Any, train_on_prompt: bool
                    ) -> TokenizedSplit:
    def opened(array: Any) -> Any:
        return np.memmap(array[0], dtype=array[1], mode="r") if isinstance(array, tuple) else array

    return TokenizedSplit(opened(tokens), offsets, opened(mask), train_on_prompt)


@dataclasses.dataclass(frozen=True)
class TokenCache:
    train: TokenizedSplit
    eval: TokenizedSplit
    meta: dict[str, Any]


def load_or_build_token_cache(corpus_: Corpus, tokenizer: TokenizerInfo, *, rule: SplitRule,
                              datacount: int | None, cache_dir: Path, workers: int,
                              train_on_prompt: bool = False) -> TokenCache:
    """Tokenize this process's stories once; later runs and epochs reuse the cache.

    ``train_on_prompt`` (chat data) is applied when the cache is opened: one cache serves both.
    """
    key_fields = {
        "version": CACHE_FORMAT_VERSION, "corpus": corpus_.fingerprint,
        "tokenizer": tokenizer.fingerprint, "datacount": datacount,
        "eval_fraction": rule.eval_fraction, "max_eval_stories": rule.max_eval_stories,
        "process": [rule.process_index, rule.process_count],
    }
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:20]
    directory = cache_dir / "tokens" / key
    if not (directory / "meta.json").exists():
        _build_token_cache(corpus_, tokenizer, rule=rule, datacount=datacount,
                           directory=directory, workers=workers, key_fields=key_fields)
    meta = json.loads((directory / "meta.json").read_text())
    if datacount is not None and meta["stories_read"] < datacount:
        warnings.warn(f"datacount={datacount} but {corpus_.path} has only "
                      f"{meta['stories_read']} stories: using all of them", stacklevel=2)
    return TokenCache(train=_open_split(directory, "train", train_on_prompt),
                      eval=_open_split(directory, "eval", train_on_prompt), meta=meta)


def _open_split(directory: Path, name: str, train_on_prompt: bool) -> TokenizedSplit:
    offsets = np.load(directory / f"{name}_offsets.npy")

    def mapped(suffix: str, dtype: Any) -> np.ndarray:
        return (np.memmap(directory / f"{name}_{suffix}.bin", dtype=dtype, mode="r")
                if offsets[-1] > 0 else np.zeros(0, dtype))

    mask = mapped("mask", np.uint8) if (directory / f"{name}_mask.bin").exists() else None
    return TokenizedSplit(tokens=mapped("tokens", np.int32), offsets=offsets,
                          response_mask=mask, train_on_prompt=train_on_prompt)


class _SplitWriter:
    """``<name>_tokens.bin`` and ``<name>_offsets.npy``; for chat data also ``<name>_mask.bin``
    (uint8 per token, parallel to the tokens)."""

    def __init__(self, directory: Path, name: str, *, with_mask: bool):
        self.directory, self.name = directory, name
        self.file = open(directory / f"{name}_tokens.bin", "wb")  # noqa: SIM115 - closed in close()
        self.mask_file = (open(directory / f"{name}_mask.bin", "wb")  # noqa: SIM115
                          if with_mask else None)
        self.offsets = [0]
        self.loss_targets = 0

    def add(self, encoded: np.ndarray | tuple[np.ndarray, np.ndarray]) -> None:
        ids, mask = encoded if isinstance(encoded, tuple) else (encoded, None)
        ids.tofile(self.file)
        if self.mask_file is not None:
            mask.tofile(self.mask_file)
            self.loss_targets += int(mask.sum())
        self.offsets.append(self.offsets[-1] + len(ids))

    def close(self) -> dict[str, int]:
        self.file.close()
        np.save(self.directory / f"{self.name}_offsets.npy", np.asarray(self.offsets, np.int64))
        counts = {f"{self.name}_docs": len(self.offsets) - 1,
                  f"{self.name}_tokens": self.offsets[-1]}
        if self.mask_file is not None:
            self.mask_file.close()
            counts[f"{self.name}_response_tokens"] = self.loss_targets
        return counts


def _build_token_cache(corpus_: Corpus, tokenizer: TokenizerInfo, *, rule: SplitRule,
                       datacount: int | None, directory: Path, workers: int,
                       key_fields: dict[str, Any]) -> None:
    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    chat = corpus_.format == CHAT
    writers = {name: _SplitWriter(tmp, name, with_mask=chat) for name in ("train", "eval")}
    counter = _CountingIterator(iter_documents(corpus_.path))
    labelled = rule.label_stories(counter, datacount)
    encode = encode_conversations if chat else encode_stories
    for label, encoded in _tokenize_in_order(labelled, tokenizer.model_proto, workers, encode):
        writers[label].add(encoded)
    meta = {**writers["train"].close(), **writers["eval"].close(), "stories_read": counter.count,
            "corpus_path": corpus_.path, "tokenizer": tokenizer.name, "key": key_fields}
    if chat:
        meta["data_format"] = CHAT
    if meta["train_docs"] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError("datacount" if datacount else "data_path",
                          f"no training stories left for process {rule.process_index} after "
                          f"holding out eval stories ({counter.count} read)",
                          "use more stories (datacount/data) or fewer processes")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)


class _CountingIterator:
    def __init__(self, it: Iterator[Any]):
        self.it, self.count = it, 0

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        item = next(self.it)
        self.count += 1
        return item


def _tokenize_in_order(labelled: Iterator[tuple[str, Any]], model_proto: bytes, workers: int,
                       encode: Any = encode_stories) -> Iterator[tuple[str, Any]]:
    """Encode (``encode``: a picklable function of a list of documents) in worker processes
    with bounded memory, yielding results in input order."""
    tasks = _batched(labelled, STORIES_PER_TASK)
    workers = workers or min(os.cpu_count() or 1, MAX_TOKENIZE_WORKERS)
    if workers <= 1:
        init_encoder(model_proto)
        for labels, stories in tasks:
            yield from zip(labels, encode(stories), strict=True)
        return
    # spawn, not fork: the parent may hold JAX's threads.
    with multiprocessing.get_context("spawn").Pool(workers, init_encoder, (model_proto,)) as pool:
        in_flight: collections.deque = collections.deque()
        for labels, stories in tasks:
            in_flight.append((labels, pool.apply_async(encode, (stories,))))
            if len(in_flight) >= 4 * workers:  # backpressure: never read ahead of the workers
                done_labels, result = in_flight.popleft()
                yield from zip(done_labels, result.get(), strict=True)
        while in_flight:
            done_labels, result = in_flight.popleft()
            yield from zip(done_labels, result.get(), strict=True)


def _batched(labelled: Iterator[tuple[str, Any]], size: int
             ) -> Iterator[tuple[list[str], list[Any]]]:
    labels: list[str] = []
    stories: list[Any] = []
    for label, story in labelled:
        labels.append(label)
        stories.append(story)
        if len(stories) == size:
            yield labels, stories
            labels, stories = [], []
    if stories:
        yield labels, stories


# ---------------------------------------------------------------------------------------------
# Rows and batches.


class WindowSource:
    """Random access to next-token windows: document ``d`` of length ``n`` gives
    ``ceil((n - 1) / maxlen)`` windows of at most ``maxlen`` (input, target) pairs."""

    def __init__(self, split: TokenizedSplit, maxlen: int):
        self.split, self.maxlen = split, maxlen
        pairs = np.maximum(split.lengths - 1, 0)
        windows = -(-pairs // maxlen)
        self.doc = np.repeat(np.arange(split.num_docs), windows)
        first_window = np.repeat(np.cumsum(windows) - windows, windows)
        self.start = split.offsets[self.doc] + (np.arange(len(self.doc)) - first_window) * maxlen
        self.end = np.minimum(self.start + maxlen + 1, split.offsets[self.doc + 1])
        self.num_split_docs = int(np.sum(windows > 1))

    def __reduce__(self) -> tuple[Any, ...]:
        return (WindowSource, (self.split, self.maxlen))  # rebuilt (O(docs)), not copied

    def __len__(self) -> int:
        return len(self.doc)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        start, end = self.start[index], self.end[index]
        seq = np.asarray(self.split.tokens[start:end], dtype=np.int32)
        mask = self.split.loss_mask
        loss_mask = (np.ones(len(seq) - 1, np.int32) if mask is None
                     else np.asarray(mask[start + 1:end], dtype=np.int32))
        return {"inputs": seq[:-1], "targets": seq[1:], "loss_mask": loss_mask}

    @property
    def lengths(self) -> np.ndarray:
        """Next-token pairs per window (1..maxlen)."""
        return self.end - self.start - 1

    @property
    def num_targets(self) -> int:
        return int(np.sum(self.lengths))

    @property
    def num_loss_targets(self) -> int:
        """Targets that bear loss (``num_targets`` but the prompts' for chat data)."""
        mask = self.split.loss_mask  # 0 at each document's BOS, which is never a target
        return self.num_targets if mask is None else int(np.sum(mask, dtype=np.int64))


def train_batches(split: TokenizedSplit, *, maxlen: int, rows_per_process: int, packing: bool,
                  seed: int, prefetch: int = 4) -> Any:
    """An endless, per-epoch reshuffled (and repacked), prefetching iterator of this process's
    batches. Rows flow across epoch boundaries: none is dropped.

    Returns a grain ``DatasetIterator``: its ``get_state``/``set_state`` (the epoch and row of
    the next batch) make it checkpointable; resuming replans that epoch and gives the same
    batches bit for bit.
    """
    import grain

    from gemmalab.grain_batches import PackedBatchDataset

    batches = PackedBatchDataset(WindowSource(split, maxlen), rows_per_batch=rows_per_process,
                                 packing=packing, seed=seed)
    prefetched = grain.experimental.ThreadPrefetchIterDataset(batches,
                                                              prefetch_buffer_size=prefetch)
    return iter(prefetched)


def eval_batches(split: TokenizedSplit, *, maxlen: int, batch_size: int, packing: bool,
                 process_index: int = 0, process_count: int = 1) -> list[Batch]:
    """The whole eval split as fixed batches (same on every run); this process's rows of each.

    Rows are packed by the training packer (deterministic: no shuffle). Every process builds
    the same rows, padded with empty rows (no loss) to whole global batches, so all processes
    run the same number of eval steps.
    """
    windows = WindowSource(split, maxlen)
    if len(windows) == 0:
        return []
    plan = plan_rows(windows.lengths, maxlen, packing=packing)
    stacked = assemble_rows(windows, *plan.rows(0, plan.num_rows))
    total = -(-plan.num_rows // batch_size) * batch_size
    padded = {k: np.pad(v, ((0, total - len(v)), (0, 0))) for k, v in stacked.items()}
    per_process = batch_size // process_count
    batches = []
    for start in range(0, total, batch_size):
        lo = start + process_index * per_process
        batches.append({k: v[lo:lo + per_process] for k, v in padded.items()})
    return batches


def data_stats(corpus_: Corpus, cache: TokenCache, windows: WindowSource) -> dict[str, Any]:
    """What a run trains on (``summary.json``'s "data"): cache counts, windows, and for chat
    data the loss-bearing targets, conversations split over ``maxlen`` and bad records skipped.
    """
    chat = corpus_.format == CHAT
    stats = {**cache.meta, "train_windows": len(windows),
             "train_target_tokens": windows.num_targets}
    if chat:
        stats["train_loss_target_tokens"] = windows.num_loss_targets
    split_key = "conversations_split_over_maxlen" if chat else "stories_split_over_maxlen"
    stats[split_key] = windows.num_split_docs
    stats.update({"corpus_path": corpus_.path, "embedded_corpus": corpus_.embedded})
    if chat:
        stats["bad_records_skipped"] = corpus_.bad_records
    stats.pop("key", None)
    return stats


# Windows whose lengths estimate how full packed rows get: the training packer plans a million
# in ~0.1 s, so up to this many per process the estimate is exact.
FILL_SAMPLE = 1 << 20


def packed_fill(windows: WindowSource, *, seed: int = 0) -> float:
    """The share of row positions that packed rows fill with real tokens: the training packer's
    plan (``plan_rows``) of the windows' lengths, or of a sample of ``FILL_SAMPLE`` of them.
    How many rows a plan has depends only on the lengths, so every epoch fills the same:
    ~0.97 for stories at maxlen 256, but ~0.65 for 155-token conversations, of which two
    rarely fit one row."""
    lengths = windows.lengths.astype(np.int64)
    if len(lengths) == 0:
        return 1.0
    if len(lengths) > FILL_SAMPLE:
        lengths = np.random.default_rng(seed).choice(lengths, FILL_SAMPLE, replace=False)
    plan = plan_rows(lengths, windows.maxlen)
    return float(lengths.sum() / (plan.num_rows * windows.maxlen))


def steps_per_epoch(num_targets_global: int, num_windows_global: int, *, batch_size: int,
                    maxlen: int, packing: bool, fill: float = 1.0) -> int:
    """Steps that consume one epoch: in target tokens when packing, in rows when padding.

    With packing, rows hold ``fill`` real tokens per position (``packed_fill``): counting full
    rows instead would end a one-epoch run before a third of a chat dataset was read. With
    the exact fill of one process's windows this is the plan's rows over the batch, rounded up
    (the last batch is completed with the next epoch's first rows); a sampled fill, or the mean
    of several processes' shards, errs by a fraction of a percent either way: that much of an
    epoch's rows start the next epoch's stream instead, or its first ones are read twice.
    """
    if packing:
        return max(1, math.ceil(num_targets_global / (batch_size * maxlen * fill)))
    return max(1, num_windows_global // batch_size)
