"""Hugging Face Gemma 4 (``Gemma4ForCausalLM``) weights in and out, without torch.

``tests/fixtures/hf_gemma4_tiny{,_moe}.json`` hold what transformers itself saved for a Gemma 4
of each tiny preset's structure (dense: per-layer embeddings, KV sharing, double-width MLP;
mixture of experts: experts, router, keys as values), with its logits and greedy tokens
(``bench/make_hf_gemma4_fixture.py``). Importing those tensors must give transformers' logits;
exporting must give its names, shapes and ``config.json``. The float32 parity at the presets'
own sizes, both ways, is ``make interop`` (``bench/interop_gemma4.py``).
"""

import base64
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmalab.errors import ConfigError
from gemmalab.model import presets
from gemmalab.weights import export, hf_layout

FIXTURES = Path(__file__).parents[1] / "fixtures"
PRESETS = ["gemma4-tiny", "gemma4-tiny-moe"]


def _fixture(name):
    return json.loads((FIXTURES / f"hf_{name.replace('-', '_')}.json").read_text())


def _decode(entry):
    import ml_dtypes

    dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[entry["dtype"]]
    values = np.frombuffer(base64.b64decode(entry["data"]), dtype).reshape(entry["shape"])
    return values.astype(np.float32)


def _micro(fixture):
    """The fixture's gemma config, model and abstract params."""
    config = presets.config_from_dict(fixture["gemma_config"])
    model = presets.build_model(config, param_dtype=jnp.float32)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    return config, model, abstract["params"]


def _tensors(fixture, prefix="model."):
    return {prefix + name[len("model."):]: _decode(entry)
            for name, entry in fixture["tensors"].items()}


def _import(fixture, abstract, tensors=None):
    return hf_layout.hf_to_gemma(
        _tensors(fixture) if tensors is None else tensors, abstract,
        kv_shared_layers=fixture["hf_config"]["num_kv_shared_layers"])


def _greedy(model, params, prompt, steps):
    """Greedy tokens from causal forward passes of one fixed length (one compile)."""
    length = len(prompt) + steps
    mask = jnp.tril(jnp.ones((1, length, length), bool))
    forward = jax.jit(lambda ids: model.apply({"params": params}, ids,
                                              positions=jnp.arange(length)[None],
                                              attention_mask=mask).logits)
    ids = np.zeros((1, length), np.int32)
    ids[0, :len(prompt)] = prompt
    for t in range(len(prompt), length):
        ids[0, t] = int(np.argmax(np.asarray(forward(ids))[0, t - 1]))
    return ids[0].tolist()


@pytest.mark.parametrize("name", PRESETS)
def test_transformers_saved_gemma4_imports_with_its_logits_and_greedy_tokens(name):
    fixture = _fixture(name)
    _, model, abstract = _micro(fixture)
    params = _import(fixture, abstract)
    tokens = np.asarray(fixture["tokens"], np.int32)
    logits = np.asarray(model.apply({"params": params}, tokens).logits, np.float32)
    want = _decode(fixture["hf_logits"])
    assert np.max(np.abs(logits - want)) <= 1e-4, np.max(np.abs(logits - want))
    greedy = fixture["greedy"]
    assert _greedy(model, params, greedy["prompt"], len(greedy["hf"]) - len(greedy["prompt"])
                   ) == greedy["hf"]


def test_sharing_layers_get_placeholder_keys_and_values():
    """transformers saves no k_proj/v_proj/k_norm for layers that reuse another's: gemma's
    unused ones are zeros (norm scales ones), and a computing layer without them is refused."""
    fixture = _fixture("gemma4-tiny")
    assert fixture["hf_config"]["num_kv_shared_layers"] == 5
    assert "model.layers.5.self_attn.k_proj.weight" not in fixture["tensors"]
    _, _, abstract = _micro(fixture)
    params = _import(fixture, abstract)
    for i in range(5, 10):
        attn = params[f"layer_{i}"]["attn"]
        assert not np.any(attn["kv_einsum"]["w"]) and np.all(attn["key_norm"]["scale"] == 1)
    tensors = _tensors(fixture)
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    with pytest.raises(KeyError, match="layers.2.self_attn.k_proj"):
        _import(fixture, abstract, tensors)


