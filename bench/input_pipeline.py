"""Input pipelines side by side, in one process: token cache (or text) to device-ready batches.

    .venv/bin/python bench/input_pipeline.py            # ~1-2 min on 2 cores

On the embedded corpus (built, tokenized and cached on first use, as ``make demo`` does),
batches of ``--batch`` rows x ``--maxlen``, each pipeline pinned to one core, no prefetch
thread (the rate one core sustains, not one hidden behind a queue):

- ``tutorial``: the tutorial's loader, re-expressed: every story SentencePiece-encoded inside
  the loader each epoch (no BOS/EOS), truncated and zero-padded to ``maxlen``, one story per row;
- ``grain best-fit``: the previous gemmalab path: grain's ``BestFitPackIterDataset`` with 1,024
  open rows over shuffled, repeated windows of the token cache;
- ``plan + gather``: ``gemmalab.data.packing`` (what ``grain_batches.train_batches`` runs): a
  best-fit decreasing plan per epoch, rows gathered from the memory-mapped cache in bulk;

then the last one under grain's ``mp_prefetch`` with 1 … ``--max-workers`` worker processes
(all cores; the batches built in shared memory).

Row tokens are the positions a step consumes (rows x maxlen); useful tokens are the targets
that bear loss (the tutorial's rows: the story's next-token pairs, which it does not mask).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np

from gemmalab.data import documents, packing, token_cache

# The tutorial's published step on one v6e chip: 294.7 s for 750 steps of 128 x 256.
TUTORIAL_STEP_S = 294.7 / 750


def tutorial_batches(stories: list[str], model_proto: bytes, *, maxlen: int, batch: int,
                     seed: int) -> Iterator[dict[str, np.ndarray]]:
    """The tutorial's loader: tokenized in the loop, every epoch; truncated, padded with 0."""
    import grain
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(model_proto)

    def row(story: str) -> np.ndarray:
        ids = processor.EncodeAsIds(story)[:maxlen]
        return np.asarray(ids + [0] * (maxlen - len(ids)), np.int32)

    rows = grain.MapDataset.source(stories).shuffle(seed=seed).repeat(None).map(row)
    for tokens in rows.to_iter_dataset().batch(batch, drop_remainder=True):
        # Targets shifted by one with 0 after the last token (the tutorial does this on device).
        targets = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
        real = tokens > 0
        # The tutorial puts loss on every position; only real next-token pairs are useful.
        yield {"tokens": tokens, "targets": targets, "loss_mask": (real & (targets > 0))
               .astype(np.int32), "segment_ids": real.astype(np.int32)}


