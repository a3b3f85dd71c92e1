"""The training notebook, executed headlessly by papermill with tiny parameters."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.slow
def test_train_notebook_runs_offline_end_to_end(tmp_path, cache_dir):
    import papermill

    output_dir = tmp_path / "run"
    papermill.execute_notebook(
        str(NOTEBOOKS / "train.ipynb"), str(tmp_path / "train.out.ipynb"),
        # The tiny preset from random init (the notebook's default is the embedded real base).
        parameters=dict(model="gemma3-tiny", checkpoint="", lora_rank=0, learning_rate=None,
                        batch_size=8, maxlen=64, max_steps=6, eval_every=3, embedded_stories=300,
                        tokenizer_vocab_size=600, max_new_tokens=8, output_dir=str(output_dir),
                        cache_dir=str(cache_dir), warmup_ratio=0.25,  # fields not in the cell
                        num_layers=2),
        kernel_name="python3", progress_bar=False, cwd=str(tmp_path),
    )
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["params"]["warmup_ratio"] == 0.25
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert summary["data"]["embedded_corpus"] is True
    assert len((output_dir / "metrics.jsonl").read_text().splitlines()) == 6
    assert (output_dir / "params").is_dir()
    executed = json.loads((tmp_path / "train.out.ipynb").read_text())
    text = json.dumps(executed)
    assert "Once upon a time, there was a girl named Amy." in text
    assert "params saved to" in text


def test_a_misspelt_parameter_stops_the_notebook_at_its_config_naming_the_field(tmp_path):
    """papermill only warns of a name the parameters cell does not list (it does so for every
    field passed), so `-p max_step 3` would train with the default: the config cell refuses it
    in one line, before any data or model work."""
    import papermill

    with pytest.raises(papermill.PapermillExecutionError) as raised:
        papermill.execute_notebook(
            str(NOTEBOOKS / "train.ipynb"), str(tmp_path / "typo.ipynb"),
            parameters=dict(model="gemma3-tiny", checkpoint="", max_step=3, maxlen=64,
                            output_dir=str(tmp_path / "run")),
            kernel_name="python3", progress_bar=False, cwd=str(tmp_path))
    assert raised.value.ename == "ConfigError"
    assert raised.value.evalue == (
        "max_step: was passed to papermill but is neither a training parameter nor one of this "
        "notebook's. Fix: did you mean max_steps?")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("notebook", "typo", "meant"), [
    ("sample_compare", "max_new_token", "max_new_tokens"),
    ("export", "format", "formats"),
    ("launch", "topolgy", "topology"),
])
def test_the_other_notebooks_refuse_a_misspelt_parameter_at_their_first_cell(
        tmp_path, notebook, typo, meant):
    """The notebooks without a TrainConfig check papermill's names against their own: a typo
    stops the run before it loads a run, writes an export or renders a job."""
    import papermill

    with pytest.raises(papermill.PapermillExecutionError) as raised:
        papermill.execute_notebook(
            str(NOTEBOOKS / f"{notebook}.ipynb"), str(tmp_path / "typo.ipynb"),
            parameters={typo: 3}, kernel_name="python3", progress_bar=False, cwd=str(tmp_path))
    assert (raised.value.ename, raised.value.evalue) == ("ConfigError", (
        f"{typo}: was passed to papermill but is not one of this notebook's parameters. "
        f"Fix: did you mean {meant}?"))
    assert raised.value.exec_count == 3  # the first cell after the parameters and papermill's


def test_every_notebook_checks_papermills_names_in_its_first_cell():
    """Each notebook's first cell after its parameters checks what papermill injected: through
    TrainConfig.from_parameters (which refuses unknown names) or refuse_unknown_parameters."""
    for path in NOTEBOOKS.glob("*.ipynb"):
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        tags = [c["metadata"].get("tags", []) for c in cells]
        source = "".join(cells[[("parameters" in t) for t in tags].index(True) + 1]["source"])
        assert ("TrainConfig.from_parameters(globals())" in source
                or "refuse_unknown_parameters(globals())" in source), path.name


@pytest.mark.slow
def test_train_notebook_runs_dpo_and_plots_its_rewards(tmp_path, cache_dir):
    """objective=dpo through the same notebook: the embedded preference set (data_path ""),
    DPO's metrics in metrics.jsonl/eval.jsonl and summary.json, the reward panels drawn."""
    import papermill

    output_dir = tmp_path / "dpo"
    papermill.execute_notebook(
        str(NOTEBOOKS / "train.ipynb"), str(tmp_path / "dpo.out.ipynb"),
        parameters=dict(model="gemma3-tiny", checkpoint="", lora_rank=0, num_layers=2,
                        objective="dpo",
                        batch_size=8, maxlen=512, max_steps=4, eval_every=2, embedded_stories=60,
                        eval_fraction=0.1, tokenizer_vocab_size=2048, max_new_tokens=8,
                        output_dir=str(output_dir), cache_dir=str(cache_dir)),
        kernel_name="python3", progress_bar=False, cwd=str(tmp_path),
    )
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["objective"] == "dpo" and summary["data"]["data_format"] == "preferences"
    assert summary["initial_eval_loss"] == pytest.approx(0.693147, abs=1e-5)  # policy = reference
    assert summary["final_eval_pairs"] == summary["data"]["eval_pairs"] > 0
    rows = [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {"reward_accuracy", "reward_margin", "chosen_logp",
                               "rejected_logp", "kl_estimate"} <= rows[-1].keys()
    evals = [json.loads(x) for x in (output_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 4] and "eval_reward_accuracy" in evals[-1]
    executed = json.loads((tmp_path / "dpo.out.ipynb").read_text())
    figures = [o for c in executed["cells"] for o in c.get("outputs", [])
               if "image/png" in o.get("data", {})]
    assert figures and "params saved to" in json.dumps(executed)


def test_notebooks_have_a_parameters_cell_and_thin_cells():
    for path in NOTEBOOKS.glob("*.ipynb"):
        notebook = json.loads(path.read_text())
        tags = [c.get("metadata", {}).get("tags", []) for c in notebook["cells"]]
        assert sum("parameters" in t for t in tags) == 1, path
        for cell in notebook["cells"]:
            if cell["cell_type"] == "code" and "parameters" not in cell["metadata"].get("tags", []):
                lines = "".join(cell["source"]).splitlines()
                logic = [x for x in lines if x.strip() and not x.strip().startswith("#")]
                assert len(logic) <= 15, f"{path.name}: move logic into gemmalab"


def test_papermill_reads_every_parameter_of_each_notebook():
    """papermill's own reading of each parameters cell (what `papermill --help-notebook` lists,
    and what it checks `-p` names against) finds every name the cell assigns: a line it cannot
    parse (e.g. a second `=` in a comment) is dropped with a warning on every run."""
    import ast

    from papermill.translators import PythonTranslator

    for path in NOTEBOOKS.glob("*.ipynb"):
        notebook = json.loads(path.read_text())
        cell = next(c for c in notebook["cells"] if "parameters" in c["metadata"].get("tags", []))
        source = "".join(cell["source"])
        assigned = [node.targets[0].id for node in ast.parse(source).body
                    if isinstance(node, ast.Assign)]
        read = [parameter.name for parameter in PythonTranslator.inspect({"source": source})]
        assert read == assigned, f"{path.name}: papermill reads {read}, the cell sets {assigned}"


def test_launch_notebook_renders_without_a_cluster(tmp_path):
    """submit=False (the default) renders and shows the objects; nothing reaches a cluster."""
    import papermill

    papermill.execute_notebook(
        str(NOTEBOOKS / "launch.ipynb"), str(tmp_path / "launch.out.ipynb"),
        parameters=dict(topology="2x4", job_name="nb-test", queue="gemmalab",
                        sweep_grid={"learning_rate": [1e-4, 2e-4]}),
        kernel_name="python3", progress_bar=False, cwd=str(tmp_path))
    text = json.loads((tmp_path / "launch.out.ipynb").read_text())
    outputs = json.dumps([c.get("outputs", []) for c in text["cells"]])
    assert "kind: JobSet" in outputs and "nb-test" in outputs
    assert "kueue.x-k8s.io/queue-name: gemmalab" in outputs
    assert "submit=False: nothing was sent to the cluster." in outputs
    # The sweep: one run per point, named and validated, nothing submitted.
    assert "nb-test-0-lr1e-4 {'learning_rate': 0.0001}" in outputs
    assert "nb-test-1-lr2e-4 {'learning_rate': 0.0002}" in outputs
    assert "created:" not in outputs
    assert "tensorboard --logdir gs://my-project-gemmalab-outputs/nb-test/tensorboard" in outputs


@pytest.mark.slow
def test_plan_notebook_writes_the_contract(tmp_path):
    """The fast path for a 4B model on a v6e slice, as a script would call it."""
    import papermill

    papermill.execute_notebook(
        str(NOTEBOOKS / "plan.ipynb"), str(tmp_path / "plan.out.ipynb"),
        parameters=dict(model="gemma3-4b", accelerator="v6e:2x4", mesh={"fsdp": -1},
                        batch_size=16, maxlen=2048, remat="full", exact=False,
                        output_dir=str(tmp_path / "plan")),
        kernel_name="python3", progress_bar=False, cwd=str(tmp_path))
    document = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert document["fits"] is True and document["method"] == "analytic"
    assert document["device_hbm_gib"] == 32 and document["chips"] == 8
    assert document["mesh"] == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
    assert document["remat"] == "full"
    assert 3 < document["per_device_gib"] < 30
    assert set(document["breakdown_gib"]) >= {"params", "optimizer", "activations"}


@pytest.mark.slow
def test_plan_notebook_compiles_for_a_tpu_topology(tmp_path):
    from gemmalab import plan

    if plan.find_libtpu() is None:
        pytest.skip("libtpu is not installed (`make libtpu`; x86-64 Linux)")
    import papermill

    papermill.execute_notebook(
        str(NOTEBOOKS / "plan.ipynb"), str(tmp_path / "plan.out.ipynb"),
        parameters=dict(model="gemma3-tiny", tokenizer_vocab_size=600, accelerator="v6e:2x2",
                        batch_size=8, maxlen=128, exact=True, output_dir=str(tmp_path / "plan"),
                        num_layers=2),
        kernel_name="python3", progress_bar=False, cwd=str(tmp_path))
    document = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert document["method"] == "compiled" and document["fits"] is True
    assert document["breakdown_bytes"]["arguments"] > 0 and document["flops_per_step"] > 0
    assert document["analytic"]["method"] == "analytic"


def test_every_cell_has_an_id():
    """nbformat 4.5 requires them; papermill warns (MissingIDFieldWarning) for each one missing."""
    for path in NOTEBOOKS.glob("*.ipynb"):
        notebook = json.loads(path.read_text())
        assert (notebook["nbformat"], notebook["nbformat_minor"]) >= (4, 5), path.name
        missing = [i for i, cell in enumerate(notebook["cells"]) if not cell.get("id")]
        assert not missing, f"{path.name}: cells {missing} have no id"
