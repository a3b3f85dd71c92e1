"""TensorBoard's event files, read back with tensorboard's own readers: the same steps and values
as metrics.jsonl and eval.jsonl, each step once after a resume, the samples and the config."""

import json
from pathlib import Path

import numpy as np
import pytest

from gemmalab.config import TrainConfig
from gemmalab.model.sampling import Continuation
from gemmalab.train import metrics, tensorboard_log
from tests.helpers.tensorboard import (
    RTOL,
    assert_curves_match_the_rows,
    event_files,
    raw_summaries,
)

CONFIG = TrainConfig.flat(model="gemma3-tiny", output_dir="runs/tb", learning_rate=3e-3,
                          mesh={"data": -1}, batch_size=16)


def never_called(step, values):
    raise AssertionError("a finite step was reported as non-finite")


def write_run(output_dir: Path, steps, *, resume_step=None, offset=0.0, close=True):
    """Steps of a DPO-like run through the sink, evaluated every 4 steps; ``close=False``
    leaves it as a kill would (after the sink's last flush)."""
    board = tensorboard_log.TensorBoardLog(tensorboard_log.logdir(str(output_dir)),
                                           resume_step=resume_step, hparams=CONFIG.to_dict())
    sink = metrics.MetricsSink(str(output_dir), enabled=True, resume_step=resume_step,
                               tensorboard=board)
    log = metrics.StepLog(sink, total_steps=max(steps), start_step=resume_step or 0,
                          steps_per_epoch=10, tokens_per_step=1024, log_every=1, show=False,
                          nonfinite=never_called, flops_per_step=6e12, peak_flops_per_s=1e15)
    for step in steps:
        log.step(step, {"loss": np.float32(3.0 / step + offset),
                        "grad_norm": np.float32(0.5 + step), "useful_tokens": np.float32(900.0),
                        "learning_rate": np.float32(1e-3 * step),
                        "reward_accuracy": np.float32(0.1 * step)},
                 data_wait=0.001 * step, batch_digest=step)
        if step % 4 == 0:
            log.settle()
            values = {"eval_loss": 2.0 / step + offset, "eval_perplexity": 7.0 / step,
                      "eval_reward_accuracy": 0.05 * step}
            log.evaluation(step, lambda values=values: values)
    log.settle()
    if close:
        log.close()
    else:
        sink.flush()
        board.flush(force=True)
    return board


def test_every_row_is_a_curve_with_its_steps_and_values(tmp_path):
    write_run(tmp_path, range(1, 9))
    loaded = assert_curves_match_the_rows(tmp_path)
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "train/reward_accuracy",
            "perf/tokens_per_s", "perf/useful_tokens_per_s", "perf/mfu", "perf/data_wait_s",
            "eval/loss", "eval/perplexity", "eval/reward_accuracy"} <= set(loaded)
    assert loaded["train/loss"][2] == pytest.approx(1.5, rel=RTOL)
    assert loaded["eval/reward_accuracy"] == pytest.approx({4: 0.2, 8: 0.4}, rel=RTOL)
    assert loaded["perf/data_wait_s"][3] == pytest.approx(0.003, rel=RTOL)
    assert not {"train/step", "train/time", "train/batch_crc32", "train/epoch"} & set(loaded)
    assert len(event_files(tmp_path)) == 1


def test_a_resumed_run_shows_each_step_once_with_the_new_values(tmp_path):
    """Killed after step 8 with a checkpoint at 5: steps 6-8 of the first try are dropped, the
    resumed run's 6-10 (other values) replace them, in TensorBoard as in metrics.jsonl."""
    write_run(tmp_path, range(1, 9), close=False)
    write_run(tmp_path, range(6, 11), resume_step=5, offset=10.0)
    loaded = assert_curves_match_the_rows(tmp_path)
    assert sorted(loaded["train/loss"]) == list(range(1, 11))
    assert loaded["train/loss"][5] == pytest.approx(0.6, rel=RTOL)  # the first try's
    assert loaded["train/loss"][6] == pytest.approx(10.5, rel=RTOL)  # the resumed run's
    assert sorted(loaded["eval/loss"]) == [4, 8]
    assert loaded["eval/loss"][8] == pytest.approx(10.25, rel=RTOL)
    assert len(event_files(tmp_path)) == 1  # the old file rewritten, then removed
    sessions = [tag for tag, _, _ in raw_summaries(tmp_path) if tag.startswith("_hparams_/")]
    assert sessions == ["_hparams_/session_start_info"]  # the config once, the resumed run's


