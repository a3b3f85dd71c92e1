"""How stories become rows: truncation and padding costs at several ``maxlen`` (data_prep.ipynb).

Three layouts are compared on the tokenized stories (BOS + tokens + EOS):

- ``truncate`` — the tutorial's: one story per row, cut at ``maxlen``, padded;
- ``split`` — gemmalab with ``packing=False``: one story per row, long stories split into several
  rows (nothing lost), padded;
- ``pack`` — gemmalab with ``packing=True``: best-fit packing of (split) stories into rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gemmalab import data

PACKING_SAMPLE = 4_000


def _lengths_split(lengths: np.ndarray) -> data.TokenizedSplit:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return data.TokenizedSplit(tokens=np.ones(int(offsets[-1]), np.int32), offsets=offsets)


def packed_real_share(lengths: np.ndarray, maxlen: int) -> float:
    """Share of real (loss-bearing) positions in rows packed exactly as training packs them."""
    split = _lengths_split(lengths)
    windows = data.WindowSource(split, maxlen)
    import grain

    rows = data.rows_dataset(grain.MapDataset.source(windows).to_iter_dataset(), maxlen=maxlen,
                      packing=True, num_bins=data.PACKING_BINS, seed=0, shuffle_bins=False)
    real = total = 0
    for row in rows:
        real += int((row["segment_ids"] > 0).sum())
        total += maxlen
    return real / total


def layout_table(lengths: np.ndarray, maxlens: list[int], *, seed: int = 0) -> Any:
    """One row per ``maxlen``: tokens lost and padding wasted by each layout (pandas)."""
    import pandas as pd

    lengths = np.asarray(lengths, np.int64)
    pairs = np.maximum(lengths - 1, 0)  # next-token targets per story
    rng = np.random.default_rng(seed)
    sample = (lengths if len(lengths) <= PACKING_SAMPLE
              else rng.choice(lengths, PACKING_SAMPLE, replace=False))
    records = []
    for maxlen in maxlens:
        kept = np.minimum(pairs, maxlen)
        split_rows = int(np.sum(-(-pairs // maxlen)))
        records.append({
            "maxlen": maxlen,
            "stories over maxlen": float(np.mean(pairs > maxlen)),
            "truncate: tokens lost": float(1 - kept.sum() / pairs.sum()),
            "truncate: padding": float(1 - kept.sum() / (len(pairs) * maxlen)),
            "split: tokens lost": 0.0,
            "split: padding": float(1 - pairs.sum() / (split_rows * maxlen)),
            "pack: tokens lost": 0.0,
            "pack: padding": 1 - packed_real_share(sample, maxlen),
        })
    return pd.DataFrame.from_records(records).set_index("maxlen")


def render_row(tokenizer: Any, tokens: np.ndarray, targets: np.ndarray,
               segment_ids: np.ndarray) -> str:
    """A row as text with special tokens visible: ``<bos>``, ``<eos>``, ``<pad>×N``.

    Each segment is shown as its first input followed by its targets, so a whole story reads
    ``<bos>…<eos>`` (the final EOS is a target, never an input).
    """
    special = {int(tokenizer.special_tokens.PAD): "<pad>", int(tokenizer.special_tokens.BOS):
               "<bos>", int(tokenizer.special_tokens.EOS): "<eos>"}
    parts: list[str] = []
    for segment in dict.fromkeys(segment_ids[segment_ids > 0].tolist()):
        where = np.flatnonzero(segment_ids == segment)
        ids = [int(tokens[where[0]]), *targets[where].tolist()]
        run: list[int] = []
        for token in ids:
            if token in special:
                if run:
                    parts.append(tokenizer.decode(run))
                    run = []
                parts.append(special[token])
            else:
                run.append(token)
        if run:
            parts.append(tokenizer.decode(run))
    padding = int(np.sum(segment_ids == 0))
    if padding:
        parts.append(f"<pad>×{padding}")
    return "".join(parts)


def example_rows(tokenizer: Any, split: data.TokenizedSplit, *, maxlen: int, packing: bool,
                 count: int = 2) -> list[str]:
    """The first ``count`` rows of the eval layout, rendered with ``render_row``."""
    batches = data.eval_batches(split, maxlen=maxlen, batch_size=count, packing=packing)
    if not batches:
        return []
    batch = batches[0]
    return [render_row(tokenizer, batch["tokens"][i], batch["targets"][i], batch["segment_ids"][i])
            for i in range(len(batch["tokens"]))]


def length_figure(lengths: np.ndarray, maxlen: int) -> Any:
    """Histogram of story lengths in tokens, with ``maxlen`` marked."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3))
    axis.hist(lengths, bins=60, color="tab:blue", alpha=0.8)
    axis.axvline(maxlen, color="tab:red", ls="--", label=f"maxlen {maxlen}")
    axis.set_xlabel("tokens per story (BOS + text + EOS)")
    axis.set_ylabel("stories")
    axis.legend()
    figure.tight_layout()
    return figure


def corpus_summary(cache: data.TokenCache) -> Any:
    """Story and token counts, and length percentiles, of the tokenized corpus (pandas)."""
    import pandas as pd

    lengths = cache.train.lengths
    meta = cache.meta
    values = {
        "stories read": meta["stories_read"],
        "train stories (this process)": meta["train_docs"],
        "eval stories": meta["eval_docs"],
        "train tokens": meta["train_tokens"],
        "eval tokens": meta["eval_tokens"],
        "mean tokens per story": float(np.mean(lengths)),
        "median": float(np.median(lengths)),
        "95th percentile": float(np.percentile(lengths, 95)),
        "longest": int(np.max(lengths)),
    }
    return pd.DataFrame({"value": pd.Series(values, dtype=object)}).rename_axis("corpus")
