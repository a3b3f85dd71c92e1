"""Checkpoints and resume: a run stopped at any step and started again with the same config
trains exactly as if it had never stopped."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections import namedtuple
from pathlib import Path

import jax
import numpy as np
import psutil
import pytest

from gemmalab.config import TrainConfig
from gemmalab.errors import ConfigError, TrainingDiverged
from gemmalab.k8s import run_notebook
from gemmalab.train import checkpoints
from gemmalab.train.experiment import Experiment
from tests.helpers.runs import Crash, _crash_at, _losses, _metric_rows, crashed_run


def _config(tmp_path, cache_dir, stories_file, name, **overrides):
    values = dict(model="gemma3-tiny", data_path=str(stories_file), cache_dir=str(cache_dir),
                  output_dir=str(tmp_path / name), batch_size=8, maxlen=64, max_steps=12,
                  eval_every=6, checkpoint_every=4, tokenizer_vocab_size=600,
                  tokenize_workers=1, seed=5, compute_dtype="float32", num_layers=2)
    return TrainConfig.flat(**{**values, **overrides})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache_dir, stories_file):
    tmp_path = tmp_path_factory.mktemp("resume")
    experiment = Experiment.prepare(_config(tmp_path, cache_dir, stories_file, "whole"))
    experiment.train(progress=False)
    return tmp_path, experiment


@pytest.mark.slow
def test_a_crashed_run_resumes_exactly(uninterrupted, cache_dir, stories_file):
    """Killed before step 7 (checkpoint at 4), then started again: the same 12 per-step losses
    and the same final params, bit for bit (same devices, same compiled step, same batches).
    Its TensorBoard event files hold steps 1-12 once each with metrics.jsonl's values, the
    evaluations at 0, 6 and 12, and the samples at the step the weights were at (0, 4 on
    resuming, 12): the rows the killed try wrote past its checkpoint are gone."""
    from gemmalab.train import tensorboard_log
    from tests.helpers import PROMPT
    from tests.helpers.tensorboard import RTOL, assert_curves_match_the_rows, raw_summaries

    tmp_path, whole = uninterrupted
    config = _config(tmp_path, cache_dir, stories_file, "crashed")
    first = crashed_run(config, 7, lambda run: run.sample(PROMPT, max_new_tokens=4))
    assert first.checkpoints.steps() == [4]
    output = tmp_path / "crashed"
    assert max(step for tag, step, _ in raw_summaries(output) if tag == "train/loss") == 6

    second = Experiment.prepare(config)
    assert second.weights.start_step == 4
    second.sample(PROMPT, max_new_tokens=4)
    summary = second.train(progress=False)
    after = second.sample(PROMPT, max_new_tokens=4)
    loaded = assert_curves_match_the_rows(output)
    assert sorted(loaded["train/loss"]) == list(range(1, 13))
    assert sorted(loaded["eval/loss"]) == [0, 6, 12]
    assert loaded["eval/loss"][12] == pytest.approx(summary["final_eval_loss"], rel=RTOL)
    samples = {step: np.asarray(value).item().decode() for tag, step, value
               in raw_summaries(output) if tag == tensorboard_log.SAMPLES_TAG}
    assert sorted(samples) == [0, 4, 12]
    assert samples[12] == f"**{PROMPT}**{after.text}".replace("_", r"\_")
    steps, losses = _losses(tmp_path / "crashed")
    whole_steps, whole_losses = _losses(tmp_path / "whole")
    assert steps == whole_steps == list(range(1, 13))  # rows 5-6 of the crashed try replaced
    np.testing.assert_array_equal(losses, whole_losses)
    for a, b in zip(jax.tree.leaves(second.weights.state.params),
                    jax.tree.leaves(whole.weights.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert summary["steps"] == 12 and summary["final_eval_loss"] == whole.summary[
        "final_eval_loss"]
    assert second.checkpoints.steps() == [4, 8, 12]
    # The first step of each attempt (1, and 5 after resuming) warms up: no steady figure.
    rows = _metric_rows(output)
    assert [r["step"] for r in rows if r.get("attempt_start")] == [1, 5]
    steady = [r["step_time_s"] for r in rows if r["step"] not in (1, 5)]
    assert summary["mean_step_time_s"] == pytest.approx(sum(steady) / len(steady))


@pytest.mark.slow
def test_a_finished_run_resumes_to_its_end(uninterrupted, cache_dir, stories_file, capsys):
    tmp_path, whole = uninterrupted
    again = Experiment.prepare(_config(tmp_path, cache_dir, stories_file, "whole"))
    assert again.weights.start_step == 12
    assert "resumed from step 12" in capsys.readouterr().out
    for a, b in zip(jax.tree.leaves(again.weights.state.params),
                    jax.tree.leaves(whole.weights.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Told to stop before where it is, it would save step 12's state as a checkpoint named 8.
    with pytest.raises(ConfigError, match=r"^max_steps: the run in .*whole has done 12 steps, "
                       r"more than the 8 this config trains\. Fix: use max_steps >= 12"):
        Experiment.prepare(_config(tmp_path, cache_dir, stories_file, "whole", max_steps=8))


@pytest.mark.slow
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
    fresh = Experiment.prepare(config.replace(output_dir=str(tmp_path / "p2")))
    expected = [next(fresh.data.train_iterator) for _ in range(5)][3]  # the 4th batch
    resumed = Experiment.prepare(config)
    assert resumed.weights.start_step == 3
    got = next(resumed.data.train_iterator)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])


@pytest.mark.parametrize(("field", "value"), [("maxlen", 32), ("batch_size", 16), ("seed", 6),
                                              ("model", "gemma3-270m")])
@pytest.mark.slow
def test_resuming_with_another_config_names_the_field(uninterrupted, cache_dir, stories_file,
                                                      field, value):
    tmp_path, _ = uninterrupted
    config = _config(tmp_path, cache_dir, stories_file, "whole", **{field: value},
                     mesh={"fsdp": -1})
    with pytest.raises(ConfigError, match=f"^{field}: .* differs from .* of the run "
                                          "checkpointed in") as error:
        Experiment.prepare(config)
    assert "\n" not in str(error.value) and "or a new output_dir" in str(error.value)


@pytest.mark.slow
def test_resume_false_needs_an_empty_directory(uninterrupted, cache_dir, stories_file, tmp_path):
    done, _ = uninterrupted
    with pytest.raises(ConfigError, match="^resume: .* holds the checkpoints of an earlier run"):
        Experiment.prepare(_config(done, cache_dir, stories_file, "whole", resume=False))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="^resume: resume=False but .* is not empty"):
        Experiment.prepare(_config(tmp_path, cache_dir, stories_file, "busy", resume=False))


def _restore_target(run, tmp_path):
    """The abstract state of ``run`` and a data iterator at its start, to restore into."""
    abstract = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                              sharding=leaf.sharding),
                            run.weights.state)
    fresh = Experiment.prepare(run.config.replace(output_dir=str(tmp_path / "fresh")))
    return abstract, fresh.data.train_iterator


@pytest.mark.slow
def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(uninterrupted, tmp_path):
    done, whole = uninterrupted
    copy = tmp_path / "copy"
    shutil.copytree(done / "whole" / "checkpoints", copy / "checkpoints")
    newest = max(int(p.name) for p in (copy / "checkpoints").iterdir() if p.name.isdigit())
    for path in (copy / "checkpoints" / str(newest) / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 64:
            path.write_bytes(path.read_bytes()[:16])  # truncated, as by a full disk
    saved = checkpoints.TrainCheckpoints(str(copy), keep=3)
    abstract, fresh_iterator = _restore_target(whole, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, state = saved.restore_latest(abstract, fresh_iterator)
    assert step == newest - 4 and int(state.step) == step
    assert any(f"{newest} does not load" in str(w.message) for w in caught)


@pytest.mark.slow
def test_checkpoints_of_which_none_loads_are_refused_not_overwritten(uninterrupted, tmp_path):
    """Starting over would overwrite the run the checkpoints hold (e.g. another model's)."""
    done, whole = uninterrupted
    copy = tmp_path / "copy"
    shutil.copytree(done / "whole" / "checkpoints", copy / "checkpoints")
    for path in (copy / "checkpoints").rglob("*"):
        if path.is_file() and path.stat().st_size > 64 and "state" in path.parts:
            path.write_bytes(path.read_bytes()[:16])
    saved = checkpoints.TrainCheckpoints(str(copy), keep=3)
    abstract, fresh_iterator = _restore_target(whole, tmp_path)
    with warnings.catch_warnings(), pytest.raises(ConfigError, match=(
            r"^output_dir: none of the 3 checkpoints in .* loads into this run's state \(step "
            r"\d+: .*\)\. Fix: resume with the settings of the run that wrote them, or use a "
            r"new output_dir")):
        warnings.simplefilter("ignore")
        saved.restore_latest(abstract, fresh_iterator)


def test_a_resume_at_another_depth_is_refused_naming_num_layers():
    with pytest.raises(ConfigError, match=r"^num_layers: 1 differs from 2 of the run "
                       r"checkpointed in runs/x\. Fix: use num_layers=2 to resume it"):
        checkpoints.check_resumable({"num_layers": 1, "model": "gemma3-tiny"},
                                    {"num_layers": 2, "model": "gemma3-tiny"}, "runs/x")


# --- real processes: papermill runs of train.ipynb killed with SIGKILL, then SIGTERM --------

shutil_usage = namedtuple("usage", "total used free")
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "train.ipynb"


def _papermill_command(output_dir, cache_dir, stories_file, name):
    # The tiny preset from random init (the notebook's default is the embedded real base).
    values = dict(model="gemma3-tiny", checkpoint="", lora_rank=0,
                  data_path=str(stories_file), cache_dir=str(cache_dir),
                  output_dir=str(output_dir), batch_size=16, maxlen=128, max_steps=32,
                  eval_every=0, checkpoint_every=8, log_every=1, tokenizer_vocab_size=600,
                  tokenize_workers=1, seed=5, compute_dtype="float32", max_new_tokens=4,
                  num_layers=2)
    argv = [str(NOTEBOOK), str(output_dir.parent / f"{name}.ipynb"), "--no-progress-bar"]
    for key, value in values.items():
        argv += ["-p", key, str(value)]
    return argv


def _rows(output_dir):
    path = output_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _start(argv, runner, started):
    command = [sys.executable, "-m", runner, *argv]
    started.append(subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True))
    return started[-1]


