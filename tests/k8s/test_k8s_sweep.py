"""Sweeps: the grid, the points' names, validation before anything is rendered or run, the queued
manifests, and the local mode (with a stub runner; one real tiny sweep is marked slow)."""

from __future__ import annotations

import json
import re
import sys

import pytest
import yaml

from gemmalab.errors import ConfigError
from gemmalab.k8s import kueue, sweep
from gemmalab.k8s.config import MAX_NAME, ClusterConfig
from tests.helpers.k8s import pod_specs

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def test_the_grid_is_the_product_of_the_y_entries_and_reads_1e_4_as_a_float():
    values = sweep.sweep_values(["learning_rate: [1e-4, 2e-4]", "lora_rank: [8, 16]"])
    assert values == [{"learning_rate": 1e-4, "lora_rank": 8},
                      {"learning_rate": 1e-4, "lora_rank": 16},
                      {"learning_rate": 2e-4, "lora_rank": 8},
                      {"learning_rate": 2e-4, "lora_rank": 16}]
    assert sweep.sweep_values({"seed": [0, 1]}) == [{"seed": 0}, {"seed": 1}]
    # A list of parameter sets, crossed with the grid.
    points = [{"lora_rank": 8}, {"lora_rank": 0, "learning_rate": 1e-5}]
    assert sweep.sweep_values({"seed": [0, 1]}, points) == [
        {"lora_rank": 8, "seed": 0}, {"lora_rank": 8, "seed": 1},
        {"lora_rank": 0, "learning_rate": 1e-5, "seed": 0},
        {"lora_rank": 0, "learning_rate": 1e-5, "seed": 1}]
    assert sweep.sweep_values((), points) == points
    # Neither: no sweep at all (launch.ipynb submitted a second run of its job as "<job>-0").
    assert sweep.sweep_values({}, []) == sweep.sweep_values() == []


@pytest.mark.parametrize(("grid", "points", "message"), [
    (["lora_rank: 8"], (), "sweep.lora_rank: 8 is not a non-empty list of values. Fix: write [8]"),
    (["lora_rank: []"], (), "sweep.lora_rank: [] is not a non-empty list"),
    (["[8, 16]"], (), "sweep: '[8, 16]' is not a YAML mapping"),
    (["seed: [0]", "seed: [1]"], (), "sweep.seed: is swept twice"),
    (["seed: [0]"], [{"seed": 1}], "sweep.seed: is both in --points and in a -y grid"),
    ((), [8, 16], "points: is not a list of parameter mappings"),
])
def test_bad_grids_are_one_line_errors(grid, points, message):
    with pytest.raises(ConfigError) as raised:
        sweep.sweep_values(grid, points)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_points_from_a_yaml_file(tmp_path):
    path = tmp_path / "points.yaml"
    path.write_text("- {learning_rate: 1e-4, lora_rank: 8}\n- {lora_rank: 16}\n")
    assert sweep.sweep_values((), str(path)) == [{"learning_rate": 1e-4, "lora_rank": 8},
                                                 {"lora_rank": 16}]
    with pytest.raises(ConfigError, match="^points: no file"):
        sweep.sweep_values((), str(tmp_path / "missing.yaml"))


def test_names_carry_the_index_and_readable_values():
    values = sweep.sweep_values(["learning_rate: [1e-4, 2.5e-5]", "lora_rank: [8, 16]"])
    assert sweep.point_names("lr", values) == ["lr-0-lera1e-4-lora8", "lr-1-lera1e-4-lora16",
                                              "lr-2-lera2p5e-5-lora8", "lr-3-lera2p5e-5-lora16"]
    assert sweep.point_names("s", [{"seed": 0}, {"seed": -1}, {"warmup_ratio": 0.05}]) == [
        "s-0-s0", "s-1-sm1", "s-2-wr0p05"]
    # Values without a readable form (lists), or names over the limit: the index alone.
    assert sweep.point_names("m", [{"mesh": {"data": 2}}, {"mesh": {"data": 4}}]) == ["m-0", "m-1"]
    twelve = [{"seed": i} for i in range(12)]
    assert sweep.point_names("a" * 58, twelve, limit=63)[0] == "a" * 58 + "-00"
    with pytest.raises(ConfigError, match="^job_name: .* leaves no room for the point index"):
        sweep.point_names("a" * 62, twelve, limit=63)


