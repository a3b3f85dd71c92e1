"""A whole run on a small corpus, and every bad-input error the run must raise early."""

import dataclasses
import json

import numpy as np
import pytest

from gemmalab.data import token_cache
from gemmalab.errors import ConfigError
from gemmalab.model import presets
from gemmalab.train.experiment import Experiment
from tests.helpers import PROMPT, write_text
from tests.helpers.runs import small_config


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, cache_dir, stories_file):
    tmp_path = tmp_path_factory.mktemp("experiment")
    # The tiny preset's last two layers: what these tests check holds at any depth.
    experiment = Experiment.prepare(small_config(tmp_path, cache_dir, stories_file, num_layers=2))
    before = experiment.sample(PROMPT, max_new_tokens=8)
    summary = experiment.train(progress=False)
    saved = experiment.save()
    return experiment, summary, saved, before


def test_a_run_learns_and_reports(finished_run):
    experiment, summary, _, _ = finished_run
    assert summary["steps"] == 12
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    assert summary["final_eval_perplexity"] < summary["initial_eval_perplexity"] / 3
    assert summary["initial_eval_perplexity"] == pytest.approx(
        np.exp(summary["initial_eval_loss"]), rel=1e-6)
    assert 0.5 < summary["useful_token_share"] <= 1.0
    assert summary["params"]["batch_size"] == 8
    assert summary["model_config"]["num_embed"] == 600
    assert [r["step"] for r in experiment.eval_history] == [0, 5, 10, 12]


def test_flops_mfu_and_start_up_are_reported(finished_run):
    experiment, summary, _, _ = finished_run
    config = experiment.prepared.model_config
    tokens = 8 * 64
    # 6 FLOPs per weight per token, plus attention's scores and values (12 * layers * heads *
    # head_dim * maxlen per token): the count MFU is measured against.
    expected = tokens * (6 * summary["num_params"]
                         + 12 * config.num_layers * config.num_heads * config.head_dim * 64)
    assert summary["model_flops_per_step"] == pytest.approx(expected, rel=1e-9)
    # XLA's count of the compiled step (optimizer, norms, softmax besides the matmuls).
    assert 0.8 < summary["compiled_flops_per_step"] / summary["model_flops_per_step"] < 1.5
    steady = experiment.history[1:]
    assert summary["model_flops_per_s"] == pytest.approx(
        expected * len(steady) / sum(r["step_time_s"] for r in steady), rel=1e-6)
    assert summary["mfu"] is None and summary["peak_flops_per_s"] is None  # CPUs: no known peak
    # Against the host's own measured bf16 matmul rate instead (never a fixed figure: it is
    # this machine's). Not asserted below 1: a loaded host may have measured a low peak.
    host = summary["host_matmul_flops_per_s"]
    assert host > 0 and summary["cpu_mfu"] > 0
    assert summary["cpu_mfu"] == pytest.approx(summary["model_flops_per_s"] / host, rel=1e-9)
    for record in experiment.history:
        assert record["model_flops_per_s"] == pytest.approx(expected / record["step_time_s"])
        assert record["cpu_mfu"] == pytest.approx(record["model_flops_per_s"] / host, rel=1e-9)
    startup = summary["startup"]
    phases = ("before_prepare_s", "checks_s", "host_peak_s", "data_s", "model_s", "compile_s",
              "initial_eval_s")
    assert set(startup) == {*phases, "to_first_step_s"}
    assert all(startup[phase] > 0 for phase in phases)
    # Disjoint stretches of the time to the first step, each timed from where the previous one
    # ended: together at most that time (1 ms for its two clocks, time.time and perf_counter).
    assert startup["to_first_step_s"] >= sum(startup[phase] for phase in phases) - 1e-3


