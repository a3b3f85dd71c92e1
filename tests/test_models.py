import dataclasses
import json

import pytest

from gemmalab import models
from gemmalab.config import PRESET_NAMES
from gemmalab.errors import ConfigError


def test_tiny_preset_keeps_the_gemma3_architecture():
    from gemma import gm
    from gemma.gm.nn._modules import AttentionType

    config = models.model_config("gemma3-tiny", 2048)
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

    config = models.model_config(name, 262_144)
    original = getattr(gm.nn, models.PRESETS[name].gemma_class).config
    assert config == dataclasses.replace(original, vision_encoder=None)


def test_model_config_round_trips_through_json():
    for name in ("gemma3-tiny", "gemma3-270m", "gemma3-4b"):
        config = models.model_config(name, 4096)
        rebuilt = models.config_from_dict(json.loads(json.dumps(models.config_to_dict(config))))
        assert rebuilt == config


def test_checkpoint_resolution(tmp_path, monkeypatch):
    assert models.resolve_checkpoint("", "gemma3-tiny").path == ""
    local = models.resolve_checkpoint(str(tmp_path), "gemma3-tiny")
    assert local.path == str(tmp_path.resolve())
    monkeypatch.setattr("gemmalab.storage._gcs_credentials_found", lambda: True)
    named = models.resolve_checkpoint("gemma3_270m_pt", "gemma3-270m")
    assert named.path == "gs://gemma-data/checkpoints/gemma3-270m-pt"


@pytest.mark.parametrize(
    ("spec", "model", "message"),
    [
        ("GEMMA3_1B_PT", "gemma3-270m", "GEMMA3_1B_PT does not fit model 'gemma3-270m'"),
        ("GEMMA3_270M_PT", "gemma3-tiny", "does not fit model 'gemma3-tiny'"),
        ("gemma3-270m-weights", "gemma3-270m", "unknown checkpoint 'gemma3-270m-weights'"),
        ("./missing/dir", "gemma3-270m", "no Orbax checkpoint directory at ./missing/dir"),
        ("GEMMA3_270M_PT", "gemma3-270m", "is on Google Cloud Storage but no credentials"),
        ("gs://bucket/ckpt", "gemma3-270m", "is on Google Cloud Storage but no credentials"),
    ],
)
def test_bad_checkpoints(spec, model, message, monkeypatch):
    monkeypatch.setattr("gemmalab.storage._gcs_credentials_found", lambda: False)
    with pytest.raises(ConfigError) as error:
        models.resolve_checkpoint(spec, model)
    assert str(error.value).startswith("checkpoint: ")
    assert message in str(error.value)
