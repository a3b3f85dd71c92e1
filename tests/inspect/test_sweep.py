"""The sweep table: one row per run, the parameters that differ, the headline figures."""

import json

import pytest

from gemmalab.config import TrainConfig
from gemmalab.errors import ConfigError
from gemmalab.inspect import sweep


def _run(root, name, final_eval_loss=None, **params):
    directory = root / name
    directory.mkdir(parents=True)
    if final_eval_loss is not None:
        config = TrainConfig.flat(output_dir=str(directory), **params).to_dict()
        (directory / "summary.json").write_text(json.dumps({
            "params": config, "steps": 20, "final_train_loss": 2.5,
            "final_eval_loss": final_eval_loss, "final_eval_perplexity": 2.0 ** final_eval_loss,
            "useful_tokens_per_s": 1000.0, "train_seconds": 12.0}))
    return str(directory)


def test_one_row_per_point_with_the_swept_parameters(tmp_path):
    _run(tmp_path, "s-0", 3.0, learning_rate=1e-4, lora_rank=8)
    _run(tmp_path, "s-1", 2.5, learning_rate=2e-4, lora_rank=8)
    _run(tmp_path, "s-2")  # still running (or failed): no summary.json yet
    table = sweep.summary_table(str(tmp_path / "s-*"))
    assert list(table.index) == ["s-0", "s-1", "s-2"]
    # lora_rank is the same everywhere: not a column; output_dir differs but is not a parameter.
    assert list(table.columns) == ["learning_rate", "steps", "train loss", "eval loss",
                                   "eval perplexity", "useful tokens/s", "train s", "status"]
    assert table.loc["s-1", "learning_rate"] == pytest.approx(2e-4, rel=1e-12)
    assert table.loc["s-0", "eval perplexity"] == pytest.approx(8.0, rel=1e-12)
    assert list(table["status"]) == ["done", "done", "no summary.json"]


def test_a_sweeps_directory_a_list_or_a_mapping(tmp_path):
    root = tmp_path / "moved"  # the index's points are found as its siblings, wherever it is
    a, b = _run(root, "p-0", 3.0, seed=0), _run(root, "p-1", 2.0, seed=1)
    (root / "sweep.json").write_text(json.dumps({"points": [
        {"name": "p-0", "values": {"seed": 0}, "output_dir": "runs/p/p-0"},
        {"name": "p-1", "values": {"seed": 1}, "output_dir": "runs/p/p-1"}]}))
    assert sweep.run_dirs(str(root)) == {"p-0": f"{root}/p-0", "p-1": f"{root}/p-1"}
    assert list(sweep.summary_table(str(root))["seed"]) == [0, 1]
    assert list(sweep.summary_table([a, b]).index) == ["p-0", "p-1"]
    assert list(sweep.summary_table({"first": a})["eval loss"]) == [3.0]
    with pytest.raises(ConfigError, match="^runs: .* matches no directory"):
        sweep.run_dirs(str(tmp_path / "nothing-*"))


def test_the_command_prints_the_table(tmp_path, capsys):
    _run(tmp_path, "r-0", 3.0, seed=0)
    _run(tmp_path, "r-1", 2.0, seed=1)
    assert sweep.main([str(tmp_path / "r-0"), str(tmp_path / "r-1")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["seed", "steps", "train", "loss", "eval", "loss", "eval",
                                "perplexity", "useful", "tokens/s", "train", "s", "status"]
    assert lines[2].split()[:2] == ["r-0", "0"] and lines[3].split()[-1] == "done"
    assert sweep.main([]) == 2
