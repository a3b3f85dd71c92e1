"""Whole TrainConfig runs: the small config of tests/train/test_experiment.py, a run's metric
rows, and a run killed before a step (tests/train/test_resume.py, and the LoRA and DPO runs'
resumes)."""

import json

import numpy as np
import pytest

from gemmalab.config import TrainConfig
from gemmalab.train.experiment import Experiment


def small_config(tmp_path, cache_dir, stories_file, **overrides) -> TrainConfig:
    values = dict(model="gemma3-tiny", data_path=str(stories_file), cache_dir=str(cache_dir),
                  output_dir=str(tmp_path / "run"), batch_size=8, maxlen=64, max_steps=12,
                  eval_every=5, tokenizer_vocab_size=600, tokenize_workers=1, seed=3)
    values.update(overrides)
    return TrainConfig.flat(**values)


def _metric_rows(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(output_dir):
    rows = _metric_rows(output_dir)
    return [r["step"] for r in rows], np.asarray([r["loss"] for r in rows])


class Crash(RuntimeError):
    pass


def _crash_at(experiment, step):
    """Make the run die (as a kill would) when it is about to run ``step``."""
    real = experiment.compile()
    calls = {"n": experiment.weights.start_step}

    def step_or_crash(state, batch, frozen=None):
        calls["n"] += 1
        if calls["n"] == step:
            raise Crash(f"killed before step {step}")
        return real(state, batch, frozen)

    experiment.train_step = step_or_crash


def crashed_run(config, step, before_training=None):
    """A run of ``config`` killed before ``step``, its pending checkpoint saves finished
    (``before_training(experiment)`` first, if given)."""
    first = Experiment.prepare(config)
    if before_training is not None:
        before_training(first)
    _crash_at(first, step)
    with pytest.raises(Crash):
        first.train(progress=False)
    first.checkpoints.wait()
    return first
