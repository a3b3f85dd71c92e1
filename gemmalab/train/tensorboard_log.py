"""TensorBoard event files of a run, in ``output_dir/tensorboard`` (local or ``gs://``).

``TensorBoardLog`` writes what ``MetricsSink`` records (every number of a ``metrics.jsonl`` row
under ``train/`` or ``perf/``, every ``eval.jsonl`` figure under ``eval/``), the samples the
notebook takes before and after training as text, and the config as the hparams plugin's
hyperparameters. Only the main process writes one (``Experiment.tensorboard``, opened by
``Experiment.prepare``).

The writer is tensorboard's own TF-free summary layer: the plugins' ``*_pb`` summary protos and
its ``RecordWriter`` framing, over a file opened through etils.epath, the file layer behind
``metrics.jsonl`` (so ``gs://`` works as it does there). ``tensorboard.summary.Writer`` would do
the framing too, but its file layer imports TensorFlow whenever it is installed (~17 s) and
writes scalars only; ``clu.metric_writers`` imports TensorFlow at import.

A resumed run shows each step once: the old event files are read back (TF-free), what they hold
past the step resumed from is dropped, the rest is written into the new file and the old files
are deleted; rows of ``metrics.jsonl`` an old file had not flushed yet are written again from
the rows (``fill``). A ``SessionLog.START`` at the first new step also makes a TensorBoard that
already read the old files purge their later steps.
"""

from __future__ import annotations

import html
import json
import os
import socket
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gemmalab import storage

LOGDIR_NAME = "tensorboard"
EVENT_FILE_PREFIX = "events.out.tfevents."
# Fields of a metrics.jsonl row that are bookkeeping rather than curves (the step is the x-axis;
# epoch is the step over steps_per_epoch; tokens per step is constant).
NOT_CURVES = frozenset({"step", "epoch", "time", "batch_crc32", "tokens", "attempt_start"})
# Throughput and time figures go under perf/, the objective's under train/.
PERFORMANCE = frozenset({"tokens_per_s", "useful_tokens_per_s", "model_flops_per_s", "mfu",
                         "cpu_mfu", "step_time_s", "data_wait_s"})
SAMPLES_TAG = "samples"
# A flush re-uploads a gs:// object whole: at most this often there (as tf.summary's writers
# flush), every time on a local disk. ``close`` always writes everything.
GCS_FLUSH_EVERY_S = 60.0
HPARAMS_PLUGIN = "hparams"


def logdir(output_dir: str) -> str:
    """Where a run's event files (and profile traces, under ``plugins/profile/``) go."""
    return f"{str(output_dir).rstrip('/')}/{LOGDIR_NAME}"


def for_run(output_dir: str, *, enabled: bool, resume_step: int,
            hparams: Mapping[str, Any]) -> TensorBoardLog | None:
    """A run's event files in ``output_dir/tensorboard``, opened now (a resumed run's old events
    past ``resume_step`` are dropped); None unless ``enabled`` (tensorboard=True, and the main
    process: only it writes)."""
    if not enabled:
        return None
    return TensorBoardLog(logdir(output_dir), resume_step=resume_step, hparams=hparams)


def scalar_tags(kind: str, record: Mapping[str, Any]) -> dict[str, float]:
    """The TensorBoard tags and values of one ``metrics.jsonl`` (``kind="metrics"``) or
    ``eval.jsonl`` (``kind="eval"``) row."""
    tags = {}
    for name, value in record.items():
        if name in NOT_CURVES or isinstance(value, str) or value is None:
            continue
        if kind == "eval":
            tag = "eval/" + name.removeprefix("eval_")
        else:
            tag = ("perf/" if name in PERFORMANCE else "train/") + name
        tags[tag] = float(value)
    return tags


def hparams_of(config: Mapping[str, Any]) -> dict[str, bool | float | str]:
    """A config's fields as the hparams plugin takes them: bools, numbers and strings (None as
    "None", as papermill's ``-p`` spells it; lists and mappings as JSON)."""
    return {name: value if isinstance(value, bool | int | float | str)
            else "None" if value is None else json.dumps(value)
            for name, value in config.items()}


def samples_markdown(continuations: Sequence[Any]) -> str:
    """Each continuation as a paragraph: the prompt in bold, then what the model wrote. Escaped,
    so chat templates' ``<start_of_turn>`` and the like show as written."""
    return "\n\n".join(f"**{_escape(c.prompt)}**{_escape(c.text)}" for c in continuations)


def _escape(text: str) -> str:
    return html.escape(text, quote=False).replace("*", r"\*").replace("_", r"\_")