def test_the_hubs_multimodal_layout_imports_its_language_model_alone():
    fixture = _fixture("gemma4-tiny-moe")
    _, _, abstract = _micro(fixture)
    tensors = _tensors(fixture, prefix="model.language_model.")
    tensors["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = np.ones((2, 2))
    tensors["model.embed_vision.embedding_projection.weight"] = np.ones((2, 2))
    multimodal = _import(fixture, abstract, tensors)
    plain = _import(fixture, abstract)
    for path, value in hf_layout._flatten(plain).items():
        np.testing.assert_array_equal(hf_layout._flatten(multimodal)[path], value)


@pytest.mark.parametrize("name", PRESETS)
def test_export_writes_transformers_config_names_and_shapes(name, tmp_path):
    fixture = _fixture(name)
    config, model, abstract = _micro(fixture)
    written = hf_layout.hf_config(config, dtype="float32", bos_id=2, eos_id=1, pad_id=0)
    saved = fixture["hf_config"]
    # HF turns global_head_dim and num_global_key_value_heads into per_layer_config on load.
    derived = {"global_head_dim", "num_global_key_value_heads", "torch_dtype"}
    assert set(written) - derived <= set(saved)
    for key in set(written) - derived:
        assert written[key] == saved[key], key
    globals_ = [i for i, t in enumerate(written["layer_types"]) if t == "full_attention"]
    overrides = {"head_dim": written["global_head_dim"]}
    if written["attention_k_eq_v"]:
        overrides["num_key_value_heads"] = written["num_global_key_value_heads"]
    assert saved["per_layer_config"] == {str(i): overrides for i in globals_}

    params = _import(fixture, abstract)
    tensors = hf_layout.hf_tensors(params, config, "float32")
    layout = {t.name: list(t.shape) for t in tensors}
    assert layout == {k: v["shape"] for k, v in fixture["tensors"].items()}
    hf = _tensors(fixture)
    for t in tensors:  # and their values: the import's exact inverse
        np.testing.assert_array_equal(t.values(), hf[t.name], err_msg=t.name)


def _random_params(name, vocab, seed=0):
    config = presets.model_config(name, vocab)
    model = presets.build_model(config, param_dtype=jnp.float32)
    params = presets.init_params(model, seed=seed, sample_length=8)
    rng = np.random.default_rng(seed)  # 1-D scales start at one: make a swap show
    params = jax.tree.map(lambda w: (np.asarray(w) + rng.normal(size=w.shape).astype(np.float32)
                                     if w.ndim == 1 else np.asarray(w)), params)
    return config, params


@pytest.mark.parametrize("name", PRESETS)
def test_export_then_import_is_exact_in_float32(name, sp_model, tmp_path):
    config, params = _random_params(name, 600)
    hf_layout.export_hf(params, config, sp_model, tmp_path, dtype="float32")
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "gemma4_text"
    loaded = hf_layout.load_hf_params(
        tmp_path, jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, np.float32), params))
    unexported = hf_layout.unexported_paths(config)
    assert bool(unexported) == (name == "gemma4-tiny")  # the dense preset's sharing layers
    ours, theirs = hf_layout._flatten(params), hf_layout._flatten(loaded)
    assert set(ours) == set(theirs)
    for path, value in ours.items():
        if path in unexported:
            assert np.all(theirs[path] == (1 if path[-1] == "scale" else 0)), path
        else:
            np.testing.assert_array_equal(np.asarray(theirs[path]), value, err_msg=str(path))


def test_a_run_exported_to_hf_reads_back_exactly(tmp_path, sp_model):
    """``export.hf_round_trip`` (the export notebook's check) leaves out the weights HF has no
    place for instead of reporting them as differences."""
    from gemmalab.weights import orbax_params

    config, params = _random_params("gemma4-tiny", 600)
    run = tmp_path / "run"
    orbax_params.save_params(params, str(run / "params"))
    (run / "summary.json").write_text(json.dumps({"model_config":
                                                  presets.config_to_dict(config)}))
    hf_layout.export_hf(params, config, sp_model, tmp_path / "hf", dtype="float32")
    report = export.hf_round_trip(run, tmp_path / "hf")
    assert report["max abs difference"] == 0.0
    assert report["weights"] == len(hf_layout._flatten(params)) - 10  # 5 x kv_einsum, key_norm


def test_gemma4_turn_pieces_get_gemma4s_chat_template_and_stop_token(sp_model, tmp_path):
    import jinja2
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sp_model.read_bytes())
    for piece in proto.pieces:
        piece.piece = {"<start_of_turn>": "<|turn>", "<end_of_turn>": "<turn|>"}.get(
            piece.piece, piece.piece)
    config, params = _random_params("gemma4-tiny-moe", 600)
    hf_layout.export_hf(params, config, proto.SerializeToString(), tmp_path)
    template = json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"]
    chat = jinja2.Environment().from_string(template).render(
        bos_token="<bos>", add_generation_prompt=True,
        messages=[{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi "},
                  {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}])
    # gemma's dialog format (Gemma4Tokenizer): a real system turn, each turn closed by <turn|>.
    assert chat == ("<bos><|turn>system\nBe brief<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
                    "Hello<turn|>\n<|turn>user\nBye<turn|>\n<|turn>model\n")
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 11]  # <eos>, then <turn|> (the local id 11)


