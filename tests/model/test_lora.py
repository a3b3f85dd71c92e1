"""LoRA: which layers are adapted, the merge, and a LoRA run (frozen base, adapters-only state,
exact resume, sampling from the merged tree equal to the LoRA model)."""

import collections
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmalab.config import TrainConfig
from gemmalab.errors import ConfigError
from gemmalab.model import lora, mesh, presets, sampling
from gemmalab.train.experiment import Experiment
from gemmalab.weights import orbax_params
from tests.helpers import PROMPT
from tests.helpers.models import jaxpr_equations, short_tiny
from tests.helpers.numerics import REORDERED_FLOAT32, assert_close_to_scale
from tests.helpers.runs import _losses, crashed_run

RANK = 4


@pytest.fixture(scope="module")
def tiny():
    config = short_tiny(600)
    base_model = presets.build_model(config, param_dtype=jnp.float32)
    base = presets.init_params(base_model, seed=0, sample_length=8)
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
@pytest.mark.slow
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
    assert_close_to_scale(merged_logits, lora_logits, REORDERED_FLOAT32)
    assert jax.tree.structure(merged) == jax.tree.structure(base)


@pytest.mark.slow
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
    plain = presets.build_model(config, param_dtype=jnp.float32)
    for alpha in (4.0, 16.0):
        merged = lora.merge(base, trained, lora.scale(RANK, alpha))
        expected = plain.apply({"params": merged}, tokens, return_hidden_states=True)
        # Merged or split: float32 summed in another order.
        assert_close_to_scale(delta(alpha), expected.hidden_states, REORDERED_FLOAT32)


def test_every_frozen_projection_is_read_where_its_input_is(tiny):
    """A LoRA model ties each frozen base projection, adapted or not, to the activation it
    multiplies (``quantization.tied``: under fsdp XLA would otherwise gather them all early),
    and on a mesh that splits them also reads them through a data dependency on it; the values
    are unchanged, and a model that trains its weights is left alone."""
    config, base_model, base = tiny
    adapters = _noisy(lora.init_adapters(config, rank=RANK, modules="attention",
                                         dtype="float32", seed=1), seed=2)
    model = lora.wrap(base_model, rank=RANK, alpha=8.0, modules="attention", dtype=jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 600, (2, 12)), jnp.int32)
    params = lora.join(base, adapters)

    def logits(module, weights):
        return module.apply({"params": weights}, tokens).logits

    def equations(module, weights):
        return list(jaxpr_equations(jax.make_jaxpr(logits, static_argnums=0)(module,
                                                                             weights).jaxpr))

    def barriers(module, weights):
        return sum(e.primitive.name == "optimization_barrier" for e in equations(module, weights))

    def scalar_adds(module, weights):  # a scalar added to an array of two or more dimensions
        ranks = (sorted(np.ndim(v.aval) for v in e.invars) for e in equations(module, weights)
                 if e.primitive.name == "add")
        return sum(len(r) == 2 and r[0] == 0 and r[1] >= 2 for r in ranks)

    # Per block: q, kv, attention output, gate|up and down projections.
    assert barriers(model, params) == 5 * config.num_layers
    assert barriers(base_model, base) == 0
    merged = lora.merge(base, adapters, lora.scale(RANK, 8.0))
    assert_close_to_scale(logits(model, params), logits(base_model, merged), REORDERED_FLOAT32)

    # On a mesh that splits them (fsdp), each is also read through a data dependency on its
    # input (plus zero times one of its elements: libtpu drops barriers), with the same values.
    split = lora.wrap(base_model, rank=RANK, alpha=8.0, modules="attention", dtype=jnp.float32,
                      mesh=mesh.make_mesh({"fsdp": 2}, jax.devices()[:2]))
    assert scalar_adds(split, params) - scalar_adds(model, params) == 5 * config.num_layers
    np.testing.assert_array_equal(logits(split, params), logits(model, params))


def test_lora_parameters_are_checked_in_the_config():
    for name, value in (("lora_rank", -1), ("lora_alpha", 0.0), ("lora_modules", "embedder")):
        with pytest.raises(ConfigError, match=name):
            TrainConfig.flat(**{name: value})


def _config(tmp_path, cache_dir, stories_file, name, **overrides):
    values = dict(model="gemma3-tiny", data_path=str(stories_file), cache_dir=str(cache_dir),
                  output_dir=str(tmp_path / name), batch_size=8, maxlen=64, max_steps=10,
                  eval_every=5, checkpoint_every=4, tokenizer_vocab_size=600,
                  tokenize_workers=1, seed=5, compute_dtype="float32", lora_rank=RANK,
                  lora_alpha=8.0, learning_rate=1e-2, num_layers=2)
    return TrainConfig.flat(**{**values, **overrides})


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, cache_dir, stories_file):
    tmp_path = tmp_path_factory.mktemp("lora")
    experiment = Experiment.prepare(_config(tmp_path, cache_dir, stories_file, "whole"))
    frozen_before = jax.tree.map(np.asarray, experiment.weights.frozen)
    summary = experiment.train(progress=False)
    experiment.save()
    return tmp_path, experiment, summary, frozen_before