@pytest.fixture
def started():
    """The runs a test started; whatever is left of them when it ends (a failed test leaves a
    stopped kernel) is killed."""
    processes = []
    yield processes
    for process in processes:
        if process.poll() is None:
            _kill_tree(process)


def _checkpoint_steps(output_dir):
    """The steps of the complete checkpoints: Orbax writes into a temporary directory and
    renames it to the step when the save is final."""
    folder = output_dir / "checkpoints"
    return [int(path.name) for path in folder.iterdir() if path.name.isdigit()] if (
        folder.is_dir()) else []


def _wait_for_rows(process, output_dir, rows, timeout=300, checkpoint=None):
    """Until ``metrics.jsonl`` holds ``rows`` steps (and the checkpoint of step ``checkpoint``
    is complete)."""
    deadline = time.monotonic() + timeout
    while _rows(output_dir) < rows or (
            checkpoint is not None and checkpoint not in _checkpoint_steps(output_dir)):
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the run did not reach the step in time"
        time.sleep(0.01)


def _kill_tree(process):
    """SIGKILL to papermill and its kernel at once, as a lost node or an OOM-killed pod. The
    kernel runs in a session of its own: a SIGKILL to papermill's process group would miss it,
    and it would train on (and might save the next checkpoint) until ipykernel's parent poller
    noticed, up to a second later."""
    tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    for member in tree:
        with contextlib.suppress(psutil.Error):
            member.kill()
    process.wait()
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, alive


