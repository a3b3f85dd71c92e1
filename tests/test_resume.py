"""Checkpoints and resume: a run stopped at any step and started again with the same config
trains exactly as if it had never stopped."""

import dataclasses
import json
import warnings

import jax
import numpy as np
import pytest

from gemmalab import checkpoints
from gemmalab.config import TrainConfig
from gemmalab.errors import ConfigError
from gemmalab.experiment import Experiment


def _config(tmp_path, cache_dir, stories_file, name, **overrides):
    values = dict(data_path=str(stories_file), cache_dir=str(cache_dir),
                  output_dir=str(tmp_path / name), batch_size=8, maxlen=64, max_steps=12,
                  eval_every=6, checkpoint_every=4, tokenizer_vocab_size=600,
                  tokenize_workers=1, seed=5, compute_dtype="float32")
    return TrainConfig(**{**values, **overrides})


def _losses(output_dir):
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows], np.asarray([r["loss"] for r in rows])


class Crash(RuntimeError):
    pass


def _crash_at(experiment, step):
    """Make the run die (as a kill would) when it is about to run ``step``."""
    real = experiment.train_step
    calls = {"n": experiment.start_step}

    def step_or_crash(state, batch):
        calls["n"] += 1
        if calls["n"] == step:
            raise Crash(f"killed before step {step}")
        return real(state, batch)

    experiment.__dict__["train_step"] = step_or_crash


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache_dir, stories_file):
    tmp_path = tmp_path_factory.mktemp("resume")
    experiment = Experiment.prepare(_config(tmp_path, cache_dir, stories_file, "whole"))
    experiment.train(progress=False)
    return tmp_path, experiment


def test_a_crashed_run_resumes_exactly(uninterrupted, cache_dir, stories_file):
    """Killed before step 7 (checkpoint at 4), then started again: the same 12 per-step losses
    and the same final params, bit for bit (same devices, same compiled step, same batches)."""
    tmp_path, whole = uninterrupted
    config = _config(tmp_path, cache_dir, stories_file, "crashed")
    first = Experiment.prepare(config)
    _crash_at(first, 7)
    with pytest.raises(Crash):
        first.train(progress=False)
    first.checkpoints.wait()
    assert first.checkpoints.steps() == [4]

    second = Experiment.prepare(config)
    assert second.start_step == 4
    summary = second.train(progress=False)
    steps, losses = _losses(tmp_path / "crashed")
    whole_steps, whole_losses = _losses(tmp_path / "whole")
    assert steps == whole_steps == list(range(1, 13))  # rows 5-6 of the crashed try replaced
    np.testing.assert_array_equal(losses, whole_losses)
    for a, b in zip(jax.tree.leaves(second.state.params), jax.tree.leaves(whole.state.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert summary["steps"] == 12 and summary["final_eval_loss"] == whole.summary[
        "final_eval_loss"]
    assert second.checkpoints.steps() == [4, 8, 12]


def test_a_finished_run_resumes_to_its_end(uninterrupted, cache_dir, stories_file, capsys):
    tmp_path, whole = uninterrupted
    again = Experiment.prepare(_config(tmp_path, cache_dir, stories_file, "whole"))
    assert again.start_step == 12
    assert "resumed from step 12" in capsys.readouterr().out
    for a, b in zip(jax.tree.leaves(again.state.params), jax.tree.leaves(whole.state.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_data_position_is_restored(uninterrupted, cache_dir, stories_file):
    """After a restore the iterator yields the batch the uninterrupted run would take next."""
    tmp_path, _ = uninterrupted
    config = _config(tmp_path, cache_dir, stories_file, "position", checkpoint_every=3,
                     max_steps=6)
    run = Experiment.prepare(config)
    _crash_at(run, 5)
    with pytest.raises(Crash):
        run.train(progress=False)
    run.checkpoints.wait()
    fresh = Experiment.prepare(dataclasses.replace(config, output_dir=str(tmp_path / "p2")))
    expected = [next(fresh.train_iterator) for _ in range(5)][3]  # the 4th batch
    resumed = Experiment.prepare(config)
    assert resumed.start_step == 3
    got = next(resumed.train_iterator)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])


@pytest.mark.parametrize(("field", "value"), [("maxlen", 32), ("batch_size", 16), ("seed", 6),
                                              ("model", "gemma3-270m")])
def test_resuming_with_another_config_names_the_field(uninterrupted, cache_dir, stories_file,
                                                      field, value):
    tmp_path, _ = uninterrupted
    config = _config(tmp_path, cache_dir, stories_file, "whole", **{field: value},
                     mesh={"fsdp": -1})
    with pytest.raises(ConfigError, match=f"^{field}: .* differs from .* of the run "
                                          "checkpointed in") as error:
        Experiment.prepare(config)
    assert "\n" not in str(error.value) and "or a new output_dir" in str(error.value)


def test_resume_false_needs_an_empty_directory(uninterrupted, cache_dir, stories_file, tmp_path):
    done, _ = uninterrupted
    with pytest.raises(ConfigError, match="^resume: .* holds the checkpoints of an earlier run"):
        Experiment.prepare(_config(done, cache_dir, stories_file, "whole", resume=False))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="^resume: resume=False but .* is not empty"):
        Experiment.prepare(_config(tmp_path, cache_dir, stories_file, "busy", resume=False))


def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(uninterrupted, tmp_path):
    done, whole = uninterrupted
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(done / "whole" / "checkpoints", copy / "checkpoints")
    newest = max(int(p.name) for p in (copy / "checkpoints").iterdir() if p.name.isdigit())
    for path in (copy / "checkpoints" / str(newest) / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 64:
            path.write_bytes(path.read_bytes()[:16])  # truncated, as by a full disk
    saved = checkpoints.TrainCheckpoints(str(copy), keep=3)
    abstract = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                              sharding=leaf.sharding), whole.state)
    fresh_iterator = Experiment.prepare(dataclasses.replace(
        whole.config, output_dir=str(tmp_path / "fresh"))).train_iterator
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, state = saved.restore_latest(abstract, fresh_iterator)
    assert step == newest - 4 and int(state.step) == step
    assert any(f"{newest} does not load" in str(w.message) for w in caught)