def test_outputs_on_disk(finished_run):
    experiment, summary, saved, _ = finished_run
    output = experiment.config.runtime.output_dir
    with open(f"{output}/metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, 13))
    for record in records:
        assert {"step", "loss", "useful_tokens", "step_time_s", "learning_rate", "grad_norm",
                "tokens", "data_wait_s", "tokens_per_s"} <= set(record)
        assert 0 < record["useful_tokens"] <= record["tokens"] == 8 * 64
    with open(f"{output}/summary.json") as f:
        on_disk = json.load(f)
    for key in ("initial_train_loss", "final_train_loss", "initial_eval_loss", "final_eval_loss",
                "initial_eval_perplexity", "final_eval_perplexity", "useful_tokens_per_s",
                "train_seconds", "params", "model_config", "model_flops_per_s",
                "host_matmul_flops_per_s", "cpu_mfu"):
        assert key in on_disk
    assert on_disk["cpu_mfu"] == pytest.approx(
        on_disk["model_flops_per_s"] / on_disk["host_matmul_flops_per_s"], rel=1e-9)
    assert on_disk["final_eval_loss"] == summary["final_eval_loss"]
    assert presets.config_from_dict(on_disk["model_config"]) == experiment.prepared.model_config
    assert saved == f"{output}/params"


def test_saved_params_load_with_gemma_and_reproduce_eval(finished_run):
    import jax
    from gemma import gm

    experiment, summary, saved, _ = finished_run
    loaded = gm.ckpts.load_params(saved)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(experiment.weights.state.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rebuilt = presets.build_model(presets.config_from_dict(summary["model_config"]),
                                  param_dtype=np.float32)
    weights = dataclasses.replace(experiment.weights,
                                  state=experiment.weights.state.replace(params=loaded))
    experiment_copy = dataclasses.replace(experiment, model=rebuilt, weights=weights)
    assert experiment_copy.evaluate()["eval_loss"] == pytest.approx(summary["final_eval_loss"],
                                                                    rel=1e-5)


def test_resume_from_saved_params(finished_run, tmp_path, cache_dir, stories_file):
    experiment, summary, saved, _ = finished_run
    again = Experiment.prepare(small_config(tmp_path, cache_dir, stories_file, checkpoint=saved))
    assert again.evaluate()["eval_loss"] == pytest.approx(summary["final_eval_loss"], rel=1e-5)


def test_saved_params_load_straight_into_fsdp_shards(finished_run, tmp_path, cache_dir,
                                                     stories_file):
    _, summary, saved, _ = finished_run
    again = Experiment.prepare(small_config(tmp_path, cache_dir, stories_file, checkpoint=saved,
                                            mesh={"fsdp": -1}))
    linear = again.weights.state.params["layer_0"]["mlp"]["linear"]
    assert linear.sharding.spec == ("tensor", "fsdp") or linear.sharding.spec[1] == "fsdp"
    assert linear.addressable_shards[0].data.shape == (linear.shape[0], linear.shape[1] // 8)
    # Another mesh sums in another order (bfloat16 compute): close, not bit-equal.
    assert again.evaluate()["eval_loss"] == pytest.approx(summary["final_eval_loss"], rel=5e-3)


def test_a_checkpoint_of_another_model_is_a_one_line_error(finished_run, tmp_path, cache_dir,
                                                           stories_file):
    _, _, saved, _ = finished_run
    with pytest.raises(ConfigError, match="^checkpoint: .* does not match gemma3-270m"):
        Experiment.prepare(small_config(tmp_path, cache_dir, stories_file, checkpoint=saved,
                                        model="gemma3-270m", mesh={"fsdp": -1}))


def test_sampling_before_and_after(finished_run):
    experiment, _, _, before = finished_run
    after = experiment.sample([PROMPT, "Tom had a"], max_new_tokens=8)
    assert isinstance(before.text, str) and before.prompt == PROMPT and len(after) == 2
    assert [c.prompt for c in after] == [PROMPT, "Tom had a"]
    assert all(isinstance(c.text, str) and c.text.startswith(c.decided) for c in after)


# --- bad input: one line, naming the parameter, before tokenization/initialisation -----------


@pytest.fixture
def nothing_expensive(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("expensive work started before the input was validated")

    monkeypatch.setattr(token_cache, "load_or_build_token_cache", forbidden)
    monkeypatch.setattr(presets, "build_model", forbidden)


def _expect(parameter, fragment, config):
    with pytest.raises(ConfigError) as error:
        Experiment.prepare(config)
    message = str(error.value)
    assert message.startswith(f"{parameter}: "), message
    assert fragment in message and "Fix: " in message and "\n" not in message


def test_batch_size_not_divisible_by_devices(tmp_path, cache_dir, stories_file,
                                             nothing_expensive):
    _expect("batch_size", "not divisible by the 8 data-parallel ways",
            small_config(tmp_path, cache_dir, stories_file, batch_size=12))


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(None, "does not exist"), (b"", "is empty"), (b"\xff\xfe bad" + b"<|endoftext|>", "UTF-8"),
     (b"no separator here", "no <|endoftext|> separator")],
)
def test_bad_data_path(tmp_path, cache_dir, content, fragment, nothing_expensive):
    path = tmp_path / "data.txt"
    if content is not None:
        write_text(path, content)
    _expect("data_path", fragment, small_config(tmp_path, cache_dir, path))


def test_unknown_tokenizer(tmp_path, cache_dir, stories_file, nothing_expensive):
    _expect("tokenizer", "unknown tokenizer or missing file 'sentencepiece'",
            small_config(tmp_path, cache_dir, stories_file, tokenizer="sentencepiece"))


def test_unknown_checkpoint(tmp_path, cache_dir, stories_file, nothing_expensive):
    _expect("checkpoint", "unknown checkpoint 'GEMMA3_270M'",
            small_config(tmp_path, cache_dir, stories_file, model="gemma3-270m",
                         checkpoint="GEMMA3_270M"))


def test_gcs_paths_without_credentials(tmp_path, cache_dir, stories_file, monkeypatch,
                                       nothing_expensive):
    monkeypatch.setattr("gemmalab.storage._gcs_credentials_found", lambda: False)
    _expect("data_path", "gs://bucket/stories.txt is on Google Cloud Storage",
            small_config(tmp_path, cache_dir, "gs://bucket/stories.txt"))
    _expect("output_dir", "gs://bucket/run is on Google Cloud Storage",
            small_config(tmp_path, cache_dir, stories_file, output_dir="gs://bucket/run"))
    _expect("checkpoint", "is on Google Cloud Storage",
            small_config(tmp_path, cache_dir, stories_file, model="gemma3-270m",
                         checkpoint="GEMMA3_270M_PT"))


def test_tokenizer_larger_than_the_embedding(tmp_path, cache_dir, stories_file, monkeypatch,
                                             nothing_expensive):
    real = presets.model_config
    monkeypatch.setattr(presets, "model_config",
                        lambda name, vocab, num_layers=None: real(name, 256, num_layers))
    _expect("tokenizer", "vocabulary (600) is larger than gemma3-tiny's embedding (256)",
            small_config(tmp_path, cache_dir, stories_file))


def test_datacount_zero_is_rejected_by_the_config(tmp_path, cache_dir, stories_file):
    with pytest.raises(ConfigError, match="^datacount: 0 stories requested"):
        small_config(tmp_path, cache_dir, stories_file, datacount=0)


def test_max_steps_is_the_number_of_steps_even_past_an_epoch(tmp_path, cache_dir, stories_file):
    """As in the Hugging Face Trainer: max_steps replaces num_epochs, the data repeating."""
    config = small_config(tmp_path, cache_dir, stories_file, datacount=60, max_steps=40)
    experiment = Experiment.prepare(config)
    assert experiment.steps_per_epoch < 40 == experiment.total_steps
    for _ in range(experiment.steps_per_epoch + 2):  # the stream goes on into the next epoch
        assert experiment.next_batch()["tokens"].shape == (8, 64)
    without = Experiment.prepare(config.replace(max_steps=None, num_epochs=2,
                                                     output_dir=str(tmp_path / "epochs")))
    assert without.total_steps == 2 * without.steps_per_epoch
