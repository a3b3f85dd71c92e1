from pathlib import Path

import pytest

from gemmalab import recipes
from gemmalab.config import (
    FLAT_NAMES,
    CheckpointConfig,
    DataConfig,
    DPOConfig,
    LoRAConfig,
    TrainConfig,
    TrainerConfig,
    refuse_unknown_parameters,
)
from gemmalab.errors import ConfigError
from gemmalab.weights import resolution


def test_defaults_are_valid_and_round_trip():
    config = TrainConfig()
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert config.data.maxlen == 256 and config.data.packing


def test_the_config_is_a_value_of_groups_with_one_flat_mapping():
    config = TrainConfig.flat(lora_rank=8, lora_alpha=16.0, dpo_beta=0.2, objective="dpo",
                              checkpoint_every=5, data_path="embedded:preferences")
    assert (config.lora.rank, config.lora.alpha, config.dpo.beta, config.checkpoints.every,
            config.data.path) == (8, 16.0, 0.2, 5, "embedded:preferences")
    assert config.to_dict()["lora_alpha"] == 16.0 and set(config.to_dict()) == set(FLAT_NAMES)
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert config.replace(maxlen=64).data.maxlen == 64 and config.data.maxlen == 256
    # Built from groups, the same value.
    assert TrainConfig(lora=LoRAConfig(rank=8, alpha=16.0), dpo=DPOConfig(beta=0.2),
                       trainer=TrainerConfig(objective="dpo"),
                       checkpoints=CheckpointConfig(every=5),
                       data=DataConfig(path="embedded:preferences")) == config


def test_the_constructor_reads_no_file_and_decides_nothing(tmp_path, monkeypatch):
    """The same literal config is the same value anywhere: what it leaves open stays open
    (gemmalab.weights.resolution decides it), whatever lies on disk."""
    (tmp_path / "summary.json").write_text('{"params": {"model": "gemma3-1b"}}')
    (tmp_path / "params").mkdir()
    monkeypatch.setattr("builtins.open", None)  # any file read would fail
    config = TrainConfig.flat(checkpoint=str(tmp_path / "params"))
    assert (config.model.preset, config.model.tokenizer, config.model.num_layers,
            config.trainer.batch_size, config.data.path) == (None, None, None, None, "")
    assert not config.is_resolved


@pytest.mark.parametrize(("values", "message"), [
    ({"lora_alpha": 16.0}, "lora_alpha: is set but LoRA is off (lora_rank=0). Fix: set "
                           "lora_rank > 0 to train adapters, or leave lora_alpha unset"),
    ({"lora_modules": "mlp"}, "lora_modules: is set but LoRA is off"),
    ({"lora_train_tokens": []}, "lora_train_tokens: is set but LoRA is off"),
    ({"dpo_beta": 0.5}, "dpo_beta: is set but the objective is not DPO (objective='sft'). "
                        "Fix: set objective='dpo', or leave dpo_beta unset"),
    ({"dpo_rpo_alpha": 1.0}, "dpo_rpo_alpha: is set but the objective is not DPO"),
])
def test_a_features_fields_set_while_it_is_off_are_refused(values, message):
    with pytest.raises(ConfigError) as raised:
        TrainConfig.flat(**values)
    assert str(raised.value).startswith(message)
    TrainConfig.flat(lora_rank=4, objective="dpo", **values)  # on: accepted


def test_a_recipe_is_the_base_of_a_notebooks_parameters():
    demo = TrainConfig.from_parameters({"recipe": "demo"})
    assert demo == TrainConfig.flat(**recipes.RECIPES["demo"])
    assert (demo.model.checkpoint, demo.lora.rank, demo.trainer.max_steps) == (
        "embedded:gemma3-270m", 8, 16)
    # A field given beside the recipe wins over it.
    assert TrainConfig.from_parameters({"recipe": "demo", "lora_rank": 16}).lora.rank == 16
    # The toy only by name.
    assert TrainConfig.from_parameters({"recipe": "tiny"}) == TrainConfig.flat(model="gemma3-tiny")