def test_rows_an_event_file_lost_in_a_kill_come_back_from_metrics_jsonl(tmp_path):
    """A kill mid-write leaves the event file cut short: what it lacks of the kept rows is
    written again from metrics.jsonl and eval.jsonl."""
    write_run(tmp_path, range(1, 9), close=False)
    (path,) = event_files(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) * 2 // 3 + 5])  # most of it, the last record cut
    assert max(step for tag, step, _ in raw_summaries(tmp_path) if tag == "train/loss") < 8
    write_run(tmp_path, range(9, 11), resume_step=8)
    loaded = assert_curves_match_the_rows(tmp_path)
    assert sorted(loaded["train/loss"]) == list(range(1, 11))
    assert sorted(loaded["eval/reward_accuracy"]) == [4, 8]


def test_a_fresh_run_replaces_old_event_files(tmp_path):
    write_run(tmp_path, range(1, 9))
    write_run(tmp_path, range(1, 5), offset=1.0)
    loaded = assert_curves_match_the_rows(tmp_path)
    assert sorted(loaded["train/loss"]) == [1, 2, 3, 4]
    assert loaded["train/loss"][1] == pytest.approx(4.0, rel=RTOL)


def test_the_config_is_the_hyperparameters(tmp_path):
    from tensorboard.plugins.hparams import metadata

    write_run(tmp_path, [1])
    (content,) = [value.metadata.plugin_data.content
                  for path in event_files(tmp_path)
                  for value in _values(path) if value.tag == metadata.SESSION_START_INFO_TAG]
    info = metadata.parse_session_start_info_plugin_data(content)
    assert info.hparams["learning_rate"].number_value == pytest.approx(3e-3)
    assert info.hparams["batch_size"].number_value == CONFIG.trainer.batch_size
    assert info.hparams["packing"].bool_value is True
    assert info.hparams["output_dir"].string_value == "runs/tb"
    assert info.hparams["max_steps"].string_value == "None"
    assert json.loads(info.hparams["mesh"].string_value) == {"data": -1}
    assert set(info.hparams) == set(CONFIG.to_dict())


def _values(path):
    from tensorboard.backend.event_processing import event_file_loader

    for event in event_file_loader.EventFileLoader(str(path)).Load():
        yield from event.summary.value


def test_samples_are_text_at_their_step(tmp_path):
    board = tensorboard_log.TensorBoardLog(str(tmp_path / "tensorboard"))
    board.samples(0, [Continuation("Once <b>", " upon a_time")])
    board.close()
    board.samples(12, [Continuation("Once", " after"), Continuation("Tom", " ran.")])
    texts = {(step, np.asarray(value).item().decode()) for tag, step, value
             in raw_summaries(tmp_path) if tag == tensorboard_log.SAMPLES_TAG}
    assert texts == {(0, r"**Once &lt;b&gt;** upon a\_time"),
                     (12, "**Once** after\n\n**Tom** ran.")}
    assert len(event_files(tmp_path)) == 2  # the sample after closing went to a file of its own


def test_only_the_main_process_writes_and_tensorboard_false_writes_nothing(tmp_path):
    def board_of(main=True, **fields):
        config = TrainConfig.flat(output_dir=str(tmp_path), **fields)
        return tensorboard_log.for_run(config.runtime.output_dir, resume_step=0, hparams={},
                                       enabled=config.metrics.tensorboard and main)

    assert board_of(tensorboard=False) is None
    assert board_of(main=False) is None
    assert not (tmp_path / "tensorboard").exists()
    board = board_of()
    assert board.directory == f"{tmp_path}/tensorboard"
    assert metrics.MetricsSink(str(tmp_path), enabled=False, tensorboard=board).tensorboard is None
