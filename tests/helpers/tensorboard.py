"""A run's TensorBoard event files read back with tensorboard's own readers, against its
metrics.jsonl and eval.jsonl rows."""

import json
from pathlib import Path

import pytest

from gemmalab.train import tensorboard_log

RTOL = 1e-6  # scalars are stored as float32 (eps 1.2e-7)


def jsonl(output_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (output_dir / f"{name}.jsonl").read_text().splitlines()]


def event_files(output_dir: Path) -> list[Path]:
    return sorted((output_dir / "tensorboard").glob("events.out.tfevents.*"))


def raw_summaries(output_dir: Path) -> list[tuple[str, int, object]]:
    """(tag, step, value) of every summary value in every event file, as stored."""
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.util import tensor_util

    return [(value.tag, event.step, tensor_util.make_ndarray(value.tensor))
            for path in event_files(output_dir)
            for event in event_file_loader.EventFileLoader(str(path)).Load()
            for value in event.summary.value]


def curves(output_dir: Path) -> dict[str, dict[int, float]]:
    """Scalar tag -> step -> value, as TensorBoard's EventAccumulator loads the run."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    accumulator = event_accumulator.EventAccumulator(
        str(output_dir / "tensorboard"), size_guidance={event_accumulator.TENSORS: 0})
    accumulator.Reload()
    return {tag: {e.step: tensor_util.make_ndarray(e.tensor_proto).item()
                  for e in accumulator.Tensors(tag)}
            for tag in accumulator.Tags()["tensors"]
            if accumulator.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"}


def assert_curves_match_the_rows(output_dir: Path) -> dict[str, dict[int, float]]:
    """Every figure of every metrics.jsonl and eval.jsonl row is its tag's value at its step,
    and no tag has a step the rows lack; each (tag, step) is stored once."""
    loaded = curves(output_dir)
    expected: dict[str, dict[int, float]] = {}
    for kind in ("metrics", "eval"):
        for row in jsonl(output_dir, kind):
            for tag, value in tensorboard_log.scalar_tags(kind, row).items():
                expected.setdefault(tag, {})[row["step"]] = value
    assert expected, "no rows"
    for tag, by_step in expected.items():
        assert sorted(loaded[tag]) == sorted(by_step), tag
        for step, value in by_step.items():
            assert loaded[tag][step] == pytest.approx(value, rel=RTOL), (tag, step)
    stored = [(tag, step) for tag, step, _ in raw_summaries(output_dir)]
    assert len(stored) == len(set(stored)), "a (tag, step) is stored twice"
    return loaded
