"""Gemma 4 on gemma's modules: the tiny presets keep their family's structure, cut models keep
valid KV sharing, the router reads the residual and reports its balance, every weight has an
init and a sharding rule, and remat changes no number."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from gemmalab.errors import ConfigError
from gemmalab.model import gemma4, presets, sharding
from tests.helpers.numerics import (
    REORDERED_FLOAT32,
    assert_close_to_scale,
    assert_trees_close_to_scale,
)
from tests.helpers.runs import small_config

VOCAB = 96


def _types(config):
    return "".join(t.name[0] for t in config.attention_types)  # L(ocal) or G(lobal)


def test_the_tiny_dense_preset_has_every_feature_of_e2b():
    config = presets.model_config("gemma4-tiny", VOCAB)
    e2b = presets.model_config("gemma4-e2b", 262_144)
    assert config.num_embed == VOCAB and _types(config) == "LLLLG" * 2
    assert config.per_layer_input_dim > 0 and e2b.per_layer_input_dim > 0
    # The second half shares the keys and values of the first half's last local and global
    # layers (as E2B's last 20 layers share those of its layers 13 and 14), and runs the wider
    # MLP E2B gives its sharing layers.
    assert gemma4.sharing_pattern(config) == [0, 1, 2, 3, 4, 3, 3, 3, 3, 4]
    assert gemma4.sharing_pattern(e2b)[15:] == [13, 13, 13, 13, 14] * 4
    assert config.override_kv_shared_ffw_hidden == 2 * config.hidden_dim
    assert config.global_key_size == 2 * config.head_dim  # wider global heads, as E2B's 512
    assert config.global_rope_proportion == e2b.global_rope_proportion == 0.25
    assert config.final_logit_softcap == e2b.final_logit_softcap == 30.0
    assert config.vision_encoder is None and config.audio_encoder is None


def test_the_tiny_moe_preset_has_every_feature_of_26b_a4b():
    config = presets.model_config("gemma4-tiny-moe", VOCAB)
    big = presets.model_config("gemma4-26b-a4b", 262_144)
    assert _types(config) == "LLLLLG"
    assert config.enable_moe and big.enable_moe
    assert config.num_experts > config.top_k_experts > 1
    assert (big.num_experts, big.top_k_experts) == (128, 8)
    assert config.moe_dense_hidden_dim > 0  # the dense MLP beside the experts
    assert config.k_eq_v_global and big.k_eq_v_global  # the global layers' values: their keys
    assert config.num_global_kv_heads < config.num_kv_heads


@pytest.mark.parametrize("name", ["gemma4-tiny", "gemma4-e2b", "gemma4-e4b"])
def test_a_cut_model_shares_keys_and_values_only_with_layers_it_has(name):
    whole = presets.model_config(name, VOCAB)
    for depth in range(1, whole.num_layers + 1):
        config = presets.model_config(name, VOCAB, num_layers=depth)
        assert config.num_layers == depth and _types(config) == _types(whole)[-depth:]
        pattern = gemma4.sharing_pattern(config)
        shared = [i for i, source in enumerate(pattern) if source != i]
        if not shared:
            assert config.kv_cache_sharing_config is None
            assert config.override_kv_shared_ffw_hidden is None
            continue
        first = shared[0]
        assert shared == list(range(first, depth))  # the tail shares, the head computes
        assert all(pattern[i] < first and config.attention_types[pattern[i]]
                   == config.attention_types[i] for i in shared), (depth, pattern)
    assert presets.model_config(name, VOCAB, num_layers=whole.num_layers) == whole
    with pytest.raises(ConfigError, match="^num_layers: 0 is not among"):
        presets.model_config(name, VOCAB, num_layers=0)


def _model_and_params(name, remat="none", seed=0, **changes):
    import dataclasses

    config = dataclasses.replace(presets.model_config(name, VOCAB), **changes)
    model = presets.build_model(config, param_dtype=jnp.float32, remat=remat)
    return model, presets.init_params(model, seed=seed, sample_length=16)


def _tokens(rows=2, length=24):
    return jnp.asarray(np.random.default_rng(0).integers(3, VOCAB, (rows, length)), jnp.int32)


def _loss(model, params, tokens):
    output, sown = model.apply({"params": params}, tokens, return_hidden_states=True,
                               mutable=[gemma4.ROUTER_COLLECTION])
    logp = jax.nn.log_softmax(output.logits[:, :-1])
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()
    return nll, sown


@pytest.mark.parametrize("name", ["gemma4-tiny", "gemma4-tiny-moe"])
def test_random_init_and_remat_of_the_tiny_presets(name):
    """Gemma 4's norms multiply by their scale: every 1-D weight starts at one. Remat
    recomputes each block with its per-layer input and shared keys and values: the same loss
    and gradients as without it."""
    model, params = _model_and_params(name)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if leaf.ndim == 1:
            np.testing.assert_array_equal(leaf, 1.0, err_msg=jax.tree_util.keystr(path))
        else:
            assert 0 < float(jnp.std(leaf)) < 1, jax.tree_util.keystr(path)
    tokens = _tokens()
    (loss, _), grads = jax.value_and_grad(_loss, argnums=1, has_aux=True)(model, params, tokens)
    assert abs(float(loss) - np.log(VOCAB)) < 1.0  # near uniform at init
    remat_model, _ = _model_and_params(name, remat="full")
    (remat_loss, _), remat_grads = jax.value_and_grad(_loss, argnums=1, has_aux=True)(
        remat_model, params, tokens)
    # Remat sums in another order: float32 rounding at each gradient's own scale.
    assert_close_to_scale(remat_loss, loss, REORDERED_FLOAT32)
    assert_trees_close_to_scale(remat_grads, grads, REORDERED_FLOAT32)
    # The sharing layers' own key and value weights are computed but never read.
    if name == "gemma4-tiny":
        unused = grads["layer_7"]["attn"]["kv_einsum"]["w"]
        assert float(jnp.abs(unused).max()) == 0.0
        assert float(jnp.abs(grads["layer_3"]["attn"]["kv_einsum"]["w"]).max()) > 0


def test_the_router_reads_the_residual_not_the_expert_branch_input():
    """gemma 4.0.1 routes on pre_ffw_norm's output; Hugging Face's Gemma 4 on the residual.
    With a pre_ffw_norm scale far from one the experts' input changes, the routing must not."""
    model, params = _model_and_params("gemma4-tiny-moe")
    tokens = _tokens()
    _, sown = _loss(model, params, tokens)
    norm = params["layer_0"]["pre_ffw_norm"]["scale"]
    skewed = {**params, "layer_0": {**params["layer_0"], "pre_ffw_norm": {
        "scale": norm * jnp.linspace(0.1, 3.0, norm.size)}}}
    loss, skewed_sown = _loss(model, skewed, tokens)
    # Layer 0's routing is unchanged (later layers read its changed output).
    np.testing.assert_allclose(skewed_sown[gemma4.ROUTER_COLLECTION]["layer_0"]["mlp"]["stats"],
                               sown[gemma4.ROUTER_COLLECTION]["layer_0"]["mlp"]["stats"],
                               rtol=1e-6)
    assert float(loss) != float(_loss(model, params, tokens)[0])