def test_a_sweep_of_more_than_the_limit_asks_for_yes():
    values = [{"seed": i} for i in range(sweep.MAX_POINTS_WITHOUT_YES + 1)]
    with pytest.raises(ConfigError, match=f"^sweep: 17 points are more than "
                                          f"{sweep.MAX_POINTS_WITHOUT_YES}. Fix: pass --yes"):
        sweep.cluster_sweep({"job_name": "big"}, values)
    assert len(sweep.cluster_sweep({"job_name": "big"}, values, yes=True)) == 17
    assert len(sweep.cluster_sweep({"job_name": "ok"}, values[:16])) == 16
    with pytest.raises(ConfigError, match="^sweep: has no points"):
        sweep.cluster_sweep({"job_name": "none"}, [])


def test_cluster_points_are_valid_jobset_names_with_their_own_outputs_and_one_queue():
    template = dict(job_name="a-long-sweep-name-for-multislice", topology="2x4", num_slices=2,
                    queue="gemmalab", params={"batch_size": 64, "model": "gemma3-1b"})
    values = sweep.sweep_values({"learning_rate": [1e-4, 2e-4], "lora_rank": [8, 16]})
    configs = sweep.cluster_sweep(ClusterConfig(**template), values)
    names = [c.job_name for c in configs]
    assert len(set(names)) == 4 and all(DNS_1035.match(n) for n in names)
    assert all(len(c.longest_pod_name) <= MAX_NAME for c in configs)
    assert len({c.output_dir for c in configs}) == 4
    assert {c.queue for c in configs} == {"gemmalab"}
    assert [dict(c.params) for c in configs][3] == {"batch_size": 64, "model": "gemma3-1b",
                                                    "learning_rate": 2e-4, "lora_rank": 16}


def test_every_point_is_validated_before_any_is_rendered():
    values = [{"lora_rank": 8}, {"lora_rank": -1}]
    with pytest.raises(ConfigError) as raised:
        sweep.cluster_sweep({"job_name": "bad"}, values)
    assert str(raised.value).startswith("params.lora_rank (sweep point bad-1-lrm1): -1 < 0")
    # A point that does not divide over the devices of the slice.
    with pytest.raises(ConfigError, match=r"^params.batch_size \(sweep point b-1-bs12\): 12 is "
                                          "not divisible by the 8"):
        sweep.cluster_sweep({"job_name": "b", "topology": "2x4"}, [{"batch_size": 16},
                                                                  {"batch_size": 12}])
    with pytest.raises(ConfigError, match=r"^params.output_dir \(sweep point o-0-od"):
        sweep.cluster_sweep({"job_name": "o"}, [{"output_dir": "/tmp/x"}])


def test_cli_sweep_prints_one_queued_run_per_point(capsys, tmp_path):
    from gemmalab.k8s.cli import main

    assert main(["sweep", "--name", "lr-rank", "--queue", "gemmalab", "--topology", "2x4",
                 "-p", "batch_size", "64", "-y", "learning_rate: [1e-4, 2e-4]",
                 "-y", "lora_rank: [8, 16]"]) == 0
    captured = capsys.readouterr()
    docs = list(yaml.safe_load_all(captured.out))
    assert [d["kind"] for d in docs] == ["JobSet"] * 4
    assert [d["metadata"]["name"] for d in docs] == [
        "lr-rank-0-lera1e-4-lora8", "lr-rank-1-lera1e-4-lora16", "lr-rank-2-lera2e-4-lora8",
        "lr-rank-3-lera2e-4-lora16"]
    assert {d["metadata"]["labels"][kueue.QUEUE_LABEL] for d in docs} == {"gemmalab"}
    args = pod_specs(docs[2])[0]["containers"][0]["args"]
    assert args[args.index("output_dir") + 1] == "/outputs/lr-rank-2-lera2e-4-lora8"
    assert args[args.index("learning_rate") + 1] == "0.0002"
    assert "4 runs: lr-rank-0-lera1e-4-lora8," in captured.err
    points = tmp_path / "points.yaml"
    points.write_text("- {lora_rank: 8}\n- {lora_rank: 16, learning_rate: 3e-4}\n")
    assert main(["sweep", "--points", str(points)]) == 0
    assert len(list(yaml.safe_load_all(capsys.readouterr().out))) == 2
    assert main(["sweep", "-y", "seed: [0, 1, 2, 3, 4, 5]", "-y", "lora_rank: [4, 8, 16]"]) == 2
    assert "ConfigError: sweep: 18 points are more than 16" in capsys.readouterr().err
    assert main(["sweep", "--yes", "-y", "seed: [0, 1, 2, 3, 4, 5]",
                 "-y", "lora_rank: [4, 8, 16]"]) == 0


