"""LoRA: which layers are adapted, the merge, and a LoRA run (frozen base, adapters-only state,
exact resume, sampling from the merged tree equal to the LoRA model)."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import PROMPT
from test_resume import _losses, crashed_run

from gemmalab import checkpoints, lora, models, sampling
from gemmalab.config import TrainConfig
from gemmalab.errors import ConfigError
from gemmalab.experiment import Experiment

RANK = 4


@pytest.fixture(scope="module")
def tiny():
    config = models.model_config("gemma3-tiny", 600)
    base_model = models.build_model(config, param_dtype=jnp.float32)
    base = models.init_params(base_model, seed=0, sample_length=8)
    return config, base_model, base


def _noisy(adapters, seed):
    """Adapters with ``b`` non-zero, as after training (fresh ones leave the model unchanged)."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                                     for k, x in zip(keys, leaves, strict=True)])


@pytest.mark.parametrize(("modules", "adapted"), [
    ("attention", {"q_einsum", "kv_einsum", "attn_vec_einsum"}),
    ("mlp", {"gating_einsum", "linear"}),
    ("all", {"q_einsum", "kv_einsum", "attn_vec_einsum", "gating_einsum", "linear"}),
])
def test_lora_modules_choose_the_adapted_projections_and_the_merge_is_exact(tiny, modules,
                                                                           adapted):
    config, base_model, base = tiny
    adapters = lora.init_adapters(config, rank=RANK, modules=modules, dtype="float32", seed=1)
    found = collections.Counter(module for _, module, *_ in lora.adapted_weights(adapters))
    assert found == dict.fromkeys(adapted, config.num_layers)
    assert all(leaf.shape[0] == RANK or leaf.shape[-1] == RANK
               for leaf in jax.tree.leaves(adapters))

    model = lora.wrap(base_model, rank=RANK, alpha=8.0, modules=modules, dtype=jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 600, (2, 12)), jnp.int32)
    base_logits = base_model.apply({"params": base}, tokens).logits
    fresh = model.apply({"params": lora.join(base, adapters)}, tokens).logits
    np.testing.assert_allclose(fresh, base_logits, atol=1e-5)  # b = 0: the base model

    trained = _noisy(adapters, seed=2)
    lora_logits = model.apply({"params": lora.join(base, trained)}, tokens).logits
    merged = lora.merge(base, trained, lora.scale(RANK, 8.0))
    merged_logits = base_model.apply({"params": merged}, tokens).logits
    assert float(jnp.abs(lora_logits - base_logits).max()) > 0.1  # the adapters do act
    # float32 both ways; the two orders of summation differ by rounding only
    np.testing.assert_allclose(merged_logits, lora_logits, atol=1e-4, rtol=1e-4)
    assert jax.tree.structure(merged) == jax.tree.structure(base)


def test_lora_alpha_scales_the_update_as_peft_does(tiny):
    config, base_model, base = tiny
    trained = _noisy(lora.init_adapters(config, rank=RANK, modules="all", dtype="float32",
                                        seed=1), seed=3)
    tokens = jnp.arange(3, 13, dtype=jnp.int32)[None]

    def delta(alpha):
        model = lora.wrap(base_model, rank=RANK, alpha=alpha, modules="all", dtype=jnp.float32)
        first = model.apply({"params": lora.join(base, trained)}, tokens,
                            return_hidden_states=True).hidden_states
        return first

    # scale = alpha / rank: alpha=rank is gemma's unscaled LoRA, and each alpha traces anew
    assert lora.scale(RANK, None) == 1.0 and lora.scale(RANK, 16.0) == 4.0
    plain = models.build_model(config, param_dtype=jnp.float32)
    for alpha in (4.0, 16.0):
        merged = lora.merge(base, trained, lora.scale(RANK, alpha))
        expected = plain.apply({"params": merged}, tokens, return_hidden_states=True)
        np.testing.assert_allclose(delta(alpha), expected.hidden_states, atol=1e-4, rtol=1e-4)


def test_lora_parameters_are_checked_in_the_config():
    for name, value in (("lora_rank", -1), ("lora_alpha", 0.0), ("lora_modules", "embedder")):
        with pytest.raises(ConfigError, match=name):
            TrainConfig(**{name: value})