def grain_best_fit_batches(split: token_cache.TokenizedSplit, *, maxlen: int, batch: int, seed: int
                           ) -> Iterator[dict[str, np.ndarray]]:
    """gemmalab before ``gemmalab.data.packing``: grain's best-fit packer, 1,024 open rows."""
    import grain

    def rows(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        real = packed["inputs_segment_ids"] > 0
        return {"tokens": packed["inputs"].astype(np.int32),
                "targets": packed["targets"].astype(np.int32),
                "segment_ids": packed["inputs_segment_ids"].astype(np.int32),
                "positions": packed["inputs_positions"].astype(np.int32),
                "loss_mask": (packed["loss_mask"] * real).astype(np.int32)}

    windows = grain.MapDataset.source(packing.WindowSource(split, maxlen)).shuffle(seed=seed)
    packed = grain.experimental.BestFitPackIterDataset(
        windows.repeat(None).to_iter_dataset(),
        length_struct={"inputs": maxlen, "targets": maxlen, "loss_mask": maxlen},
        num_packing_bins=1024, seed=seed, shuffle_bins=True)
    return iter(packed.map(rows).batch(batch, drop_remainder=True))


def new_batches(split: token_cache.TokenizedSplit, *, maxlen: int, batch: int, seed: int,
                workers: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """``gemmalab.data.packing`` as ``grain_batches.train_batches`` builds it, without its prefetch
    thread; ``workers``: under grain's ``mp_prefetch`` with that many processes."""
    from gemmalab.data.grain_batches import PackedBatchDataset

    dataset = PackedBatchDataset(packing.WindowSource(split, maxlen), rows_per_batch=batch,
                                 packing=True, seed=seed)
    if workers is None:
        return iter(dataset)
    import grain

    options = grain.multiprocessing.MultiprocessingOptions(num_workers=workers,
                                                           per_worker_buffer_size=4)
    return iter(dataset.mp_prefetch(options))


def measure(make: Callable[[], Iterator[dict[str, np.ndarray]]], seconds: float
            ) -> dict[str, float]:
    """Batches per second after the first (start-up, first plan or bins filling), for about
    ``seconds``, with row, real and loss-bearing token counts."""
    iterator = make()
    next(iterator)
    count = rows = real = useful = 0
    started = time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds or count < 3:
        batch = next(iterator)
        count += 1
        rows += batch["tokens"].size
        real += int(np.count_nonzero(batch["segment_ids"]))
        useful += int(batch["loss_mask"].sum())
    if hasattr(iterator, "close"):
        iterator.close()
    return {"batches": count, "ms_per_batch": 1e3 * elapsed / count, "row_tps": rows / elapsed,
            "useful_tps": useful / elapsed, "fill": real / rows}


def plan_seconds(windows: int, maxlen: int) -> float:
    """One epoch's plan for ``windows`` story-like windows (TinyStories: ~2M per epoch)."""
    lengths = np.random.default_rng(0).normal(128, 17, windows).clip(1, maxlen).astype(np.int64)
    started = time.perf_counter()
    packing.plan_rows(lengths, maxlen, seed=0, epoch=0)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--maxlen", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=8.0, help="per measurement")
    parser.add_argument("--max-workers", type=int, default=os.cpu_count() or 1,
                        help="mp_prefetch with 1..this many worker processes")
    parser.add_argument("--cache-dir", default="", help="'' = gemmalab's default cache")
    args = parser.parse_args()

    from absl import flags

    flags.FLAGS.mark_as_parsed()  # grain's worker processes read absl flags
    from gemmalab.config import TrainConfig
    from gemmalab.data.preparation import prepare_data
    from gemmalab.weights import resolution

    config = resolution.resolve(TrainConfig.flat(cache_dir=args.cache_dir,
                                                 maxlen=args.maxlen)).config
    prepared = prepare_data(config)
    split = prepared.cache.train
    rule = documents.SplitRule(config.data.eval_fraction, config.data.max_eval_stories)
    stories = list(documents.training_stories(prepared.corpus.path, rule, config.data.datacount))
    windows = packing.WindowSource(split, args.maxlen)
    print(f"embedded corpus: {len(stories):,} train stories, {len(windows):,} windows, "
          f"{windows.num_targets:,} targets; batch {args.batch} x {args.maxlen}; "
          f"{os.cpu_count()} CPUs")

    shape = dict(maxlen=args.maxlen, batch=args.batch, seed=0)
    all_cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(all_cpus)})  # one core: its threads and all
    results = {
        "tutorial (tokenize + pad in the loader)": measure(
            lambda: tutorial_batches(stories, prepared.tokenizer_info.model_proto, **shape),
            args.seconds),
        "grain best-fit, 1,024 bins (before)": measure(
            lambda: grain_best_fit_batches(split, **shape), args.seconds),
        "plan + gather (gemmalab.data.packing)": measure(lambda: new_batches(split, **shape),
                                                         args.seconds),
    }
    os.sched_setaffinity(0, all_cpus)
    # Under mp_prefetch worker i makes batches i, i + n, … (set_slice), straight into shared
    # memory (enable_shared_memory_output). Each batch's hand-off (shared memory blocks made,
    # mapped, unlinked) costs more than building it, so one in-process thread beats a worker;
    # the workers show how the rate scales with processes. train_batches uses the thread.
    for workers in range(1, args.max_workers + 1):
        results[f"plan + gather, mp_prefetch {workers} worker(s), all cores"] = measure(
            lambda w=workers: new_batches(split, **shape, workers=w), args.seconds)

    base = results["tutorial (tokenize + pad in the loader)"]["row_tps"]
    print(f"\n| pipeline | row tokens/s | useful tokens/s | fill | ms per batch | "
          f"share of a {TUTORIAL_STEP_S * 1e3:.0f} ms step | vs tutorial |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['row_tps'] / 1e6:,.2f}M | {r['useful_tps'] / 1e6:,.2f}M | "
              f"{r['fill']:.1%} | {r['ms_per_batch']:.2f} | "
              f"{r['ms_per_batch'] / 1e3 / TUTORIAL_STEP_S:.2%} | {r['row_tps'] / base:,.1f}x |")
    for count in (len(windows), 2_000_000):
        print(f"\none epoch's plan, {count:,} story-like windows: "
              f"{plan_seconds(count, args.maxlen) * 1e3:,.0f} ms")
    print(f"\ncommand: .venv/bin/python {' '.join(sys.argv)}")


if __name__ == "__main__":  # grain's worker processes are spawned: they re-import this file
    main()