def _kernel(process, timeout=300):
    """The kernel papermill started for ``process`` (a descendant running ipykernel)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if any("ipykernel" in part for part in child.cmdline()):
                    return child
        time.sleep(0.05)
    raise AssertionError("papermill started no kernel")


def _sigterm_state(pid, field):
    """Whether SIGTERM is in ``pid``'s ``field`` mask of /proc/PID/status (Linux): ``ShdPnd``
    (pending for the process), ``SigCgt`` (a handler installed). None without /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    mask = int(re.search(rf"^{field}:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def _wait_for_training(process, kernel, output_dir, rows, timeout=300):
    """Until the kernel's training loop listens for SIGTERM (its StopRequest's handler: the
    entry point starts papermill and the kernel with SIGTERM ignored). Without /proc: until
    ``metrics.jsonl`` holds ``rows`` rows again."""
    deadline = time.monotonic() + timeout
    while not (caught := _sigterm_state(kernel.pid, "SigCgt")):
        if caught is None:
            _wait_for_rows(process, output_dir, rows, timeout)
            return
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the resumed run did not start training in time"
        time.sleep(0.01)


def _stop(kernel, timeout=30):
    """SIGSTOP, then wait until every thread has stopped: the stop takes effect as each thread
    next runs, and a signal sent before then is delivered at once (seen on a loaded host)."""
    kernel.suspend()
    deadline = time.monotonic() + timeout
    while True:
        try:
            states = [Path(task, "stat").read_text().rsplit(")", 1)[1].split()[0]
                      for task in Path(f"/proc/{kernel.pid}/task").iterdir()]
        except OSError:  # no /proc (or a thread just ended): give it a moment
            time.sleep(0.5)
            return
        if all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"the kernel did not stop: {states}"
        time.sleep(0.005)


def _sigterm_while_stopped(entry, kernel, timeout=60):
    """SIGTERM to the container's entry point while the kernel is stopped (SIGSTOP), which it
    forwards; the kernel goes on once the signal is pending. However fast its steps are, the
    kernel hears it within a step of where it was stopped: no race against the run's end."""
    _stop(kernel)
    assert _sigterm_state(kernel.pid, "SigCgt") is not False, (
        "the run finished training before the test could stop it (a stall of ~24 steps)")
    os.kill(entry.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while not (pending := _sigterm_state(kernel.pid, "ShdPnd")):
        if pending is None:  # no /proc: give the forwarding a generous moment
            time.sleep(2)
            break
        assert time.monotonic() < deadline, "the entry point did not forward SIGTERM"
        time.sleep(0.01)
    kernel.resume()


@pytest.mark.slow
def test_papermill_runs_survive_sigkill_and_sigterm(tmp_path, cache_dir, stories_file, started):
    """SIGKILL to papermill and its kernel between checkpoints, then SIGTERM to the container
    entry point (as GKE sends it), then a last start: the same 32 per-step losses as one
    uninterrupted run, nothing lost from metrics.jsonl."""
    output_dir = tmp_path / "run"
    argv = _papermill_command(output_dir, cache_dir, stories_file, "out")

    killed = _start(argv, "papermill", started)
    kernel = _kernel(killed)
    _wait_for_rows(killed, output_dir, 12, checkpoint=8)  # past the checkpoint at step 8
    _stop(kernel)  # no further step: what it wrote is what the next run finds
    reached = _rows(output_dir)
    _kill_tree(killed)
    # A quick host may have finished a later checkpoint before the kill: the newest complete one
    # is where the next run must resume (a checkpoint still being written is not one).
    resume_step = max(_checkpoint_steps(output_dir))
    assert 12 <= reached < 32 and 8 <= resume_step <= reached

    stopped = _start(argv, "gemmalab.k8s.run_notebook", started)
    kernel = _kernel(stopped)
    # SIGTERM as soon as the resumed run trains: the rest of its steps are the test's slack.
    _wait_for_training(stopped, kernel, output_dir, reached + 4)
    _sigterm_while_stopped(stopped, kernel)
    log = stopped.communicate(timeout=120)[0]
    assert stopped.returncode == run_notebook.PREEMPTED_EXIT_CODE, log[-3000:]
    # Every name passed is a training parameter: the entry point's papermill notes none of them.
    assert "Passed unknown parameter" not in log and "Input Notebook:" in log, log[-3000:]
    notebook = (tmp_path / "out.ipynb").read_text()
    assert f"resumed from step {resume_step}" in notebook
    stop_step = int(re.search(r"stopped by SIGTERM after step (\d+)", notebook).group(1))
    assert resume_step < stop_step < 32, (reached, resume_step, stop_step)
    assert (output_dir / "checkpoints" / str(stop_step)).is_dir()

    finished = _start(argv, "papermill", started)
    log = finished.communicate(timeout=600)[0]
    assert finished.returncode == 0, log[-3000:]
    assert f"resumed from step {stop_step}" in (tmp_path / "out.ipynb").read_text()
    steps, losses = _losses(output_dir)
    assert steps == list(range(1, 33))

    reference = Experiment.prepare(TrainConfig.flat(
        model="gemma3-tiny", data_path=str(stories_file), cache_dir=str(cache_dir),
        output_dir=str(tmp_path / "ref"),
        batch_size=16, maxlen=128, max_steps=32, eval_every=0, checkpoint_every=8,
        tokenizer_vocab_size=600, tokenize_workers=1, seed=5, compute_dtype="float32",
        num_layers=2))
    reference.train(progress=False)
    np.testing.assert_array_equal(losses, _losses(tmp_path / "ref")[1])
    # The same token rows at every step: no batch skipped or seen twice across the restarts.
    assert [r["batch_crc32"] for r in _metric_rows(output_dir)] == [
        r["batch_crc32"] for r in _metric_rows(tmp_path / "ref")]
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["steps"] == 32


# --- guards -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_diverging_run_stops_naming_the_step_and_the_last_good_checkpoint(
        tmp_path, cache_dir, stories_file):
    config = _config(tmp_path, cache_dir, stories_file, "diverge", learning_rate=1e30,
                     checkpoint_every=1, eval_every=0)
    run = Experiment.prepare(config)
    with pytest.raises(TrainingDiverged) as error:
        run.train(progress=False)
    message = str(error.value)
    step = int(re.search(r"at step (\d+);", message).group(1))
    assert step >= 2 and "\n" not in message and "skip_nonfinite=True" in message
    assert f"the last good checkpoint is {run.checkpoints.directory}/{step - 1}" in message


@pytest.mark.slow
def test_skip_nonfinite_leaves_the_weights_of_a_bad_step_alone(tmp_path, cache_dir,
                                                               stories_file):
    config = _config(tmp_path, cache_dir, stories_file, "skip", learning_rate=1e30,
                     eval_every=0, skip_nonfinite=True, max_steps=6)
    run = Experiment.prepare(config)
    summary = run.train(progress=False)
    rows = [json.loads(line) for line in
            (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 6 and summary["skipped_steps"] >= 1
    assert summary["skipped_steps"] == sum(r["skipped"] for r in rows)
    params = run.weights.state.params
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(params))


def test_an_unwritable_or_full_output_dir_is_refused_before_any_work(tmp_path, cache_dir,
                                                                     stories_file, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="^output_dir: cannot write to .*a-file/run"):
        Experiment.prepare(_config(tmp_path, cache_dir, stories_file, "a-file/run"))

    monkeypatch.setattr("shutil.disk_usage", lambda path: shutil_usage(total=1e9, used=1e9,
                                                                       free=1000))
    with pytest.raises(ConfigError, match=r"^output_dir: .* has 0.00 GiB free but a checkpoint "
                                          r"and the final params need ~0.0\d GiB"):
        Experiment.prepare(_config(tmp_path, cache_dir, stories_file, "full"))


@pytest.mark.slow
def test_a_save_cut_short_is_not_a_checkpoint(uninterrupted, tmp_path):
    """What a kill during a save leaves (Orbax's temporary directory, never renamed into place)
    is ignored: the newest finished checkpoint is restored."""
    done, whole = uninterrupted
    copy = tmp_path / "copy" / "checkpoints"
    shutil.copytree(done / "whole" / "checkpoints", copy)
    partial = copy / "16.orbax-checkpoint-tmp-1764460000000000"
    shutil.copytree(copy / "12", partial)
    (partial / "commit_success.txt").unlink(missing_ok=True)
    for path in (partial / "state").rglob("*"):
        if path.is_file():
            path.write_bytes(b"")
    saved = checkpoints.TrainCheckpoints(str(tmp_path / "copy"), keep=3)
    assert saved.steps() == [4, 8, 12]  # (Orbax also deletes the leftover, in its own time)
    abstract, fresh_iterator = _restore_target(whole, tmp_path)
    step, _ = saved.restore_latest(abstract, fresh_iterator)
    assert step == 12
