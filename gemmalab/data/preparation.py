"""Data preparation for a run: corpus, tokenizer and token cache (``PreparedData``), then what the
training loop reads (``TrainingData``): the checkpointable batch iterator, the eval batches, and
the step counts every process agrees on.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from gemmalab import storage
from gemmalab.config import DataConfig, ModelConfig, TrainConfig, TrainerConfig
from gemmalab.data import documents, grain_batches, packing, token_cache
from gemmalab.data import tokenizer as tokenizers
from gemmalab.data.documents import PREFERENCES, Corpus, SplitRule
from gemmalab.data.packing import WindowSource
from gemmalab.data.token_cache import TokenCache
from gemmalab.errors import ConfigError
from gemmalab.model import presets


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """Corpus, tokenizer and token cache for a config: shared by training, data prep, sampling."""

    corpus: Corpus
    tokenizer: Any
    tokenizer_info: Any
    cache: TokenCache
    model_config: Any


def prepare_data(config: TrainConfig) -> PreparedData:
    """Validate the data and tokenizer parameters, then load or build the token cache: the data
    stage's entry for a whole (resolved) config, as data_prep.ipynb hands it over.

    A second call with the same data parameters (e.g. data_prep.ipynb then train.ipynb) reuses
    the cached tokenizer and tokens.
    """
    config.require_resolved("prepare_data")
    return prepare_tokens(config.data, config.model, config.trainer,
                          cache_dir=config.runtime.resolved_cache_dir)


def prepare_tokens(data: DataConfig, model: ModelConfig, trainer: TrainerConfig, *,
                   cache_dir: Path) -> PreparedData:
    """``prepare_data`` from the groups it reads (``model`` resolved: its preset and depth
    decided): the corpus of ``data.path`` (preference pairs for DPO, shuffled by the trainer's
    seed), the tokenizer, and the token cache under ``cache_dir``."""
    presets.check_num_layers(model.preset, model.num_layers)  # before the tokenizer's work
    storage.require_writable_directory("cache_dir", cache_dir)
    corpus = documents.resolve_corpus(
        data.path,
        cache_dir=cache_dir,
        embedded_stories=data.embedded_stories,
        seed=trainer.seed,
        skip_bad_records=data.skip_bad_records,
        preferences=trainer.objective == "dpo",
    )
    rule = SplitRule(data.eval_fraction, data.max_eval_stories,
                     jax.process_index(), jax.process_count())
    tokenizer, info = _load_tokenizer_everywhere(model, corpus, rule, datacount=data.datacount,
                                                 cache_dir=cache_dir)
    model_config = presets.model_config(model.preset, info.vocab_size, model.num_layers)
    if info.vocab_size > model_config.num_embed:
        raise ConfigError("tokenizer", f"its vocabulary ({info.vocab_size}) is larger than "
                          f"{model.preset}'s embedding ({model_config.num_embed})",
                          "use the model's own tokenizer ('gemma3') or model='gemma3-tiny'")
    cache = token_cache.load_or_build_token_cache(
        corpus, info, rule=rule, datacount=data.datacount, cache_dir=cache_dir,
        workers=data.tokenize_workers, train_on_prompt=data.train_on_prompt)
    _require_held_out_documents(cache.meta, rule)
    return PreparedData(corpus=corpus, tokenizer=tokenizer, tokenizer_info=info, cache=cache,
                        model_config=model_config)


def _require_held_out_documents(meta: dict, rule: SplitRule) -> None:
    """Every evaluation (the perplexities, the summary's eval loss) would read NaN for the whole
    run: refused before any model work."""
    if meta["eval_docs"] == 0:
        read = meta["stories_read"]
        raise ConfigError("eval_fraction", f"holds out none of the {read} documents read (one in "
                          f"{rule.eval_period} is held out)",
                          f"use eval_fraction >= {1 / max(read, 2):.3g}, or more data")


def _load_tokenizer_everywhere(model: ModelConfig, corpus: Corpus, rule: SplitRule, *,
                               datacount: int | None, cache_dir: Path) -> tuple[Any, Any]:
    """Load ``model.tokenizer`` (or train the local one on the first ``datacount`` training
    documents, on process 0 only, then share it)."""
    def load(stories_allowed: bool):
        stories = (
            documents.training_stories(corpus.path, rule, datacount, corpus.format)
            if stories_allowed
            else None
        )
        return tokenizers.load_tokenizer(
            model.tokenizer,
            cache_dir=cache_dir,
            training_stories=stories,
            vocab_size=model.tokenizer_vocab_size,
            corpus_fingerprint=corpus.fingerprint,
        )

    if model.tokenizer != "local" or jax.process_count() == 1:
        return load(True)
    # Several processes: one trains, the others receive the identical model over JAX's runtime.
    from jax.experimental import multihost_utils

    proto = load(True)[1].model_proto if jax.process_index() == 0 else b""
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(proto))))
    buffer = np.frombuffer(proto.ljust(size, b"\0"), np.uint8)
    proto = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer)))
    path = tokenizers.local_tokenizer_path(cache_dir, corpus.fingerprint,
                                           model.tokenizer_vocab_size)
    if jax.process_index() != 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(proto)
    multihost_utils.sync_global_devices("gemmalab-tokenizer")
    return load(False)


@dataclasses.dataclass
class TrainingData:
    """What the loop reads: this process's endless, checkpointable batch iterator and eval
    batches, the step counts (the same on every process) and the data table (``stats``)."""

    train_iterator: Any
    eval_batches: list[dict[str, np.ndarray]]
    steps_per_epoch: int
    total_steps: int
    stats: dict[str, Any]
    # The most segments a row can hold, for preference data (each pair is two): the bound the
    # per-segment loss is compiled for. 0 for other data.
    max_segments: int = 0


def training_data(prepared: PreparedData, data: DataConfig, trainer: TrainerConfig
                  ) -> TrainingData:
    """Windows, packing fill and step counts of the train split (rows of ``data.maxlen``,
    ``trainer``'s batch, seed and length); its batches and the eval's."""
    cache = prepared.cache
    if cache.train.group > 1:
        _require_pairs_fit(cache, data.maxlen)
    windows = WindowSource(cache.train, data.maxlen)
    fill = packing.packed_fill(windows, seed=trainer.seed) if data.packing else 1.0
    # Every process must count the same steps: totals and the mean fill of all shards.
    local = np.asarray([windows.num_targets, windows.num_units, round(fill * 1e6)], np.int64)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        local = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, 3)
        local = np.asarray([*local[:, :2].sum(0), local[:, 2].mean()])
    per_epoch = packing.steps_per_epoch(
        int(local[0]),
        int(local[1]),
        batch_size=trainer.batch_size,
        maxlen=data.maxlen,
        packing=data.packing,
        fill=float(local[2]) / 1e6,
    )
    total_steps = (trainer.max_steps if trainer.max_steps is not None
                   else per_epoch * trainer.num_epochs)
    iterator = grain_batches.train_batches(
        cache.train,
        maxlen=data.maxlen,
        packing=data.packing,
        seed=trainer.seed,
        rows_per_process=trainer.batch_size // jax.process_count(),
    )
    evals = packing.eval_batches(
        cache.eval,
        maxlen=data.maxlen,
        batch_size=trainer.batch_size,
        packing=data.packing,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    stats = {"tokenizer": prepared.tokenizer_info.name,
             **data_stats(prepared.corpus, cache, windows), "packed_fill": round(fill, 4)}
    return TrainingData(train_iterator=iterator, eval_batches=evals, steps_per_epoch=per_epoch,
                        total_steps=total_steps, stats=stats,
                        max_segments=_max_segments(windows, cache, data.maxlen, data.packing))


def _max_segments(windows: WindowSource, cache: TokenCache, maxlen: int, packing: bool) -> int:
    """For preference data, the most segments any row of any process can hold: two per pair,
    as many pairs as the process's shortest ones fit in ``maxlen`` (rows never mix processes'
    pairs), one without packing. The bound the per-segment loss is compiled for: every process
    must agree on it. 0 for other data."""
    if windows.group == 1:
        return 0
    most = 1
    if packing:
        lengths = np.sort(np.concatenate([windows.unit_lengths,
                                          WindowSource(cache.eval, maxlen).unit_lengths]))
        most = max(1, int(np.searchsorted(np.cumsum(lengths), maxlen, side="right")))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        most = int(np.max(multihost_utils.process_allgather(np.asarray([most], np.int64))))
    return windows.group * most


def _require_pairs_fit(cache: TokenCache, maxlen: int) -> None:
    """Preference data: every process refuses (with the same one-line error) when any
    process's pair exceeds ``maxlen``, rather than one process stopping while the others wait
    for it in a collective."""
    totals = np.concatenate([packing.unit_pairs(split.lengths, split.group)
                             for split in (cache.train, cache.eval)])
    local = np.asarray([np.sum(totals > maxlen), len(totals), totals.max(initial=0)], np.int64)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        found = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, 3)
        local = np.asarray([*found[:, :2].sum(axis=0), found[:, 2].max()])
    packing.require_units_fit(*(int(v) for v in local), maxlen)


def data_stats(corpus_: Corpus, cache: TokenCache, windows: WindowSource) -> dict[str, Any]:
    """What a run trains on (``summary.json``'s "data"): cache counts, windows, and for chat
    data the loss-bearing targets, conversations split over ``maxlen`` and bad records skipped.
    """
    chat = corpus_.conversational
    stats = {**cache.meta, "train_windows": len(windows),
             "train_target_tokens": windows.num_targets}
    if chat:
        stats["train_loss_target_tokens"] = windows.num_loss_targets
    if corpus_.format != PREFERENCES:  # pairs are never split (WindowSource refuses them)
        split_key = "conversations_split_over_maxlen" if chat else "stories_split_over_maxlen"
        stats[split_key] = windows.num_split_docs
    stats.update({"corpus_path": corpus_.path, "embedded_corpus": corpus_.embedded})
    if chat:
        stats["bad_records_skipped"] = corpus_.bad_records
    stats.pop("key", None)
    return stats