def test_parameters_that_name_no_recipe_model_or_checkpoint_fine_tune_a_real_gemma():
    """papermill train.ipynb out.ipynb -p batch_size 64: the demo recipe (LoRA on the embedded
    pretrained 270M) under what is given; a named model or checkpoint keeps the rest of
    TrainConfig's defaults, as before (a model without weights: random init)."""
    demo = TrainConfig.flat(**recipes.RECIPES["demo"])
    assert TrainConfig.from_parameters({"recipe": ""}) == demo
    assert TrainConfig.from_parameters({}) == demo
    sized = TrainConfig.from_parameters({"recipe": "", "batch_size": 64, "data_path": "a.txt"})
    assert sized == demo.replace(batch_size=64, data_path="a.txt")
    assert recipes.chosen({"batch_size": 64}) == (
        "demo", "the default (no recipe, model or checkpoint given)")
    named = TrainConfig.from_parameters({"recipe": "", "model": "gemma3-1b"})
    assert named == TrainConfig.flat(model="gemma3-1b")
    assert recipes.chosen({"model": "gemma3-1b", "recipe": ""}) == ("", "model given")
    decided = resolution.resolve(named)
    assert decided.config.model.checkpoint == "" and decided.to_dict()["checkpoint"] == {
        "value": "", "from": "random init of the named model"}
    own = TrainConfig.from_parameters({"checkpoint": "GEMMA3_1B_PT"})
    assert own == TrainConfig.flat(checkpoint="GEMMA3_1B_PT") and own.lora.rank == 0
    # An override (a Kubernetes job's) counts as given.
    assert TrainConfig.from_parameters({}, model="gemma3-tiny") == TrainConfig.flat(
        model="gemma3-tiny")
    with pytest.raises(ConfigError, match="^recipe: unknown recipe 'demo2'. Fix: use one of "
                       "demo, tiny, gemma4-tiny, gemma4-tiny-moe, tutorial"):
        TrainConfig.from_parameters({"recipe": "demo2"})


def test_every_recipe_is_a_valid_config():
    for name in recipes.RECIPES:
        config = TrainConfig.from_parameters({"recipe": name})
        assert set(recipes.RECIPES[name].items()) <= set(config.to_dict().items()), name


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "gemma4-huge"),
        ("maxlen", 7),
        ("batch_size", 0),
        ("datacount", 0),
        ("datacount", -5),
        ("eval_fraction", 0.0),
        ("eval_fraction", 1.0),
        ("num_epochs", 0),
        ("max_steps", 0),
        ("learning_rate", -1e-3),
        ("warmup_ratio", 1.0),
        ("max_grad_norm", 0.0),
        ("param_dtype", "float16"),
        ("compute_dtype", "int8"),
        ("eval_every", -1),
        ("tokenizer_vocab_size", 100),
        ("output_dir", ""),
        ("tokenizer", ""),
        ("num_layers", 0),
    ],
)
def test_bad_values_name_the_parameter(field, value):
    with pytest.raises(ConfigError) as error:
        TrainConfig.flat(**{field: value})
    message = str(error.value)
    assert message.startswith(f"{field}: ")
    assert "Fix: " in message
    assert "\n" not in message
    assert error.value.parameter == field


def test_unknown_parameter_is_rejected():
    with pytest.raises(ConfigError, match="^batchsize: is not a training parameter"):
        TrainConfig.from_dict({"batchsize": 3})


def test_jupyter_renders_one_line():
    error = ConfigError("maxlen", "3 is too short", "use 256")
    assert error._render_traceback_() == ["ConfigError: maxlen: 3 is too short. Fix: use 256"]


