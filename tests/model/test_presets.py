import dataclasses
import json

import pytest

from gemmalab.config import PRESET_NAMES, TINY_PRESETS
from gemmalab.model import presets


def test_tiny_preset_keeps_the_gemma3_architecture():
    from gemma import gm
    from gemma.gm.nn._modules import AttentionType

    config = presets.model_config("gemma3-tiny", 2048)
    reference = gm.nn.Gemma3_270M.config
    assert config.num_embed == 2048  # sized from the tokenizer
    assert config.attention_types == (AttentionType.LOCAL_SLIDING,) * 5 + (AttentionType.GLOBAL,)
    assert config.use_qk_norm and config.use_post_attn_norm and config.use_post_ffw_norm
    assert config.num_heads > config.num_kv_heads > 0  # grouped-query attention
    assert config.sliding_window_size < 256
    for field in ("local_base_frequency", "global_base_frequency", "query_pre_attn_norm",
                  "transpose_gating_einsum", "final_logit_softcap"):
        assert getattr(config, field) == getattr(reference, field)


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES if n not in TINY_PRESETS])
def test_real_presets_are_gemma_classes_text_only(name):
    from gemma import gm

    config = presets.model_config(name, 262_144)
    original = getattr(gm.nn, presets.PRESETS[name].gemma_class).config
    if presets.PRESETS[name].family == "gemma3":
        assert config == dataclasses.replace(original, vision_encoder=None)
    else:  # no vision or audio tower, nor the attention its image tokens would get
        assert config == dataclasses.replace(original, vision_encoder=None, audio_encoder=None,
                                             use_bidirectional_attention=None)


def test_num_layers_keeps_the_tail_of_the_attention_pattern():
    from gemma.gm.nn._modules import AttentionType

    from gemmalab.errors import ConfigError

    full = presets.model_config("gemma3-270m", 262_144)
    cut = presets.model_config("gemma3-270m", 262_144, num_layers=2)
    assert cut.attention_types == (AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL)
    assert cut.num_layers == 2
    assert cut == dataclasses.replace(full, attention_types=full.attention_types[-2:])
    assert presets.model_config("gemma3-tiny", 600, num_layers=6) == presets.model_config(
        "gemma3-tiny", 600)
    for depth in (0, 7):
        with pytest.raises(ConfigError, match=f"^num_layers: {depth} is not among gemma3-tiny's "
                                              "6 layers. Fix: use 1 to 6"):
            presets.model_config("gemma3-tiny", 600, num_layers=depth)


def test_model_config_round_trips_through_json():
    for name in ("gemma3-tiny", "gemma3-270m", "gemma3-4b", "gemma4-tiny", "gemma4-tiny-moe",
                 "gemma4-e2b", "gemma4-26b-a4b"):
        config = presets.model_config(name, 4096)
        rebuilt = presets.config_from_dict(json.loads(json.dumps(presets.config_to_dict(config))))
        assert rebuilt == config


def test_random_init_draws_each_weight_from_its_own_key_with_its_fan_in_std():
    """gemma's tree and shapes; norm scales at gemma's zeros; each weight ``normal(key_i) *
    std_i`` with key_i the i-th of the seed's keys (as every earlier version drew it: a random
    init base is drawn again from the run's seed), std 1/sqrt(fan-in), scaled down for the
    projections back into the residual stream."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    model = presets.build_model(presets.model_config("gemma3-tiny", 64), param_dtype=jnp.float32)
    params = presets.init_params(model, seed=3, sample_length=8)
    gemmas = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(
        lambda x: (x.shape, x.dtype), gemmas)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    keys = jax.random.split(jax.random.split(jax.random.key(3))[1], len(leaves))
    depth_scale = 1.0 / np.sqrt(2 * model.config.num_layers)
    expected_std = {"['layer_1']['attn']['q_einsum']['w']": lambda w: 1 / np.sqrt(w.shape[1]),
                    "['layer_1']['mlp']['linear']": lambda w: depth_scale / np.sqrt(w.shape[0]),
                    "['embedder']['input_embedding']": lambda w: 1 / np.sqrt(w.shape[1])}
    for i, (path, weight) in enumerate(leaves):
        name = jax.tree_util.keystr(path)
        if weight.ndim < 2:
            assert path[-1].key == "scale" and not np.any(np.asarray(weight)), name
        elif name in expected_std:
            std = expected_std.pop(name)(weight)
            np.testing.assert_allclose(
                weight, jax.random.normal(keys[i], weight.shape, jnp.float32) * std, rtol=1e-6)
            assert abs(float(jnp.std(weight)) / std - 1) < 0.1, name
    assert not expected_std  # every weight above was found
    again = presets.init_params(model, seed=3, sample_length=8)
    other = presets.init_params(model, seed=4, sample_length=8)
    first = jax.tree.leaves(params)[0]  # the embedding
    assert np.array_equal(jax.tree.leaves(again)[0], first)
    assert not np.array_equal(jax.tree.leaves(other)[0], first)


def test_default_learning_rates_follow_lora_and_the_objective():
    lr = presets.default_learning_rate
    # The 270M's LoRA rate came from sweeps (docs/benchmarks/lora-learning-rate.md); DPO: its own.
    assert lr("gemma3-270m", lora=True) == 1e-3
    assert lr("gemma3-270m", lora=True, objective="dpo") == 1e-4
    assert lr("gemma3-270m", lora=False, objective="dpo") == lr("gemma3-270m", lora=False)
    # A preset without a DPO rate keeps its LoRA rate for DPO.
    assert lr("gemma3-1b", lora=True, objective="dpo") == lr("gemma3-1b", lora=True) == 2e-4
    assert lr("gemma3-tiny", lora=True, objective="dpo") == lr("gemma3-tiny", lora=True)
