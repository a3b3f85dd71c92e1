"""Rows from windows: a packing plan per epoch, rows gathered from the token cache in bulk.

A plan says which windows make each row. It is computed once per epoch in numpy from the
windows' lengths alone: the windows are permuted with a seed derived from (seed, epoch), sorted
by length (stable, so equal lengths keep that random order) and packed best-fit decreasing into
rows of ``maxlen``; the rows are then shuffled. Equal-length windows are placed a whole group at
a time (see ``_best_fit_decreasing``: ~10 ms for two million windows), so the two sorts cost
most of a plan, ~0.25 µs per window: an epoch of two million windows (TinyStories) is planned
in ~0.5 s, once per epoch, in the prefetch thread.

A batch's rows are then assembled with a handful of vectorised gathers from the (memory-mapped)
cache for all its windows at once; ``BatchStream`` walks the plans epoch after epoch with a
checkpointable position. Nothing here imports grain (``gemmalab.data.grain_batches`` wraps it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gemmalab.data.token_cache import TokenizedSplit

# A batch's fields, each int32 [rows, maxlen]. ``loss_mask`` marks the targets that bear loss
# (never padding; for chat data only the model's turns unless train_on_prompt).
FIELDS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
Batch = dict[str, np.ndarray]
# Makes a zero-filled int32 array of a shape: np.zeros, or one in shared memory for grain's
# worker processes (gemmalab.data.grain_batches).
Allocate = Callable[[tuple[int, ...]], np.ndarray]


def _zeros(shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros(shape, np.int32)


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Row ``r`` holds windows ``window_ids[row_starts[r]:row_starts[r + 1]]``, in that order
    (compressed sparse rows: two flat arrays however many windows there are)."""

    row_starts: np.ndarray  # int64 [rows + 1]
    window_ids: np.ndarray  # int64 [windows]

    @property
    def num_rows(self) -> int:
        return len(self.row_starts) - 1

    def rows(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``lo:hi`` as (windows per row, window ids)."""
        starts = self.row_starts[lo:hi + 1]
        return np.diff(starts), self.window_ids[starts[0]:starts[-1]]


def plan_rows(lengths: np.ndarray, maxlen: int, *, packing: bool = True, seed: int | None = None,
              epoch: int = 0) -> RowPlan:
    """Which windows (of ``lengths`` next-token pairs, each <= ``maxlen``) make each row.

    ``packing``: best-fit decreasing, several windows per row; else one window per row.
    ``seed``: windows and rows in an order drawn from (seed, epoch), a new one each epoch;
    ``None``: deterministic, in the windows' order (eval). The number of rows depends only on
    the lengths (the order decides which windows share a row, not how many rows there are).
    """
    lengths = np.asarray(lengths, np.int64)
    n = len(lengths)
    # (seed mod 2**64: numpy's seeds are non-negative, a config's seed may not be)
    rng = None if seed is None else np.random.default_rng([seed % (1 << 64), epoch])
    order = rng.permutation(n) if rng is not None else np.arange(n)
    if not packing:
        return RowPlan(row_starts=np.arange(n + 1, dtype=np.int64), window_ids=order)
    if n and (lengths.min() < 1 or lengths.max() > maxlen):
        raise ValueError(f"window lengths must lie in 1..{maxlen}")
    # Longest first; a stable sort on the (small, non-negative) key is a radix sort in numpy.
    key = (maxlen - lengths[order]).astype(np.uint16 if maxlen < 1 << 16 else np.int64)
    order = order[np.argsort(key, kind="stable")]
    row_of, num_rows = _best_fit_decreasing(lengths[order], maxlen)
    if rng is not None:  # rows in random order: relabel them before grouping
        row_of = rng.permutation(num_rows)[row_of]
    # Stable: numpy's default sort may order ties differently on another CPU (its SIMD
    # kernels), and a run resumed elsewhere must replan the very same rows.
    by_row = np.argsort(row_of, kind="stable")
    per_row = np.bincount(row_of, minlength=num_rows)
    return RowPlan(row_starts=np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64),
                   window_ids=order[by_row])


def _best_fit_decreasing(lengths_desc: np.ndarray, maxlen: int) -> tuple[np.ndarray, int]:
    """The row of each window (lengths sorted decreasing), and how many rows.

    Each window goes into the fullest open row it fits (a new row if none), exactly as one
    window at a time would, but a whole group of equal lengths ``L`` at once: the fullest row
    that fits, with room ``r``, stays the fullest that fits while ``r >= L``, so it takes
    ``r // L`` windows in a row before the next row is tried. Open rows are kept by room, as
    arrays of row ids; the Python loop runs over (length, room) pairs, not over windows.
    """
    n = len(lengths_desc)
    row_of = np.empty(n, np.int64)
    if n == 0:
        return row_of, 0
    smallest = int(lengths_desc[-1])  # rows with less room than this can take nothing more
    count = np.zeros(maxlen + 1, np.int64)  # open rows by room left
    by_room: list[list[np.ndarray]] = [[] for _ in range(maxlen + 1)]
    num_rows = 0

    def keep(rows: np.ndarray, room: int) -> None:
        if room >= smallest and len(rows):
            by_room[room].append(rows)
            count[room] += len(rows)

    def fill(rows: np.ndarray, room: int, length: int, first: int, need: int) -> int:
        """Windows ``first:first + need`` into ``rows`` (each with ``room``), in turn; the rows
        left unused go back. Returns how many windows were placed."""
        per_row = room // length
        used = min(len(rows), -(-need // per_row))
        placed = min(need, used * per_row)
        row_of[first:first + placed] = np.repeat(rows[:used], per_row)[:placed]
        full, partial = divmod(placed, per_row)
        keep(rows[:full], room - per_row * length)
        if partial:
            keep(rows[full:full + 1], room - partial * length)
        keep(rows[used:], room)
        return placed

    bounds = (np.flatnonzero(np.diff(lengths_desc)) + 1).tolist()
    for lo, hi in zip([0, *bounds], [*bounds, n], strict=True):
        length = int(lengths_desc[lo])
        # Rooms that fit, fullest first. Rows this group fills end with less room than
        # ``length``, or the group is done: the list stays valid while it is walked.
        for room in (np.flatnonzero(count[length:]) + length).tolist():
            rows = by_room[room][0] if len(by_room[room]) == 1 else np.concatenate(by_room[room])
            by_room[room], count[room] = [], 0
            lo += fill(rows, room, length, lo, hi - lo)
            if lo == hi:
                break
        if lo < hi:  # new rows
            new = -(-(hi - lo) // (maxlen // length))
            fill(np.arange(num_rows, num_rows + new), maxlen, length, lo, hi - lo)
            num_rows += new
    return row_of, num_rows


def assemble_rows(windows: WindowSource, per_row: np.ndarray, window_ids: np.ndarray,
                  allocate: Allocate = _zeros) -> Batch:
    """Rows (``per_row[r]`` consecutive windows of ``window_ids`` each) as int32
    [rows, maxlen] arrays (made by ``allocate``): tokens, targets, segment ids 1..k, positions
    within each segment and the loss mask; zeros after the last window of a row.

    Every window is a contiguous run of the cache and a row's windows sit back to back from
    its first position, so the real positions of all rows, in row-major order, are the
    windows' tokens concatenated: one gather per field and one masked store, no per-window
    Python.
    """
    maxlen, split = windows.maxlen, windows.split
    num_rows = len(per_row)
    starts = windows.start[window_ids]
    lengths = windows.end[window_ids] - starts - 1
    ends = np.cumsum(lengths)
    begins = ends - lengths  # of each window in the concatenation
    first = np.cumsum(per_row) - per_row  # each row's first window
    through = np.concatenate([[0], ends])  # tokens before window i: through[i]
    row_lengths = through[first + per_row] - through[first]
    segment = np.arange(len(window_ids)) - np.repeat(first, per_row) + 1
    total = int(ends[-1]) if len(ends) else 0
    flat = np.arange(total)
    src = flat + np.repeat(starts - begins, lengths)  # cache index of each input token
    real = np.arange(maxlen) < row_lengths[:, None]
    fields = {
        "tokens": np.take(split.tokens, src),
        "targets": np.take(split.tokens, src + 1),
        "segment_ids": np.repeat(segment, lengths),
        "positions": flat - np.repeat(begins, lengths),
    }
    mask = split.loss_mask
    fields["loss_mask"] = 1 if mask is None else np.take(mask, src + 1)
    batch = {}
    for name in FIELDS:
        out = allocate((num_rows, maxlen))
        out[real] = fields[name]
        batch[name] = out
    return batch


class BatchStream:
    """Endless batches of ``rows_per_batch`` rows: epoch 0's rows in its plan's order, then
    epoch 1's, and so on. A batch that straddles an epoch boundary takes the next epoch's first
    rows: no row is dropped or left empty.

    The position (``state``: next epoch and row) is all a checkpoint needs: a plan is a pure
    function of (lengths, seed, epoch), recomputed on demand. ``first_batch``/``batch_step``
    make this stream produce batches ``first_batch``, ``first_batch + batch_step``, … of the
    whole stream (a slice of it, for grain's worker processes).
    """

    def __init__(self, windows: WindowSource, *, rows_per_batch: int, packing: bool, seed: int,
                 first_batch: int = 0, batch_step: int = 1, allocate: Allocate = _zeros):
        if len(windows) == 0:
            raise ValueError("no windows to make rows of")
        self.windows, self.rows_per_batch, self.allocate = windows, rows_per_batch, allocate
        self.packing, self.seed, self.batch_step = packing, seed, batch_step
        self.lengths = windows.unit_lengths.astype(np.int64)
        self._plans: dict[int, RowPlan] = {}
        self.epoch = self.row = 0
        self._take(first_batch * rows_per_batch)

    @property
    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "row": self.row}

    @state.setter
    def state(self, state: dict[str, Any]) -> None:
        self.epoch, self.row = int(state["epoch"]), int(state["row"])

    def plan(self, epoch: int) -> RowPlan:
        if epoch not in self._plans:
            # Consecutive epochs are read in turn: keep the one being read and the next.
            self._plans = {e: p for e, p in self._plans.items() if e == epoch - 1}
            self._plans[epoch] = plan_rows(self.lengths, self.windows.maxlen,
                                           packing=self.packing, seed=self.seed, epoch=epoch)
        return self._plans[epoch]

    def _take(self, rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Advance by ``rows`` rows; returns them as (windows per row, window ids) pieces."""
        pieces = []
        while rows:
            plan = self.plan(self.epoch)
            end = min(plan.num_rows, self.row + rows)
            pieces.append(plan.rows(self.row, end))
            rows -= end - self.row
            self.row = end
            if self.row == plan.num_rows:
                self.epoch, self.row = self.epoch + 1, 0
        return pieces

    def next_batch(self) -> Batch:
        pieces = self._take(self.rows_per_batch)
        per_row, window_ids = (pieces[0] if len(pieces) == 1 else
                               (np.concatenate([p[0] for p in pieces]),
                                np.concatenate([p[1] for p in pieces])))
        self._take((self.batch_step - 1) * self.rows_per_batch)  # other workers' batches
        return assemble_rows(self.windows, *self.windows.expand(per_row, window_ids),
                             self.allocate)


# ---------------------------------------------------------------------------------------------
# Windows: a story longer than ``maxlen`` is never truncated but cut into consecutive windows of
# ``maxlen`` next-token pairs, so every token of the corpus is a target exactly once per epoch.


class WindowSource:
    """Random access to next-token windows: document ``d`` of length ``n`` gives
    ``ceil((n - 1) / maxlen)`` windows of at most ``maxlen`` (input, target) pairs.

    The packer places units: a window, or for preference data (``split.group`` 2) a pair's two
    windows, chosen then rejected, which always share a row as consecutive segments. A pair is
    never cut: one whose two sides exceed ``maxlen`` together is refused here, naming the
    ``maxlen`` that fits.
    """

    def __init__(self, split: TokenizedSplit, maxlen: int):
        self.split, self.maxlen, self.group = split, maxlen, split.group
        pairs = np.maximum(split.lengths - 1, 0)
        windows = -(-pairs // maxlen)
        if self.group > 1:
            totals = unit_pairs(split.lengths, self.group)
            require_units_fit(int(np.sum(totals > maxlen)), len(totals),
                              int(totals.max(initial=0)), maxlen)
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
    def num_units(self) -> int:
        """What the packer places: windows, or preference pairs."""
        return len(self) // self.group

    @property
    def unit_lengths(self) -> np.ndarray:
        """Next-token pairs per unit (a pair's: both sides' together)."""
        lengths = self.lengths
        return lengths if self.group == 1 else lengths.reshape(-1, self.group).sum(axis=1)

    def expand(self, per_row: np.ndarray, unit_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A plan's rows of units as rows of windows: ``(windows per row, window ids)``."""
        if self.group == 1:
            return per_row, unit_ids
        ids = unit_ids[:, None] * self.group + np.arange(self.group)
        return per_row * self.group, ids.reshape(-1)

    @property
    def num_targets(self) -> int:
        return int(np.sum(self.lengths))

    @property
    def num_loss_targets(self) -> int:
        """Targets that bear loss (``num_targets`` but the prompts' for chat data)."""
        mask = self.split.loss_mask  # 0 at each document's BOS, which is never a target
        return self.num_targets if mask is None else int(np.sum(mask, dtype=np.int64))


def unit_pairs(lengths: np.ndarray, group: int) -> np.ndarray:
    """The next-token pairs of each unit of ``group`` consecutive documents (of ``lengths``
    tokens): what one row must hold for a preference pair (``group`` 2)."""
    if len(lengths) % group:
        raise ValueError(f"{len(lengths)} documents do not make units of {group}")
    return np.maximum(np.asarray(lengths) - 1, 0).reshape(-1, group).sum(axis=1)


def require_units_fit(too_long: int, units: int, longest: int, maxlen: int) -> None:
    """Refuse preference data with ``too_long`` of its ``units`` pairs over ``maxlen`` (the
    longest ``longest`` next-token pairs), naming the ``maxlen`` that fits."""
    from gemmalab.errors import ConfigError

    if too_long:
        raise ConfigError("maxlen", f"{too_long} of {units} preference pairs take more than "
                          f"{maxlen} tokens with both replies (the longest {longest}); a pair is "
                          "never cut, and both replies share one row",
                          f"raise maxlen to {longest} or more, or shorten those records")


# Windows whose lengths estimate how full packed rows get: the training packer plans a million
# in ~0.1 s, so up to this many per process the estimate is exact.
FILL_SAMPLE = 1 << 20


def packed_fill(windows: WindowSource, *, seed: int = 0) -> float:
    """The share of row positions that packed rows fill with real tokens: the training packer's
    plan (``plan_rows``) of the windows' lengths, or of a sample of ``FILL_SAMPLE`` of them.
    How many rows a plan has depends only on the lengths, so every epoch fills the same:
    ~0.97 for stories at maxlen 256, but ~0.65 for 155-token conversations, of which two
    rarely fit one row."""
    lengths = windows.unit_lengths.astype(np.int64)
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
    plan = plan_rows(windows.unit_lengths, maxlen, packing=packing)
    stacked = assemble_rows(windows, *windows.expand(*plan.rows(0, plan.num_rows)))
    total = -(-plan.num_rows // batch_size) * batch_size
    padded = {k: np.pad(v, ((0, total - len(v)), (0, 0))) for k, v in stacked.items()}
    per_process = batch_size // process_count
    batches = []
    for start in range(0, total, batch_size):
        lo = start + process_index * per_process
        batches.append({k: v[lo:lo + per_process] for k, v in padded.items()})
    return batches
