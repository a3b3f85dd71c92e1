import pytest

from gemmalab.config import TrainConfig
from gemmalab.errors import ConfigError
from gemmalab.inspect import compare
from gemmalab.train.experiment import Experiment
from tests.helpers import PROMPT


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache_dir, stories_file):
    output_dir = tmp_path_factory.mktemp("compare") / "run"
    config = TrainConfig.flat(model="gemma3-tiny", data_path=str(stories_file),
                              cache_dir=str(cache_dir),
                         output_dir=str(output_dir), batch_size=8, maxlen=64, max_steps=8,
                         eval_every=0, tokenizer_vocab_size=600, tokenize_workers=1, seed=4,
                         num_layers=2)
    experiment = Experiment.prepare(config)
    summary = experiment.train(progress=False)
    experiment.save()
    return compare.load_run(str(output_dir)), summary


@pytest.mark.slow
def test_load_run_rebuilds_the_run(run):
    loaded, summary = run
    assert loaded.config.trainer.seed == 4 and loaded.summary["steps"] == summary["steps"] == 8
    assert loaded.model.config.num_embed == 600


@pytest.mark.slow
def test_perplexity_before_and_after(run):
    loaded, summary = run
    contenders = [compare.base_params(loaded), compare.finetuned_params(loaded)]
    assert contenders[0].name == "base (random init)"
    table = compare.perplexity_table(loaded, contenders)
    # The base is the run's own initialisation: same numbers as the run measured.
    assert table.loc["base (random init)", "eval loss"] == pytest.approx(
        summary["initial_eval_loss"], rel=1e-5)
    assert table.loc["fine-tuned", "eval loss"] == pytest.approx(summary["final_eval_loss"],
                                                                 rel=1e-5)
    compare.perplexity_figure(table)


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True])
def test_samples_side_by_side(run, chat):
    loaded, _ = run
    contenders = [compare.base_params(loaded), compare.finetuned_params(loaded)]
    table = compare.samples_table(loaded, contenders, [PROMPT, "Tom had a"], max_new_tokens=6,
                                  temperature=0.8, top_p=0.9, seed=1, chat=chat)
    assert list(table.frame.columns) == ["base (random init)", "fine-tuned"]
    assert len(table.frame) == 4  # 2 prompts x (greedy, top-p)
    again = compare.samples_table(loaded, contenders, [PROMPT, "Tom had a"], max_new_tokens=6,
                                  temperature=0.8, top_p=0.9, seed=1, chat=chat)
    assert table.frame.equals(again.frame)  # fixed seed: reproducible
    # The rendering carries every continuation as data for the notebook regression tests.
    data, metadata = table._repr_mimebundle_()
    records = metadata["gemmalab/samples"]
    assert [r["label"] for r in records] == [
        f"{model} / {method}" for model in ("base (random init)", "fine-tuned")
        for method in ("greedy", "top-p 0.9 T=0.8") for _ in range(2)]
    assert sorted(table.frame.to_numpy().ravel()) == sorted(r["text"] for r in records)
    assert "top-p 0.9 T=0.8" in data["text/plain"] and "<table" in data["text/html"]
    for record in records:
        assert record["text"].startswith(record["decided"])
        if chat or "top-p" in record["label"]:
            assert record["decided"] == "" and not record["complete"]


@pytest.mark.slow
def test_a_chains_random_init_base_is_the_first_runs_own(run, tmp_path):
    """A run continuing a random-init run (say DPO, seed 9, after SFT, seed 4): the lineage's
    base is the first run's initialisation (seed 4), not one drawn with the last run's seed."""
    import dataclasses
    import shutil

    import jax
    import numpy as np

    from gemmalab.model import presets

    parent, _ = run
    child_dir = tmp_path / "dpo"
    shutil.copytree(f"{parent.output_dir}/params", child_dir / "params")
    child = dataclasses.replace(parent, output_dir=str(child_dir), config=parent.config.replace(
        checkpoint=f"{parent.output_dir}/params", seed=9))
    base, first, second = compare.lineage(child)
    assert base.name == "base (random init)"
    assert first.name.startswith("SFT (") and second.name == f"SFT ({child_dir})"
    started = presets.init_params(parent.model, seed=4, sample_length=parent.config.data.maxlen)
    for a, b in zip(jax.tree.leaves(base.params), jax.tree.leaves(started), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_missing_run(tmp_path):
    with pytest.raises(ConfigError, match="^finetuned: no summary.json"):
        compare.load_run(str(tmp_path))


def test_a_run_continuing_another_finds_its_parent(tmp_path):
    import json

    sft = tmp_path / "sft"
    sft.mkdir()
    params = TrainConfig.flat(model="gemma3-tiny").to_dict()
    (sft / "summary.json").write_text(json.dumps({"params": params}))
    output_dir, config = compare._parent_run(f"{sft}/params/")
    assert output_dir == str(sft) and config.trainer.objective == "sft"
    assert compare._parent_run(str(tmp_path / "elsewhere" / "params")) is None
    assert compare._parent_run("embedded:gemma3-270m") is None


def test_a_dpo_runs_perplexity_is_of_its_chosen_replies_alone():
    import numpy as np

    from gemmalab.inspect.compare import chosen_replies_only

    # Two pairs in one row (chosen 1, rejected 2, chosen 3, rejected 4), then padding (0).
    segments = np.asarray([[1, 1, 1, 2, 2, 3, 3, 4, 4, 0]])
    mask = np.asarray([[0, 1, 1, 0, 1, 0, 1, 0, 1, 0]], np.float32)
    row = {"segment_ids": segments, "loss_mask": mask, "tokens": segments}
    [batch] = chosen_replies_only([row])
    np.testing.assert_array_equal(batch["loss_mask"], [[0, 1, 1, 0, 0, 0, 1, 0, 0, 0]])
    assert batch["loss_mask"].dtype == np.float32 and batch["tokens"] is segments


def test_a_repeated_prompt_is_refused_before_any_sampling():
    """The table has a row per prompt: a repeat failed in pandas after every sample was made."""
    with pytest.raises(ConfigError, match=r"^prompts: repeats a prompt\. Fix: give each prompt "
                       r"once"):
        compare.samples_table(None, [], ["Hi", "Hi"], max_new_tokens=8, temperature=0.8,
                              top_p=0.9, seed=0)