@pytest.mark.slow
def test_a_lora_run_trains_only_the_adapters(lora_run):
    _, experiment, summary, frozen_before = lora_run
    # The state holds the adapters and their AdamW moments, nothing of the base model.
    assert all("lora" in jax.tree_util.keystr(path)
               for path, leaf in jax.tree_util.tree_leaves_with_path(experiment.weights.state)
               if leaf.ndim)  # (the scalars: step and optimizer counters)
    assert summary["trainable_params"] == sum(x.size for x in
                                              jax.tree.leaves(experiment.weights.state.params))
    assert summary["trainable_params"] < summary["num_params"] / 20
    # The base never changes (and is the one the run started from).
    for before, after in zip(jax.tree.leaves(frozen_before),
                             jax.tree.leaves(experiment.weights.frozen), strict=True):
        np.testing.assert_array_equal(before, np.asarray(after))
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.2


@pytest.mark.slow
def test_the_base_weights_are_held_in_the_compute_dtype(tmp_path, cache_dir, stories_file):
    config = _config(tmp_path, cache_dir, stories_file, "bf16", compute_dtype="bfloat16",
                     max_steps=1)
    experiment = Experiment.prepare(config)
    weights = experiment.weights
    assert {x.dtype for x in jax.tree.leaves(weights.frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(weights.state.params)} == {jnp.dtype(jnp.float32)}


@pytest.mark.slow
def test_a_lora_run_saves_merged_params_and_adapters_and_samples_alike(lora_run):
    _, experiment, _, _ = lora_run
    output = experiment.config.runtime.output_dir
    merged = orbax_params.load_params(f"{output}/params")
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(experiment.inference_params()),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    adapters = orbax_params.load_params(f"{output}/adapters")
    assert jax.tree.structure(adapters) == jax.tree.structure(experiment.weights.state.params)

    # Greedy sampling: the LoRA model (base + adapters) and the merged plain tree agree.
    from_lora = sampling.continue_prompts(
        experiment.model, lora.join(experiment.weights.frozen, experiment.weights.state.params),
        experiment.tokenizer, [PROMPT], compute_dtype=jnp.float32, max_new_tokens=12)
    from_merged = experiment.sample(PROMPT, max_new_tokens=12)
    assert from_lora[0].text == from_merged.text and from_merged.text


@pytest.mark.slow
def test_a_crashed_lora_run_resumes_exactly(lora_run, cache_dir, stories_file):
    """The base is rebuilt from its source, the adapters and moments restored: the same
    losses and adapters as the uninterrupted run, bit for bit."""
    tmp_path, whole, _, _ = lora_run
    config = _config(tmp_path, cache_dir, stories_file, "crashed")
    crashed_run(config, 7)
    second = Experiment.prepare(config)
    assert second.weights.start_step == 4
    second.train(progress=False)
    steps, losses = _losses(tmp_path / "crashed")
    whole_steps, whole_losses = _losses(tmp_path / "whole")
    assert steps == whole_steps == list(range(1, 11))
    np.testing.assert_array_equal(losses, whole_losses)
    for a, b in zip(jax.tree.leaves(second.weights.state), jax.tree.leaves(whole.weights.state),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A resume with another rank is refused up front, naming the field.
    with pytest.raises(ConfigError, match="lora_rank"):
        Experiment.prepare(config.replace(lora_rank=8))


@pytest.mark.slow
def test_a_resume_whose_base_file_changed_is_refused(lora_run, cache_dir, stories_file):
    """The base is read again on a resume, not checkpointed: new weights at the ``checkpoint``
    path (an SFT run re-run into the same directory) would change it mid-run. The run records
    its held weights' digest and a resume on other ones is refused, naming ``checkpoint``."""
    tmp_path, whole, _, _ = lora_run
    base = str(tmp_path / "base-run" / "params")  # a run's params, its tokenizer beside them
    original = orbax_params.load_params(f"{whole.config.runtime.output_dir}/params")
    orbax_params.save_params(original, base)
    for name in ("tokenizer.model", "summary.json"):
        shutil.copy(f"{whole.config.runtime.output_dir}/{name}", tmp_path / "base-run")
    config = _config(tmp_path, cache_dir, stories_file, "on-a-file", checkpoint=base,
                     max_steps=1, checkpoint_every=1, eval_every=0)
    Experiment.prepare(config).train(progress=False)
    shutil.rmtree(base)
    orbax_params.save_params(_noisy(original, seed=3), base)
    with pytest.raises(ConfigError, match="checkpoint.*other weights than when the run"):
        Experiment.prepare(config.replace(max_steps=2))
    shutil.rmtree(base)
    orbax_params.save_params(original, base)
    assert Experiment.prepare(config.replace(max_steps=2)).weights.start_step == 1


@pytest.mark.slow
def test_trained_token_rows_change_only_their_rows_learn_and_merge_exactly(tiny, tmp_path):
    """lora_train_tokens: the rows' update joins the (tied) embedding, gets gradients, and the
    merged tree and the PEFT export carry the trained rows."""
    import json

    from gemmalab.train import optimization
    from gemmalab.weights import peft_adapters, safetensors_io

    config, base_model, base = tiny
    ids = (10, 11)  # the local tokenizer's turn tokens
    adapters = lora.init_adapters(config, rank=RANK, modules="all", dtype="float32", seed=1,
                                  token_rows=len(ids))
    assert adapters[lora.TOKEN_ROWS].shape == (2, config.embed_dim)
    assert jax.tree.structure(adapters) == jax.tree.structure(lora.abstract_adapters(
        config, rank=RANK, modules="all", dtype="float32", token_rows=2))
    model = lora.wrap(base_model, rank=RANK, alpha=None, modules="all", dtype=jnp.float32,
                      token_ids=ids)
    assert lora.token_ids(model) == ids

    # The loss on a row ending in an id of ``ids`` sends gradient into exactly those rows.
    tokens = np.asarray([[2, 40, 41, 42, 10, 43, 11, 0]], np.int32)
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
             "loss_mask": np.asarray([[1, 1, 1, 1, 1, 1, 0, 0]], np.int32),
             "positions": np.arange(8, dtype=np.int32)[None],
             "segment_ids": np.asarray([[1, 1, 1, 1, 1, 1, 1, 0]], np.int32)}
    grads = jax.grad(lambda a: optimization.forward_loss(model, a, batch, jnp.float32, base)[0])(
        adapters)
    assert float(jnp.abs(grads[lora.TOKEN_ROWS]).min(axis=1).max()) > 0  # both rows learn

    trained = {**adapters, lora.TOKEN_ROWS: adapters[lora.TOKEN_ROWS] + 0.5}
    # The loss adds the rows' logits apart (no [V, D] gradient): the merged model's loss.
    split_loss = optimization.forward_loss(model, trained, batch, jnp.float32, base)[0]
    merged_tree = lora.merge(base, trained, 1.0, token_ids=ids)
    merged_loss = optimization.forward_loss(base_model, merged_tree, batch, jnp.float32)[0]
    assert_close_to_scale(float(split_loss), float(merged_loss), REORDERED_FLOAT32)
    joined = lora.join(base, trained, ids)["embedder"]["input_embedding"]
    original = base["embedder"]["input_embedding"]
    changed = np.flatnonzero(np.abs(np.asarray(joined - original)).max(axis=1) > 0)
    assert changed.tolist() == list(ids)
    merged = lora.merge(base, trained, 1.0, token_ids=ids)["embedder"]["input_embedding"]
    np.testing.assert_allclose(np.asarray(merged), np.asarray(joined), atol=1e-6)
    with pytest.raises(ValueError, match="2 trained embedding rows for 1 token ids"):
        lora.join(base, trained, ids[:1])

    # PEFT's trainable tokens: the rows' trained values, their ids in the config.
    files = peft_adapters.export_peft(trained, config, tmp_path / "peft", rank=RANK, alpha=RANK,
                                      base_model_name_or_path="", token_ids=ids,
                                      token_rows=np.asarray(merged)[list(ids)])
    written = safetensors_io.read_file(tmp_path / "peft" / files[1])
    np.testing.assert_array_equal(written[peft_adapters.PEFT_TOKEN_ROWS],
                                  np.asarray(merged)[[10, 11]])
    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter_config["trainable_token_indices"] == {"embed_tokens": [10, 11]}
    with pytest.raises(ConfigError, match="^token_ids: the adapters hold trained embedding rows"):
        peft_adapters.export_peft(trained, config, tmp_path / "peft2", rank=RANK, alpha=RANK,
                                  base_model_name_or_path="")


def test_lora_train_tokens_resolve_to_ids_and_unknown_pieces_are_refused(cache_dir):
    from gemmalab.data.tokenizer import load_tokenizer
    from gemmalab.train.experiment import trained_token_ids

    config = TrainConfig.flat(lora_rank=4, lora_train_tokens=["<end_of_turn>", "<start_of_turn>"],
                         cache_dir=str(cache_dir))
    _, info = load_tokenizer("gemma3", cache_dir=cache_dir, training_stories=None, vocab_size=0,
                             corpus_fingerprint="")
    assert trained_token_ids(config.lora, info, chat=False, pretrained=False) == (105, 106)
    # None: the turn tokens for chat data on a pretrained checkpoint, else none.
    chat_run = TrainConfig.flat(checkpoint="embedded:gemma3-270m", lora_rank=4).lora
    assert trained_token_ids(chat_run, info, chat=True, pretrained=True) == (105, 106)
    assert trained_token_ids(chat_run, info, chat=False, pretrained=True) == ()
    assert trained_token_ids(chat_run, info, chat=True, pretrained=False) == ()
    assert trained_token_ids(TrainConfig.flat().lora, info, chat=True, pretrained=True) == ()
    with pytest.raises(ConfigError, match=r"^lora_train_tokens: \['<end of turn>'\] are not"):
        trained_token_ids(config.replace(lora_train_tokens=["<end of turn>"]).lora, info,
                          chat=False, pretrained=False)