@pytest.mark.parametrize("change, problem", [
    ({"attn_logits_soft_cap": 50.0}, "attention logit soft-capping"),
    ({"override_kv_shared_ffw_hidden": 3 * 512}, "is not twice"),
    ({"share_global": False}, "is not Gemma4TextConfig's"),  # a global layer amid sharing ones
])
def test_configs_transformers_cannot_express_are_refused_before_writing(change, problem,
                                                                        sp_model, tmp_path):
    import dataclasses

    config = presets.model_config("gemma4-tiny", 600)
    if "share_global" in change:
        change = {"kv_cache_sharing_config": dataclasses.replace(
            config.kv_cache_sharing_config, **change)}
    bad = dataclasses.replace(config, **change)
    with pytest.raises(ConfigError, match=f"^model_config: .*{problem}"):
        hf_layout.export_hf({}, bad, sp_model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _hf_dir(path, config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path  # no weights at all: the check must not need them


def test_the_family_of_an_hf_directory_is_read_from_its_config(tmp_path):
    gemma3 = _hf_dir(tmp_path / "g3", {"model_type": "gemma3_text"})
    gemma4 = _hf_dir(tmp_path / "g4", {"model_type": "gemma4_text"})
    hub4 = _hf_dir(tmp_path / "hub4", {"model_type": "gemma4",
                                       "text_config": {"model_type": "gemma4_text"}})
    hub3 = _hf_dir(tmp_path / "hub3", {"model_type": "gemma3",
                                       "text_config": {"model_type": "gemma3_text"}})
    llama = _hf_dir(tmp_path / "llama", {"model_type": "llama"})
    assert [hf_layout.hf_family(p) for p in (gemma3, gemma4, hub4, hub3, llama)] == [
        "gemma3", "gemma4", "gemma4", "gemma3", None]
    hf_layout.require_hf_family(gemma4, "gemma4-e2b")
    hf_layout.require_hf_family(hub3, "gemma3-1b")
    with pytest.raises(ConfigError) as wrong:
        hf_layout.require_hf_family(gemma3, "gemma4-e2b")
    message = str(wrong.value)
    assert message.startswith("checkpoint: ") and "\n" not in message
    assert "Gemma 3 model" in message and "gemma3-270m" in message
    with pytest.raises(ConfigError, match="^checkpoint: .*holds a Gemma 4 model.*gemma4-e4b"):
        hf_layout.require_hf_family(hub4, "gemma3-270m")
    with pytest.raises(ConfigError, match="^checkpoint: .*model_type 'llama'"):
        hf_layout.require_hf_family(llama, "gemma4-tiny")


def test_the_published_sizes_map_to_gemma4_text_configs():
    """E2B's 20 sharing layers with their double-width MLP and per-layer inputs; the 26B-A4B's
    experts beside a dense MLP; the large models' keys-as-values global layers."""
    def hf(name):
        return hf_layout.hf_config(presets.model_config(name, 262_144))

    e2b, e4b, big, moe = (hf(n) for n in ("gemma4-e2b", "gemma4-e4b", "gemma4-31b",
                                          "gemma4-26b-a4b"))
    assert (e2b["num_kv_shared_layers"], e2b["use_double_wide_mlp"],
            e2b["hidden_size_per_layer_input"], e2b["intermediate_size"]) == (20, True, 256, 6144)
    assert e2b["layer_types"][:5] == ["sliding_attention"] * 4 + ["full_attention"]
    assert (e4b["num_kv_shared_layers"], e4b["num_hidden_layers"]) == (18, 42)
    assert e2b["global_head_dim"] == big["global_head_dim"] == 512
    assert (big["attention_k_eq_v"], big["num_global_key_value_heads"],
            big["hidden_size_per_layer_input"], big["num_kv_shared_layers"]) == (True, 4, 0, 0)
    assert (moe["enable_moe_block"], moe["num_experts"], moe["top_k_experts"],
            moe["moe_intermediate_size"], moe["intermediate_size"]) == (True, 128, 8, 704, 2112)
    assert moe["rope_parameters"]["full_attention"] == {
        "rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
    assert e2b["max_position_embeddings"] == 131_072 and moe["max_position_embeddings"] == 262_144
