import dataclasses
import json

import pytest

from gemmalab.config import PRESET_NAMES
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


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES if n != "gemma3-tiny"])
def test_real_presets_are_gemma_classes_text_only(name):
    from gemma import gm

    config = presets.model_config(name, 262_144)
    original = getattr(gm.nn, presets.PRESETS[name].gemma_class).config
    assert config == dataclasses.replace(original, vision_encoder=None)


def test_model_config_round_trips_through_json():
    for name in ("gemma3-tiny", "gemma3-270m", "gemma3-4b"):
        config = presets.model_config(name, 4096)
        rebuilt = presets.config_from_dict(json.loads(json.dumps(presets.config_to_dict(config))))
        assert rebuilt == config