def test_from_parameters_takes_every_field_among_a_notebooks_variables():
    """papermill injects any -p NAME VALUE: every field works, listed in the cell or not."""
    namespace = {"model": "gemma3-tiny", "compute_dtype": "float32", "warmup_ratio": 0.2,
                 "prompt": "not a field", "In": [], "profile_dir": "x"}
    config = TrainConfig.from_parameters(namespace, output_dir="runs/p")
    assert (
        config.model.compute_dtype,
        config.optimizer.warmup_ratio,
        config.runtime.output_dir,
    ) == ("float32", 0.2, "runs/p")
    assert config.data.maxlen == TrainConfig().data.maxlen  # not given: the dataclass default
    with pytest.raises(ConfigError, match="^compute_dtype: unknown dtype"):
        TrainConfig.from_parameters({"compute_dtype": "fp8"})


def test_a_misspelt_papermill_parameter_is_refused_naming_the_field_it_meant():
    """papermill's injected cell (in IPython's input history) may set only fields and names of
    the notebook's own cells; anything else is a mistake, not a variable to ignore."""
    own = '# Parameters (papermill -p overrides these)\nprompt = "x"\nlora_rank = 8\n'
    setup = "from gemmalab.config import TrainConfig\nhistory: list = []\n"

    def namespace(injected):
        cells = ["", own, f"# Parameters\n{injected}\n", setup]
        return {"In": cells, "lora_rank": 4, "prompt": "y", "max_step": 3, "modle": "x"}

    config = TrainConfig.from_parameters(namespace('lora_rank = 4\nprompt = "y"\nhistory = 1'))
    assert config.lora.rank == 4  # fields, the notebook's own names and its later cells' pass
    with pytest.raises(ConfigError, match=r"^max_step: was passed to papermill but is neither "
                       r"a training parameter nor one of this notebook's\. Fix: did you mean "
                       r"max_steps\?$"):
        TrainConfig.from_parameters(namespace("lora_rank = 4\nmax_step = 3"))
    with pytest.raises(ConfigError, match=r"^zzz: .* Fix: use a gemmalab.config.TrainConfig"):
        TrainConfig.from_parameters(namespace("zzz = 3"))
    # Outside papermill (no injected cell, or no IPython history): nothing to check.
    demo = TrainConfig.flat(**recipes.RECIPES["demo"])
    assert TrainConfig.from_parameters({"In": ["", own], "max_step": 3}) == demo
    assert TrainConfig.from_parameters({"max_step": 3}) == demo


def test_a_notebook_without_a_config_refuses_names_that_are_not_its_own():
    """refuse_unknown_parameters alone (sample_compare, export, launch): papermill's names must
    be the notebook's own; training fields are not, there."""
    own = 'run = "runs/train"\nformats = ["hf"]\n'
    history = ["", own, '# Parameters\nrun = "x"\nformat = ["gemma"]\n']
    with pytest.raises(ConfigError, match=r"^format: was passed to papermill but is not one of "
                       r"this notebook's parameters\. Fix: did you mean formats\?$"):
        refuse_unknown_parameters({"In": history})
    with pytest.raises(ConfigError, match=r"^lora_rank: .* Fix: use a name of its parameters "
                       r"cell \(`papermill NOTEBOOK --help-notebook` lists them\)$"):
        refuse_unknown_parameters({"In": ["", own, "# Parameters\nlora_rank = 8\n"]})
    refuse_unknown_parameters({"In": history[:2]})  # papermill gave nothing
    refuse_unknown_parameters({"In": ["", own, '# Parameters\nrun = "x"\n']})  # its own names
    refuse_unknown_parameters({})  # not in IPython


def test_compiled_programs_go_under_the_cache_unless_a_folder_is_named(tmp_path):
    config = TrainConfig.flat(cache_dir=str(tmp_path / "c"))
    assert config.runtime.resolved_compile_cache_dir == tmp_path / "c" / "jax-compile"
    named = TrainConfig.flat(cache_dir=str(tmp_path / "c"), compile_cache_dir="/outputs/.jax")
    assert named.runtime.resolved_compile_cache_dir == Path("/outputs/.jax")
    with pytest.raises(ConfigError, match="^compile_cache_dir: .* GCS FUSE mount"):
        TrainConfig.flat(compile_cache_dir="gs://bucket/jax")