def test_router_metrics_are_one_when_balanced_and_grow_with_imbalance():
    experts = 4
    balanced = jnp.full((2, experts), 1 / experts)
    skewed = jnp.stack([jnp.array([0.7, 0.1, 0.1, 0.1]), jnp.array([1.0, 0.0, 0.0, 0.0])])
    def layer(stats, dropped):  # as a MoE layer sows them
        return {"mlp": {"stats": (stats,), "dropped": (jnp.float32(dropped),)}}

    even = gemma4.router_metrics({"layer_0": layer(balanced, 0.0)})
    assert float(even["router_balance_loss"]) == pytest.approx(1.0)
    assert float(even["router_max_load"]) == pytest.approx(1.0)
    assert float(even["router_dropped"]) == 0.0
    # Two layers: the mean.
    uneven = gemma4.router_metrics({"layer_0": layer(balanced, 0.0), "layer_1": layer(skewed, 0.5)})
    assert float(uneven["router_balance_loss"]) == pytest.approx((1.0 + 4 * 0.7) / 2)
    assert float(uneven["router_max_load"]) == pytest.approx((1.0 + 4.0) / 2)
    assert float(uneven["router_dropped"]) == pytest.approx(0.25)
    assert gemma4.router_metrics({}) == {}


@pytest.mark.parametrize("name", ["gemma4-tiny", "gemma4-tiny-moe", "gemma4-e2b",
                                  "gemma4-31b", "gemma4-26b-a4b"])