class TensorBoardLog:
    """One run's event files in ``directory``; ``resume_step``: the step the run resumes from
    (None or 0: a fresh run, old event files are removed, as ``metrics.jsonl`` is rewritten).

    The current event file opens on the first write and stays open until ``close`` (the sink's
    close, at the end of training); a write after that (the samples after training) opens a new
    file and closes it again, so a ``gs://`` object is complete once the call returns.
    """

    def __init__(self, directory: str, *, resume_step: int | None = None,
                 hparams: Mapping[str, Any] | None = None):
        from etils import epath

        self.directory = directory
        self._path = epath.Path(directory)
        self._file: Any = None
        self._records: Any = None
        # (tag, step) of the summaries kept from the old files: what ``fill`` need not write.
        self._kept: set[tuple[str, int]] = set()
        self._gcs, self._flushed = storage.is_gcs(directory), time.monotonic()
        old = sorted(self._path.glob(EVENT_FILE_PREFIX + "*")) if self._path.exists() else []
        kept = _kept_events(old, resume_step) if resume_step else []
        self._kept = {(v.tag, e.step) for e in kept for v in e.summary.value}
        self._open()
        for event in kept:
            self._write(event)
        if resume_step:
            # For a TensorBoard that already read the old files: forget their steps from here on.
            from tensorboard.compat.proto import event_pb2

            self._write(event_pb2.Event(wall_time=time.time(), step=resume_step + 1,
                                        session_log=event_pb2.SessionLog(
                                            status=event_pb2.SessionLog.START)))
        if hparams is not None:
            from tensorboard.plugins.hparams import summary_v2 as hparams_summary

            self._write_summary(hparams_summary.hparams_pb(hparams_of(hparams)), step=0)
        self.flush(force=True)
        for path in old:  # only once their kept events are safely in the new file
            path.unlink(missing_ok=True)

    # ---------------------------------------------------------------------------------------
    def scalars(self, kind: str, record: Mapping[str, Any]) -> None:
        """One ``metrics.jsonl``/``eval.jsonl`` row (``kind``: "metrics" or "eval")."""
        from tensorboard.plugins.scalar import summary_v2 as scalar_summary

        step, wall_time = int(record["step"]), record.get("time")
        for tag, value in scalar_tags(kind, record).items():
            self._write_summary(scalar_summary.scalar_pb(tag, value), step, wall_time)

    def fill(self, rows: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
        """Write the scalars of the rows (``MetricsSink.kept``: kind -> rows) that the kept
        event files lack: a run killed between a flush of ``metrics.jsonl`` and one of its
        event file."""
        from tensorboard.plugins.scalar import summary_v2 as scalar_summary

        for kind, records in rows.items():
            for record in records:
                step = int(record["step"])
                for tag, value in scalar_tags(kind, record).items():
                    if (tag, step) not in self._kept:
                        self._write_summary(scalar_summary.scalar_pb(tag, value), step,
                                            record.get("time"))
        self._kept = set()  # needed no more: not a set growing with every step of the run

    def samples(self, step: int, continuations: Sequence[Any]) -> None:
        """Model continuations (``sampling.Continuation``) at ``step`` as a text summary."""
        from tensorboard.plugins.text import summary_v2 as text_summary

        was_open = self._file is not None
        self._write_summary(text_summary.text_pb(SAMPLES_TAG, samples_markdown(continuations)),
                            step)
        self.flush(force=True)
        if not was_open:
            self.close()

    def flush(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self._records is None or (not force and self._gcs
                                     and now - self._flushed < GCS_FLUSH_EVERY_S):
            return
        self._records.flush()
        self._flushed = now

    def close(self) -> None:
        if self._records is not None:
            self._records.close()
        self._file = self._records = None

    # ---------------------------------------------------------------------------------------
    def _open(self) -> None:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._path.mkdir(parents=True, exist_ok=True)
        # Named as TensorBoard's own writers name theirs: readers load a run's files in name
        # order, so the timestamp first; the nanoseconds keep two files of one second apart.
        name = (f"{EVENT_FILE_PREFIX}{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{time.time_ns() % 10**9:09d}.gemmalab")
        self._file = (self._path / name).open("wb")
        self._records = RecordWriter(self._file)
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write_summary(self, summary: Any, step: int, wall_time: float | None = None) -> None:
        from tensorboard.compat.proto import event_pb2

        self._write(event_pb2.Event(wall_time=time.time() if wall_time is None else wall_time,
                                    step=step, summary=summary))

    def _write(self, event: Any) -> None:
        if self._records is None:
            self._open()
        self._records.write(event.SerializeToString())


def _kept_events(paths: Sequence[Any], resume_step: int) -> list[Any]:
    """The summaries of the old event files at steps up to ``resume_step``, each (tag, step)
    once (the last written wins: a file rewritten by an earlier resume and not yet deleted
    repeats its predecessor), in step order; without the old hparams, which are written anew."""
    from tensorboard.compat.proto import event_pb2

    latest: dict[tuple[str, int], Any] = {}
    for path in paths:
        for payload in _records(path.read_bytes()):
            event = event_pb2.Event.FromString(payload)
            if not event.HasField("summary") or event.step > resume_step:
                continue
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == HPARAMS_PLUGIN:
                    continue
                one = event_pb2.Event(wall_time=event.wall_time, step=event.step)
                one.summary.value.add().CopyFrom(value)
                latest.pop((value.tag, event.step), None)  # re-inserted: the order it came in
                latest[(value.tag, event.step)] = one
    return sorted(latest.values(), key=lambda e: e.step)


def _records(data: bytes) -> Iterator[bytes]:
    """The records of a TFRecord file's bytes, up to the first incomplete one (a writer killed
    mid-record leaves a prefix of the file: the length then overruns the end). Each length is
    checked against its CRC; the payloads are not (pure-Python CRC32C costs ~0.4 s per MB)."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    offset = 0
    while offset + 12 <= len(data):
        header = data[offset:offset + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[offset + 8:offset + 12])
        end = offset + 12 + length + 4
        if header_crc != masked_crc32c(header) or end > len(data):
            return
        yield data[offset + 12:offset + 12 + length]
        offset = end
