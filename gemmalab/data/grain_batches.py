"""``gemmalab.data.packing.BatchStream`` as a grain dataset, so that grain prefetches it and Orbax
checkpoints its position (``grain.checkpoint``) like any grain iterator's.

Kept apart from ``gemmalab.data.documents`` because importing grain takes seconds.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np
from grain.multiprocessing import SharedMemoryArray

from gemmalab.data.packing import Batch, BatchStream, WindowSource
from gemmalab.data.token_cache import TokenizedSplit
from gemmalab.errors import ConfigError


class PackedBatchDataset(grain.IterDataset):
    """Endless batches of rows of ``windows`` (a ``gemmalab.data.packing.WindowSource``), packed or
    one window per row, planned per epoch from ``seed``.

    grain's ``mp_prefetch`` may slice it (``set_slice``): worker ``i`` of ``n`` then makes
    batches ``i, i + n, …`` of the same stream, so the batches do not depend on the number of
    workers. Pickled for those workers, the windows reopen the cache's memory-mapped files
    (``TokenizedSplit.__reduce__``) rather than carry them.
    """

    def __init__(self, windows: Any, *, rows_per_batch: int, packing: bool, seed: int):
        super().__init__()
        self._windows, self._rows_per_batch = windows, rows_per_batch
        self._packing, self._seed = packing, seed
        self._slice = slice(0, None, 1)
        self._shared_memory = False

    def enable_shared_memory_output(self) -> None:
        """grain's ``mp_prefetch`` calls this (``SupportsSharedMemoryOutput``): the workers then
        build each batch's arrays in shared memory, and only their names cross to the training
        process (no copy into shared memory, no pickled arrays)."""
        self._shared_memory = True

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        if sequential_slice:  # an endless stream has no "first half"
            raise ValueError("PackedBatchDataset supports only interleaved slices")
        self._slice = sl

    def __iter__(self) -> PackedBatchIterator:
        return PackedBatchIterator(BatchStream(
            self._windows, rows_per_batch=self._rows_per_batch, packing=self._packing,
            seed=self._seed, first_batch=self._slice.start or 0,
            batch_step=self._slice.step or 1,
            **({"allocate": _shared_zeros} if self._shared_memory else {})))

    def __str__(self) -> str:
        return (f"PackedBatchDataset(rows_per_batch={self._rows_per_batch}, "
                f"packing={self._packing}, slice={self._slice})")


def _shared_zeros(shape: tuple[int, ...]) -> np.ndarray:
    return SharedMemoryArray(shape, np.int32)  # a new shared memory block reads as zeros


class PackedBatchIterator(grain.DatasetIterator):
    """State: ``{"epoch", "row"}`` of the next batch (JSON, a few bytes)."""

    def __init__(self, stream: BatchStream):
        super().__init__()
        self._stream = stream

    def __next__(self) -> Batch:
        self._assert_not_closed()
        return self._stream.next_batch()

    def get_state(self) -> dict[str, Any]:
        return self._stream.state

    def set_state(self, state: dict[str, Any]) -> None:
        if not {"epoch", "row"} <= state.keys():  # e.g. saved by grain's packer before
            raise ConfigError("resume", "this checkpoint's data position is from an older "
                              "gemmalab input pipeline", "train into a new output_dir, or set "
                              "resume=False")
        self._stream.state = state

    def __str__(self) -> str:
        return f"PackedBatchIterator({self._stream.state})"


def train_batches(split: TokenizedSplit, *, maxlen: int, rows_per_process: int, packing: bool,
                  seed: int, prefetch: int = 4) -> Any:
    """An endless, per-epoch reshuffled (and repacked), prefetching iterator of this process's
    batches. Rows flow across epoch boundaries: none is dropped.

    Returns a grain ``DatasetIterator``: its ``get_state``/``set_state`` (the epoch and row of
    the next batch) make it checkpointable; resuming replans that epoch and gives the same
    batches bit for bit.
    """
    batches = PackedBatchDataset(WindowSource(split, maxlen), rows_per_batch=rows_per_process,
                                 packing=packing, seed=seed)
    prefetched = grain.experimental.ThreadPrefetchIterDataset(batches,
                                                              prefetch_buffer_size=prefetch)
    return iter(prefetched)