def _config(tmp_path, cache_dir, stories_file, name, **overrides):
    values = dict(data_path=str(stories_file), cache_dir=str(cache_dir),
                  output_dir=str(tmp_path / name), batch_size=8, maxlen=64, max_steps=10,
                  eval_every=5, checkpoint_every=4, tokenizer_vocab_size=600,
                  tokenize_workers=1, seed=5, compute_dtype="float32", lora_rank=RANK,
                  lora_alpha=8.0, learning_rate=1e-2)
    return TrainConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, cache_dir, stories_file):
    tmp_path = tmp_path_factory.mktemp("lora")
    experiment = Experiment.prepare(_config(tmp_path, cache_dir, stories_file, "whole"))
    frozen_before = jax.tree.map(np.asarray, experiment.frozen_params)
    summary = experiment.train(progress=False)
    experiment.save()
    return tmp_path, experiment, summary, frozen_before


def test_a_lora_run_trains_only_the_adapters(lora_run):
    _, experiment, summary, frozen_before = lora_run
    # The state holds the adapters and their AdamW moments, nothing of the base model.
    assert all("lora" in jax.tree_util.keystr(path)
               for path, leaf in jax.tree_util.tree_leaves_with_path(experiment.state)
               if leaf.ndim)  # (the scalars: step and optimizer counters)
    assert summary["trainable_params"] == sum(x.size for x in
                                              jax.tree.leaves(experiment.state.params))
    assert summary["trainable_params"] < summary["num_params"] / 20
    # The base never changes (and is the one the run started from).
    for before, after in zip(jax.tree.leaves(frozen_before),
                             jax.tree.leaves(experiment.frozen_params), strict=True):
        np.testing.assert_array_equal(before, np.asarray(after))
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.2


def test_the_base_weights_are_held_in_the_compute_dtype(tmp_path, cache_dir, stories_file):
    config = _config(tmp_path, cache_dir, stories_file, "bf16", compute_dtype="bfloat16",
                     max_steps=1)
    experiment = Experiment.prepare(config)
    assert {x.dtype for x in jax.tree.leaves(experiment.frozen_params)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(experiment.state.params)} == {jnp.dtype(jnp.float32)}


def test_a_lora_run_saves_merged_params_and_adapters_and_samples_alike(lora_run):
    _, experiment, _, _ = lora_run
    output = experiment.config.output_dir
    merged = checkpoints.load_params(f"{output}/params")
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(experiment.inference_params()),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    adapters = checkpoints.load_params(f"{output}/adapters")
    assert jax.tree.structure(adapters) == jax.tree.structure(experiment.state.params)

    # Greedy sampling: the LoRA model (base + adapters) and the merged plain tree agree.
    from_lora = sampling.continue_prompts(
        experiment.model, lora.join(experiment.frozen_params, experiment.state.params),
        experiment.tokenizer, [PROMPT], compute_dtype=jnp.float32, max_new_tokens=12)
    from_merged = experiment.sample(PROMPT, max_new_tokens=12)
    assert from_lora[0].text == from_merged.text and from_merged.text


def test_a_crashed_lora_run_resumes_exactly(lora_run, cache_dir, stories_file):
    """The base is rebuilt from its source, the adapters and moments restored: the same
    losses and adapters as the uninterrupted run, bit for bit."""
    tmp_path, whole, _, _ = lora_run
    config = _config(tmp_path, cache_dir, stories_file, "crashed")
    crashed_run(config, 7)
    second = Experiment.prepare(config)
    assert second.start_step == 4
    second.train(progress=False)
    steps, losses = _losses(tmp_path / "crashed")
    whole_steps, whole_losses = _losses(tmp_path / "whole")
    assert steps == whole_steps == list(range(1, 11))
    np.testing.assert_array_equal(losses, whole_losses)
    for a, b in zip(jax.tree.leaves(second.state), jax.tree.leaves(whole.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A resume with another rank is refused up front, naming the field.
    with pytest.raises(ConfigError, match="lora_rank"):
        Experiment.prepare(dataclasses.replace(config, lora_rank=8))
