"""How stories become rows: truncation and padding costs at several ``maxlen`` (data_prep.ipynb).

Three layouts are compared on the tokenized stories (BOS + tokens + EOS):

- ``truncate`` — the tutorial's: one story per row, cut at ``maxlen``, padded;
- ``split`` — gemmalab with ``packing=False``: one story per row, long stories split into several
  rows (nothing lost), padded;
- ``pack`` — gemmalab with ``packing=True``: best-fit packing of (split) stories into rows.

For chat data: rows with the loss-bearing targets marked, prompt vs response token counts, and
what ``maxlen`` cuts. For preference pairs (DPO): the pair's token counts and the ``maxlen`` that
holds them (a pair is never cut).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gemmalab.data import token_cache
from gemmalab.data.packing import WindowSource, eval_batches, plan_rows, unit_pairs

PACKING_SAMPLE = 4_000


def _lengths_split(lengths: np.ndarray) -> token_cache.TokenizedSplit:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return token_cache.TokenizedSplit(tokens=np.ones(int(offsets[-1]), np.int32), offsets=offsets)


def packed_real_share(lengths: np.ndarray, maxlen: int) -> float:
    """Share of real (loss-bearing) positions in rows packed exactly as training packs them."""
    windows = WindowSource(_lengths_split(lengths), maxlen)
    plan = plan_rows(windows.lengths, maxlen)
    return windows.num_targets / (plan.num_rows * maxlen) if plan.num_rows else 1.0


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


TARGET_OPEN, TARGET_CLOSE = "⟦", "⟧"  # around the tokens that bear loss (mark_targets)


def render_row(tokenizer: Any, tokens: np.ndarray, targets: np.ndarray,
               segment_ids: np.ndarray, loss_mask: np.ndarray | None = None) -> str:
    """A row as text with special tokens visible: ``<bos>``, ``<eos>``, ``<pad>×N`` (and the
    chat template's ``<start_of_turn>``/``<end_of_turn>``).

    Each segment is shown as its first input followed by its targets, so a whole story reads
    ``<bos>…<eos>`` (the final EOS is a target, never an input). With ``loss_mask`` the targets
    that bear loss are wrapped in ``⟦…⟧``: in a chat row, the model's replies.
    """
    names = _special_names(tokenizer)
    parts: list[str] = []
    for segment in dict.fromkeys(segment_ids[segment_ids > 0].tolist()):
        where = np.flatnonzero(segment_ids == segment)
        ids = [int(tokens[where[0]]), *targets[where].tolist()]
        marked = [False, *(loss_mask[where] > 0 if loss_mask is not None else [False] * len(where))]
        parts.append(_render_ids(tokenizer, ids, marked, names))
    padding = int(np.sum(segment_ids == 0))
    if padding:
        parts.append(f"<pad>×{padding}")
    return "".join(parts)


def _special_names(tokenizer: Any) -> dict[int, str]:
    specials = tokenizer.special_tokens
    names = {"PAD": "<pad>", "BOS": "<bos>", "EOS": "<eos>", "START_OF_TURN": "<start_of_turn>",
             "END_OF_TURN": "<end_of_turn>"}
    return {int(getattr(specials, key)): name for key, name in names.items()
            if hasattr(specials, key)}


def _render_ids(tokenizer: Any, ids: list[int], marked: list[bool], names: dict[int, str]) -> str:
    """Runs of ordinary tokens decoded together; special tokens by name; marked runs in ⟦…⟧."""
    parts: list[str] = []
    run: list[int] = []
    inside = False
    for token, mark in zip([*ids, None], [*marked, False], strict=True):
        if run and (token is None or token in names or mark != inside):
            parts.append(tokenizer.decode(run))
            run = []
        if mark != inside:
            parts.append(TARGET_OPEN if mark else TARGET_CLOSE)
            inside = mark
        if token in names:
            parts.append(names[token])
        elif token is not None:
            run.append(token)
    return "".join(parts)


def example_rows(tokenizer: Any, split: token_cache.TokenizedSplit, *, maxlen: int, packing: bool,
                 count: int = 2, mark_targets: bool = False) -> list[str]:
    """The first ``count`` rows of the eval layout, rendered with ``render_row`` (the targets
    that bear loss in ``⟦…⟧`` with ``mark_targets``)."""
    batches = eval_batches(split, maxlen=maxlen, batch_size=count, packing=packing)
    if not batches:
        return []
    batch = batches[0]
    return [render_row(tokenizer, batch["tokens"][i], batch["targets"][i], batch["segment_ids"][i],
                       batch["loss_mask"][i] if mark_targets else None)
            for i in range(len(batch["tokens"]))]


# ---------------------------------------------------------------------------------------------
# Chat data: prompts vs responses.

CHAT_SAMPLE = 20_000  # conversations the splitting table looks at (it reads their masks)


def response_lengths(split: token_cache.TokenizedSplit) -> tuple[np.ndarray, np.ndarray]:
    """Per conversation: tokens outside the model's turns (BOS, headers, user text) and in them
    (the targets that bear loss without ``train_on_prompt``)."""
    lengths = split.lengths
    if split.response_mask is None or not len(lengths):
        return lengths, np.zeros_like(lengths)
    sums = np.add.reduceat(np.asarray(split.response_mask, np.int64), split.offsets[:-1])
    response = np.where(lengths > 0, sums, 0)
    return lengths - response, response


def chat_token_table(split: token_cache.TokenizedSplit) -> Any:
    """Token counts of prompts vs responses per conversation (pandas)."""
    import pandas as pd

    rows = {}
    for name, counts in zip(("prompt (no loss)", "response (loss)"), response_lengths(split),
                            strict=True):
        rows[name] = {"total": int(counts.sum()), "mean": float(np.mean(counts)),
                      "median": float(np.median(counts)),
                      "95th percentile": float(np.percentile(counts, 95)),
                      "longest": int(np.max(counts))}
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.insert(1, "share", table["total"] / table["total"].sum())
    return table.rename_axis("tokens per conversation")


def chat_split_table(split: token_cache.TokenizedSplit, maxlens: list[int]) -> Any:
    """Per ``maxlen``: conversations too long for one row (cut into windows, never dropped),
    windows left without a loss-bearing target, and response tokens that train without the
    start of their conversation in view (pandas; the first ``CHAT_SAMPLE`` conversations)."""
    import pandas as pd

    head = _first_docs(split, CHAT_SAMPLE)
    mask = head.loss_mask
    bearing = (np.ones(len(head.tokens), np.int64) if mask is None
               else np.asarray(mask, np.int64))
    cumulative = np.concatenate([[0], np.cumsum(bearing)])
    records = []
    for maxlen in maxlens:
        windows = WindowSource(head, maxlen)
        # Targets of a window are tokens start+1 .. end-1.
        per_window = cumulative[windows.end] - cumulative[windows.start + 1]
        later = windows.start != head.offsets[windows.doc]
        records.append({
            "maxlen": maxlen,
            "conversations over maxlen": windows.num_split_docs,
            "windows": len(windows),
            "windows without a loss target": int(np.sum(per_window == 0)),
            "loss targets cut from their conversation's start": float(
                per_window[later].sum() / max(1, per_window.sum())),
        })
    return pd.DataFrame.from_records(records).set_index("maxlen")


def preference_table(split: token_cache.TokenizedSplit, maxlens: list[int]) -> Any:
    """Preference pairs (documents chosen, rejected, chosen, ...): tokens per pair of the prompt
    (each side has it), of each reply (the loss-bearing targets) and of the pair's row, then per
    ``maxlen`` the share of pairs one row holds (the rest are refused: a pair is never cut)
    (pandas: two tables)."""
    import pandas as pd

    prompt, response = response_lengths(split)
    pair = unit_pairs(split.lengths, 2)
    parts = {"prompt (each side, no loss)": prompt[0::2], "chosen reply (loss)": response[0::2],
             "rejected reply (loss)": response[1::2], "pair in one row": pair}
    tokens = pd.DataFrame.from_dict(
        {name: {"mean": float(np.mean(c)), "median": float(np.median(c)),
                "95th percentile": float(np.percentile(c, 95)), "longest": int(np.max(c))}
         for name, c in parts.items()}, orient="index").rename_axis("tokens per pair")
    records = []
    for maxlen in maxlens:
        fit = pair[pair <= maxlen]
        rows = plan_rows(fit, maxlen).num_rows if len(fit) else 0
        records.append({"maxlen": maxlen, "pairs that fit": float(np.mean(pair <= maxlen)),
                        "pairs per packed row": len(fit) / rows if rows else float("nan"),
                        "row positions filled": float(fit.sum()) / (rows * maxlen) if rows
                        else float("nan")})
    return tokens, pd.DataFrame.from_records(records).set_index("maxlen")


def _first_docs(split: token_cache.TokenizedSplit, count: int) -> token_cache.TokenizedSplit:
    offsets = split.offsets[:count + 1]
    end = int(offsets[-1])
    mask = None if split.response_mask is None else split.response_mask[:end]
    return token_cache.TokenizedSplit(tokens=split.tokens[:end], offsets=offsets,
                                      response_mask=mask, train_on_prompt=split.train_on_prompt)


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


def corpus_summary(cache: token_cache.TokenCache) -> Any:
    """Story and token counts, and length percentiles, of the tokenized corpus (pandas)."""
    import pandas as pd

    lengths = cache.train.lengths
    meta = cache.meta
    unit = "pairs" if cache.train.group == 2 else "stories"  # a pair is two documents
    per_unit = cache.train.group
    values = {
        f"{unit} read": meta["stories_read"],
        f"train {unit} (this process)": meta["train_docs"] // per_unit,
        f"eval {unit}": meta["eval_docs"] // per_unit,
        "train tokens": meta["train_tokens"],
        "eval tokens": meta["eval_tokens"],
        "mean tokens per " + ("story" if per_unit == 1 else "side (prompt and one reply)"):
            float(np.mean(lengths)),
        "median": float(np.median(lengths)),
        "95th percentile": float(np.percentile(lengths, 95)),
        "longest": int(np.max(lengths)),
    }
    return pd.DataFrame({"value": pd.Series(values, dtype=object)}).rename_axis("corpus")