@pytest.mark.parametrize("output_dir", ["runs/[exp1]", "runs/lr-*", "runs/a?b"])
def test_an_output_dir_with_glob_wildcards_is_refused(output_dir):
    # Orbax globs under the path for a checkpoint's parts: such a run saved unreadable params.
    with pytest.raises(ConfigError, match="^output_dir: .* cannot be read back"):
        TrainConfig.flat(output_dir=output_dir)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"resume": "false"},
            "resume: 'false' is not True or False. Fix: use True or False "
            "(papermill reads -p resume False as one; other words as text)",
        ),
        ({"packing": 0}, "packing: 0 is not True or False. Fix: use True or False"),
        ({"max_steps": 2.0}, "max_steps: 2.0 is not a whole number. Fix: use 2"),
        ({"batch_size": 8.5}, "batch_size: 8.5 is not a whole number. Fix: use a whole number"),
        (
            {"maxlen": "64"},
            "maxlen: '64' is not a whole number. Fix: use the number 64, not text "
            "(papermill: -p, not -r)",
        ),
        ({"seed": None}, "seed: cannot be None. Fix: use a whole number, e.g. its default 0"),
        ({"data_path": None}, "data_path: cannot be None. Fix: use a string, e.g. its default ''"),
        (
            {"learning_rate": float("inf")},
            "learning_rate: inf is not a finite number. Fix: use a finite number",
        ),
        (
            {"weight_decay": float("nan")},
            "weight_decay: nan is not a finite number. Fix: use a finite number",
        ),
        (
            {"lora_rank": 8, "lora_train_tokens": "<end_of_turn>"},
            "lora_train_tokens: '<end_of_turn>' is not a "
            "list. Fix: give a list (papermill: -y 'lora_train_tokens: [...]')",
        ),
        ({"adam_b1": 1.0}, "adam_b1: 1.0 is outside [0, 1). Fix: use e.g. 0.9"),
        ({"adam_b2": 1.5}, "adam_b2: 1.5 is outside [0, 1). Fix: use e.g. 0.95"),
        ({"weight_decay": -5}, "weight_decay: -5 is negative. Fix: use 0 (none) or e.g. 0.01"),
        (
            {"expert_capacity_factor": 0.5},
            "expert_capacity_factor: 0.5 is below a balanced router's share, so tokens would be "
            "dropped even then. Fix: use 0 (dropless) or at least 1 (e.g. 1.5)",
        ),
    ],
)
def test_a_value_of_the_wrong_type_or_range_is_refused_by_name(values, message):
    """papermill passes `-p resume false` as text (truthy) and `-p max_steps 2.0` as a float:
    each field's annotation is checked before anything compares or computes with it."""
    with pytest.raises(ConfigError) as raised:
        TrainConfig.flat(model="gemma3-tiny", **values)
    assert str(raised.value) == message


def test_values_of_the_right_kind_pass_as_json_and_numpy_give_them():
    import numpy as np

    config = TrainConfig.flat(model="gemma3-tiny", learning_rate=1, max_steps=np.int64(3),
                              lora_rank=8, lora_train_tokens=("<end_of_turn>",),
                              mesh={"data": -1}, datacount=None)
    assert (config.optimizer.learning_rate, config.trainer.max_steps, config.lora.train_tokens,
            config.to_dict()["lora_train_tokens"]) == (1, 3, ("<end_of_turn>",), ["<end_of_turn>"])


def test_a_datacount_that_holds_nothing_out_is_refused_at_once():
    with pytest.raises(ConfigError, match=r"^datacount: 30 stories hold none out for evaluation "
                       r"\(one in 50 is, eval_fraction=0\.02\)\. Fix: use datacount >= 50, or "
                       r"eval_fraction >= 0\.0333$"):
        TrainConfig.flat(model="gemma3-tiny", datacount=30)
    assert TrainConfig.flat(model="gemma3-tiny", datacount=50).data.datacount == 50