def test_local_sweep_runs_the_points_one_after_another(tmp_path):
    root = tmp_path / "sweep"
    values = sweep.sweep_values({"learning_rate": [1e-3, 3e-3]})
    points = sweep.local_sweep("tiny", {"model": "gemma3-tiny", "max_steps": 4}, values,
                               output_root=str(root))
    assert [p.output_dir for p in points] == [f"{root}/tiny-0-lr1e-3", f"{root}/tiny-1-lr3e-3"]
    calls = []

    def runner(argv):
        calls.append(argv)
        return 1 if len(calls) == 1 else 0  # the first fails; the second still runs

    statuses = sweep.run_local(points, runner=runner, log=lambda line: None)
    assert statuses == {"tiny-0-lr1e-3": 1, "tiny-1-lr3e-3": 0}
    first = calls[0]
    assert first[:3] == [sys.executable, "-m", "gemmalab.headless"]
    assert first[3].endswith("notebooks/train.ipynb")
    assert first[4] == f"{root}/tiny-0-lr1e-3/train.ipynb"
    assert first[5:8] == ["-p", "output_dir", f"{root}/tiny-0-lr1e-3"]
    assert first[8:] == ["-p", "learning_rate", "0.001", "-p", "max_steps", "4",
                         "-p", "model", "gemma3-tiny", "--no-progress-bar"]
    assert all((root / p.name).is_dir() for p in points)
    index = json.loads((root / "sweep.json").read_text())
    assert index["points"][1] == {"name": "tiny-1-lr3e-3", "values": {"learning_rate": 3e-3},
                                  "output_dir": f"{root}/tiny-1-lr3e-3"}


def test_local_sweep_validates_every_point_first(tmp_path):
    with pytest.raises(ConfigError, match=r"^params.lora_rnak \(sweep point t-1-lorn8\): is not a "
                                          "parameter of notebooks/train.ipynb"):
        sweep.local_sweep("t", {}, [{"lora_rank": 8}, {"lora_rnak": 8}])
    with pytest.raises(ConfigError, match=r"^params.output_dir \(sweep point t-0-od.*\): is set "
                                          "from the sweep. Fix: leave it out: each point"):
        sweep.local_sweep("t", {}, [{"output_dir": "x"}])
    with pytest.raises(ConfigError, match="^job_name: 'Tiny' is not a DNS-1035 label"):
        sweep.local_sweep("Tiny", {}, [{"seed": 0}])


@pytest.mark.slow
def test_a_real_tiny_sweep_here_then_its_table_and_its_runs_side_by_side(tmp_path, cache_dir):
    """Two points of the tiny preset through train.ipynb (papermill, one after another), the
    table of their summaries, and sample_compare's loader reading both runs at once."""
    from gemmalab.inspect import compare
    from gemmalab.inspect.sweep import summary_table

    fixed = dict(model="gemma3-tiny", checkpoint="", lora_rank=0, num_layers=2, batch_size=8,
                 maxlen=64,
                 max_steps=3, eval_every=0, embedded_stories=300, tokenizer_vocab_size=600,
                 max_new_tokens=4, cache_dir=str(cache_dir))
    points = sweep.local_sweep("tiny", fixed, sweep.sweep_values({"learning_rate": [1e-3, 3e-3]}),
                               output_root=str(tmp_path / "tiny"))
    assert sweep.run_local(points, log=lambda line: None) == {"tiny-0-lr1e-3": 0,
                                                              "tiny-1-lr3e-3": 0}
    table = summary_table(str(tmp_path / "tiny"))
    assert list(table.index) == ["tiny-0-lr1e-3", "tiny-1-lr3e-3"]
    assert list(table["learning_rate"]) == [1e-3, 3e-3] and list(table["steps"]) == [3, 3]
    assert list(table["status"]) == ["done", "done"]
    runs = compare.load_runs(str(tmp_path / "tiny"))
    assert [r.config.optimizer.learning_rate for r in runs] == [1e-3, 3e-3]
    contenders = compare.contenders_of(runs)
    assert [c.name for c in contenders] == ["base (random init)", "tiny-0-lr1e-3",
                                            "tiny-1-lr3e-3"]
    perplexity = compare.perplexity_table(runs[0], contenders)
    assert list(perplexity.index) == [c.name for c in contenders]
    # The runs' own final held-out loss, recomputed on the same split (float32 sums: 1e-4).
    for name in ("tiny-0-lr1e-3", "tiny-1-lr3e-3"):
        assert perplexity.loc[name, "eval loss"] == pytest.approx(table.loc[name, "eval loss"],
                                                                  rel=1e-4)