def test_every_gemma4_weight_has_a_sharding_rule(name):
    """Experts split over ``expert``, heads and widths over ``tensor``, the model dimension
    over ``fsdp``; on a mesh without an expert axis the experts stay whole."""
    from gemmalab.plan.shapes import abstract_params

    params = abstract_params(presets.model_config(name, 4096 if "tiny" in name else 262_144),
                             "bfloat16")
    mesh = AbstractMesh((2, 2, 2), ("fsdp", "tensor", "expert"))
    specs = {jax.tree_util.keystr(path): sharding.weight_spec(path, leaf.shape, mesh)
             for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    if "moe" in name or "a4b" in name:
        assert specs["['layer_0']['mlp']['gating_einsum']['w']"] == PartitionSpec(
            "expert", None, "tensor", "fsdp")
        assert specs["['layer_0']['mlp']['linear']['w']"] == PartitionSpec(
            "expert", "tensor", "fsdp")
        assert specs["['layer_0']['mlp2']['linear']"] == PartitionSpec("tensor", "fsdp")
        flat = AbstractMesh((2, 4), ("fsdp", "tensor"))
        path, leaf = next((p, x) for p, x in jax.tree_util.tree_leaves_with_path(params)
                          if jax.tree_util.keystr(p) == "['layer_0']['mlp']['linear']['w']")
        assert sharding.weight_spec(path, leaf.shape, flat)[0] is None
    else:
        assert specs["['layer_0']['mlp']['gating_einsum']"] == PartitionSpec(
            None, "tensor", "fsdp")


def test_fused_attention_is_refused_for_gemma4_in_one_line():
    config = presets.model_config("gemma4-tiny", VOCAB)
    with pytest.raises(ConfigError, match="^attention: 'splash' is not wired for Gemma 4"):
        presets.build_model(config, param_dtype=jnp.float32, attention="splash")
    assert presets.build_model(config, param_dtype=jnp.float32, attention="auto") is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma4-tiny", "gemma4-tiny-moe"])
def test_a_tiny_gemma4_run_learns_and_reports_its_router(name, tmp_path, cache_dir,
                                                          stories_file):
    from gemmalab.train.experiment import Experiment

    config = small_config(tmp_path, cache_dir, stories_file, model=name, max_steps=16,
                          eval_every=0)
    experiment = Experiment.prepare(config)
    summary = experiment.train(progress=False)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 1.0
    assert summary["params"]["model"] == name
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    if name.endswith("-moe"):
        balance = [row["router_balance_loss"] for row in rows]
        assert all(1.0 <= b < 8.0 for b in balance)
        assert all(1.0 <= row["router_max_load"] <= 8.0 for row in rows)
        assert all(row["router_dropped"] == 0.0 for row in rows)  # dropless
    else:
        assert not any("router_balance_loss" in row for row in rows)
    assert experiment.sample("Once upon a time", max_new_tokens=8).text


@pytest.mark.slow
def test_a_capacity_factor_reaches_the_run_and_its_dropped_tokens_are_reported(
        tmp_path, cache_dir, stories_file):
    """``expert_capacity_factor`` on an expert axis: the run's MoE layers exchange with room
    for a balanced share (capacity 1), so some routed copies are dropped, and each step's row
    says how many."""
    from gemmalab.train.experiment import Experiment

    config = small_config(tmp_path, cache_dir, stories_file, model="gemma4-tiny-moe",
                          num_layers=2, max_steps=3, eval_every=0, mesh={"expert": 8},
                          expert_capacity_factor=1.0)
    Experiment.prepare(config).train(progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    dropped = [row["router_dropped"] for row in rows]
    assert len(dropped) == 3 and all(0.0 < d < 0.5 for d in dropped), dropped
