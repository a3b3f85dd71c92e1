"""The token cache: each split tokenized once as BOS + ids + EOS in worker processes, on disk.

Chat data is cached with a per-token loss mask beside its tokens (only the model's turns bear
loss unless ``train_on_prompt``). A preference pair is cached as two chat documents in a row,
chosen then rejected (``TokenizedSplit.group`` 2): the packer keeps them in one row.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import mmap
import multiprocessing
import os
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np

from gemmalab.data.documents import PREFERENCES, Corpus, SplitRule, labelled_documents
from gemmalab.data.tokenizer import (
    TokenizerInfo,
    encode_conversations,
    encode_pairs,
    encode_stories,
    init_encoder,
)
from gemmalab.errors import ConfigError

CACHE_FORMAT_VERSION = 2  # 2: chat data, with a loss mask beside its tokens

STORIES_PER_TASK = 256

MAX_TOKENIZE_WORKERS = 32  # TPU hosts have 100+ vCPUs; beyond this, reading the file is the limit


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
    # Consecutive documents that form one unit, packed into one row together: 2 for preference
    # pairs (document 2k chosen, 2k + 1 rejected), else 1.
    group: int = 1

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
                                  _file_or_array(self.response_mask), self.train_on_prompt,
                                  self.group))


def _file_or_array(array: np.ndarray | None) -> Any:
    if isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap):  # a whole file
        return (array.filename, array.dtype.str)
    return array


def _reopened_split(tokens: Any, offsets: np.ndarray, mask: Any, train_on_prompt: bool,
                    group: int = 1) -> TokenizedSplit:
    def opened(array: Any) -> Any:
        return np.memmap(array[0], dtype=array[1], mode="r") if isinstance(array, tuple) else array

    return TokenizedSplit(opened(tokens), offsets, opened(mask), train_on_prompt, group)


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
    if corpus_.format == PREFERENCES:  # one file may parse as chat and as pairs (bad skipped)
        key_fields["format"] = PREFERENCES
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:20]
    directory = cache_dir / "tokens" / key
    if not (directory / "meta.json").exists():
        _build_token_cache(corpus_, tokenizer, rule=rule, datacount=datacount,
                           directory=directory, workers=workers, key_fields=key_fields)
    meta = json.loads((directory / "meta.json").read_text())
    if datacount is not None and meta["stories_read"] < datacount:
        warnings.warn(f"datacount={datacount} but {corpus_.path} has only "
                      f"{meta['stories_read']} stories: using all of them", stacklevel=2)
    group = 2 if meta.get("data_format") == PREFERENCES else 1
    return TokenCache(train=_open_split(directory, "train", train_on_prompt, group),
                      eval=_open_split(directory, "eval", train_on_prompt, group), meta=meta)


def _open_split(directory: Path, name: str, train_on_prompt: bool, group: int = 1
                ) -> TokenizedSplit:
    offsets = np.load(directory / f"{name}_offsets.npy")

    def mapped(suffix: str, dtype: Any) -> np.ndarray:
        return (np.memmap(directory / f"{name}_{suffix}.bin", dtype=dtype, mode="r")
                if offsets[-1] > 0 else np.zeros(0, dtype))

    mask = mapped("mask", np.uint8) if (directory / f"{name}_mask.bin").exists() else None
    return TokenizedSplit(tokens=mapped("tokens", np.int32), offsets=offsets,
                          response_mask=mask, train_on_prompt=train_on_prompt, group=group)


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

    def add(self, encoded: np.ndarray | tuple[np.ndarray, np.ndarray] | list) -> None:
        if isinstance(encoded, list):  # a preference pair's two documents, chosen first
            for document in encoded:
                self.add(document)
            return
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
    chat = corpus_.conversational
    writers = {name: _SplitWriter(tmp, name, with_mask=chat) for name in ("train", "eval")}
    labelled = labelled_documents(corpus_.path, corpus_.format, rule, datacount)
    encode = {PREFERENCES: encode_pairs}.get(
        corpus_.format, encode_conversations if chat else encode_stories)
    for label, encoded in _tokenize_in_order(iter(labelled), tokenizer.model_proto, workers,
                                             encode):
        writers[label].add(encoded)
    meta = {**writers["train"].close(), **writers["eval"].close(), "stories_read": labelled.read,
            "corpus_path": corpus_.path, "tokenizer": tokenizer.name, "key": key_fields}
    if chat:
        meta["data_format"] = corpus_.format
    if corpus_.format == PREFERENCES:
        meta.update(train_pairs=meta["train_docs"] // 2, eval_pairs=meta["eval_docs"] // 2)
    if meta["train_docs"] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError("datacount" if datacount else "data_path",
                          f"no training stories left for process {rule.process_index} after "
                          f"holding out eval stories ({labelled.read} read)",
                          "use more stories (datacount/data) or fewer processes")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)


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
    # spawn, not fork: the parent may hold JAX's threads. concurrent.futures, not
    # multiprocessing.Pool: a worker that dies (killed for memory) breaks the pool and every
    # pending result raises, where Pool would wait for that result forever.
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=init_encoder, initargs=(model_proto,))
    in_flight: collections.deque = collections.deque()
    try:
        for labels, stories in tasks:
            in_flight.append((labels, pool.submit(encode, stories)))
            if len(in_flight) >= 4 * workers:  # backpressure: never read ahead of the workers
                done_labels, result = in_flight.popleft()
                yield from zip(done_labels, result.result(), strict=True)
        while in_flight:
            done_labels, result = in_flight.popleft()
            yield from zip(done_labels, result.result(), strict=True)
    except BrokenProcessPool:
        raise ConfigError("tokenize_workers", "a tokenizing worker process died (out of memory?)",
                          "give the run more memory, or set tokenize_workers=1 to tokenize in "
                          "the main process") from None
    finally:  # a consumer that stops early (or an error) leaves no task running
        pool.shutdown(wait=True, cancel_futures=True)


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
