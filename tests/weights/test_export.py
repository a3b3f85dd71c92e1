"""Exports that other tools load: Hugging Face Gemma3ForCausalLM, PEFT adapters, gemma's format.

Names, shapes and config fields are checked against ``tests/fixtures/hf_gemma3_tiny.json``: what
the real transformers and peft saved for the tiny preset's dimensions (bench/make_hf_fixture.py
says how; no torch is needed here). The logits round trip through transformers and peft
themselves is ``make interop`` (bench/interop.py).
"""

import json
from pathlib import Path

import numpy as np
import pytest

from gemmalab.errors import ConfigError
from gemmalab.model import lora, presets
from gemmalab.weights import export, hf_layout, orbax_params, peft_adapters, safetensors_io
from tests.helpers.numerics import REORDERED_FLOAT32, assert_close_to_scale

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "hf_gemma3_tiny.json").read_text())
VOCAB = FIXTURE["vocab_size"]
RANK, ALPHA = FIXTURE["lora_rank"], FIXTURE["lora_alpha"]


@pytest.fixture(scope="module")
def adapters(tiny):
    """Random LoRA adapters (``b`` non-zero, unlike a fresh init) on every projection."""
    import jax

    config, _ = tiny
    fresh = lora.init_adapters(config, rank=RANK, modules="all", dtype="float32", seed=0)
    leaves, treedef = jax.tree.flatten(fresh)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(treedef, [
        np.asarray(jax.random.normal(k, x.shape)) * 0.1 for k, x in zip(keys, leaves, strict=True)])


def _as_numpy(tree):
    import jax

    return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)


def _abstract(params):
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), params)


# ---------------------------------------------------------------------------------------------
# Hugging Face layout


def test_hf_export_has_transformers_names_shapes_and_config(tiny, sp_model, tmp_path):
    config, params = tiny
    written = hf_layout.export_hf(params, config, sp_model, tmp_path / "hf")
    assert written == sorted(["model.safetensors", "config.json", "tokenizer.model",
                              "tokenizer_config.json", "special_tokens_map.json",
                              "generation_config.json"])
    layout = {name: {"shape": shape, "dtype": dtype} for name, shape, dtype in
              safetensors_io.layout(tmp_path / "hf" / "model.safetensors")}
    assert layout == FIXTURE["hf_tensors"]  # no lm_head.weight: tied to the embedding
    written_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key, value in FIXTURE["hf_config"].items():
        if key not in ("transformers_version", "_sliding_window_pattern"):
            assert written_config[key] == value, key
    # transformers 4.x's names of the same settings
    assert written_config["rope_theta"] == 1_000_000
    assert written_config["rope_local_base_freq"] == 10_000
    assert written_config["rope_scaling"] is None
    assert written_config["sliding_window_pattern"] == 6
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == sp_model.read_bytes()


def test_hf_tokenizer_files_name_gemma_special_tokens(tiny, sp_model, tmp_path):
    config, params = tiny
    hf_layout.export_hf(params, config, sp_model.read_bytes(), tmp_path)
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "GemmaTokenizer"
    assert {k: tokenizer_config[k] for k in ("bos_token", "eos_token", "pad_token")} == {
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    assert "<start_of_turn>" in tokenizer_config["chat_template"]
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 2, "pad_token_id": 0, "eos_token_id": [1, 11]}


def test_real_presets_map_to_hub_configs():
    """The published Gemma 3 configs: global RoPE scaled 8x from 4B up, 27B's query scale."""
    one_b = hf_layout.hf_config(presets.model_config("gemma3-1b", 262_144))
    assert (one_b["rope_scaling"], one_b["query_pre_attn_scalar"], one_b["sliding_window"],
            one_b["max_position_embeddings"]) == (None, 256, 512, 32_768)
    four_b = hf_layout.hf_config(presets.model_config("gemma3-4b", 262_144))
    assert four_b["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert four_b["rope_parameters"]["full_attention"] == {
        "rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000}
    assert four_b["max_position_embeddings"] == 131_072
    big = hf_layout.hf_config(presets.model_config("gemma3-27b", 262_144))
    assert big["query_pre_attn_scalar"] == 168  # 5376 / 32 heads
    assert big["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]


def test_hf_round_trip_is_exact_in_float32(tiny, sp_model, tmp_path):
    config, params = tiny
    hf_layout.export_hf(params, config, sp_model, tmp_path, dtype="float32")
    loaded = hf_layout.load_hf_params(tmp_path, _abstract(params))
    for path, value in hf_layout._flatten(_as_numpy(params)).items():
        np.testing.assert_array_equal(np.asarray(hf_layout._flatten(loaded)[path]), value,
                                      err_msg=str(path))


def test_sharded_export_writes_an_index_and_loads_back(tiny, sp_model, tmp_path):
    import ml_dtypes

    config, params = tiny
    written = hf_layout.export_hf(params, config, sp_model, tmp_path, max_shard_bytes=100_000)
    shards = [name for name in written if name.startswith("model-")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(FIXTURE["hf_tensors"])
    assert set(index["weight_map"].values()) == set(shards)
    sizes = [sum(np.prod(s) * 2 for _, s, _ in safetensors_io.layout(tmp_path / n))
             for n in shards]
    assert index["metadata"]["total_size"] == sum(sizes)
    assert max(sizes) <= max(100_000, VOCAB * 128 * 2)  # only the embedding is over the limit
    loaded = hf_layout.load_hf_params(tmp_path, _abstract(params))
    for path, value in hf_layout._flatten(_as_numpy(params)).items():
        expected = value.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(hf_layout._flatten(loaded)[path]), expected)


def test_hf_weights_keep_gemmas_head_and_gating_order(tiny):
    """Spot checks of the layout rules on known entries (head-major flattening, [out, in])."""
    config, params = tiny
    tensors = {t.name: t.values() for t in hf_layout.hf_tensors(params, config, "float32")}
    attn, mlp = params["layer_2"]["attn"], params["layer_2"]["mlp"]
    q = tensors["model.layers.2.self_attn.q_proj.weight"]
    head, d, h = 3, 17, 5
    assert q[head * config.head_dim + h, d] == np.asarray(attn["q_einsum"]["w"])[head, d, h]
    v = tensors["model.layers.2.self_attn.v_proj.weight"]
    assert v[1 * config.head_dim + h, d] == np.asarray(attn["kv_einsum"]["w"])[1, 1, d, h]
    o = tensors["model.layers.2.self_attn.o_proj.weight"]
    assert o[d, head * config.head_dim + h] == np.asarray(attn["attn_vec_einsum"]["w"])[head, h, d]
    up = tensors["model.layers.2.mlp.up_proj.weight"]
    assert up[40, d] == np.asarray(mlp["gating_einsum"])[1, 40, d]
    down = tensors["model.layers.2.mlp.down_proj.weight"]
    assert down[d, 40] == np.asarray(mlp["linear"])[40, d]


# ---------------------------------------------------------------------------------------------
# PEFT adapters


def test_peft_export_has_peft_names_shapes_and_config(tiny, adapters, tmp_path):
    config, _ = tiny
    written = peft_adapters.export_peft(adapters, config, tmp_path, rank=RANK, alpha=ALPHA,
                                        base_model_name_or_path="runs/base-hf")
    assert written == ["adapter_config.json", "adapter_model.safetensors"]
    layout = {name: {"shape": shape, "dtype": dtype} for name, shape, dtype in
              safetensors_io.layout(tmp_path / "adapter_model.safetensors")}
    assert layout == FIXTURE["peft_tensors"]
    adapter_config = json.loads((tmp_path / "adapter_config.json").read_text())
    reference = FIXTURE["peft_adapter_config"]
    assert set(adapter_config) <= set(reference)  # every field one that peft knows
    for key, value in adapter_config.items():
        if key not in ("target_modules", "base_model_name_or_path"):
            assert value == reference[key], key
    assert sorted(adapter_config["target_modules"]) == sorted(reference["target_modules"])
    assert adapter_config["base_model_name_or_path"] == "runs/base-hf"


@pytest.mark.parametrize("modules, targets", [
    ("attention", ["k_proj", "o_proj", "q_proj", "v_proj"]),
    ("mlp", ["down_proj", "gate_proj", "up_proj"]),
])
def test_peft_target_modules_follow_the_adapted_modules(tiny, tmp_path, modules, targets):
    config, _ = tiny
    only = lora.init_adapters(config, rank=2, modules=modules, dtype="float32", seed=0)
    peft_adapters.export_peft(only, config, tmp_path, rank=2, alpha=2, base_model_name_or_path="")
    adapter_config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert adapter_config["target_modules"] == targets
    assert adapter_config["base_model_name_or_path"] is None


def _hf_output(module: str, y):
    """A gemma projection's output laid out as HF's Linear outputs ([..., out] each)."""
    if module == "q_einsum":  # [B, T, N, H]
        return [y.reshape(*y.shape[:2], -1)]
    if module == "kv_einsum":  # [2, B, T, K, H]
        return [y[j].reshape(*y.shape[1:3], -1) for j in range(2)]
    if module == "gating_einsum":  # [B, T, 2, F]
        return [y[..., j, :] for j in range(2)]
    return [y]


def test_peft_matrices_reproduce_the_gemma_adapters_output(tiny, adapters):
    """On random inputs, PEFT's ``scale * B A x`` equals gemma's adapter ``scale * einsum(x, a,
    b)`` for every adapted projection (gemma's own LoRAEinsumAdapter computes the latter)."""
    from gemma import peft

    config, params = tiny
    equations = {"q_einsum": "BTD,NDH->BTNH", "kv_einsum": "BSD,CKDH->CBSKH",
                 "attn_vec_einsum": "BTNH,NHD->BTD", "gating_einsum": "...F,NHF->...NH",
                 "linear": "...H,HF->...F"}
    input_dims = {"q_einsum": (config.embed_dim,), "kv_einsum": (config.embed_dim,),
                  "attn_vec_einsum": (config.num_heads, config.head_dim),
                  "gating_einsum": (config.embed_dim,), "linear": (config.hidden_dim,)}
    scale = ALPHA / RANK
    rng = np.random.default_rng(0)
    checked = set()
    for path, module, a, b in lora.adapted_weights(adapters):
        weight = hf_layout._flatten(params)[path]
        adapter = peft.LoRAEinsumAdapter(rank=RANK, einsum_str=equations[module],
                                         shape=weight.shape, dtype=np.float32)
        x = rng.normal(size=(2, 5, *input_dims[module])).astype(np.float32)
        gemma_out = scale * np.asarray(adapter.apply({"params": {"a": a, "b": b}}, x))
        x_hf = x.reshape(2, 5, -1)
        peft_out = [scale * x_hf @ lora_a.T @ lora_b.T
                    for _, lora_a, lora_b in peft_adapters._peft_tensors(module, a, b)]
        for want, got in zip(_hf_output(module, gemma_out), peft_out, strict=True):
            # numpy's products against XLA's einsum: float32 summed in another order.
            assert_close_to_scale(got, want, REORDERED_FLOAT32)
        checked.add(module)
    assert checked == set(equations)


def test_merged_tree_exports_as_base_plus_peft_delta(tiny, adapters):
    """HF(merge(base, adapters)) == HF(base) + scale * B @ A for each adapted Linear: the HF
    export of a merged LoRA run and the PEFT adapter on the HF base agree."""
    config, params = tiny
    scale = ALPHA / RANK
    merged = lora.merge(params, adapters, scale)
    base = {t.name: t.values() for t in hf_layout.hf_tensors(params, config, "float32")}
    after = {t.name: t.values() for t in hf_layout.hf_tensors(merged, config, "float32")}
    peft_tensors = {t.name: t.values() for t in peft_adapters.peft_adapter_tensors(adapters)}
    for name, lora_a in peft_tensors.items():
        if ".lora_A." not in name:
            continue
        lora_b = peft_tensors[name.replace(".lora_A.", ".lora_B.")]
        hf_name = name.removeprefix("base_model.model.").replace(".lora_A", "")
        # The merge's float32 rounding (another order than numpy's), at the weight's scale.
        assert_close_to_scale(after[hf_name], base[hf_name] + scale * lora_b @ lora_a,
                              REORDERED_FLOAT32, err_msg=hf_name)


# ---------------------------------------------------------------------------------------------
# gemma's format, the HF directory as a run's checkpoint, the command line


def test_gemma_format_loads_with_gemma(tiny, tmp_path):
    import jax
    from gemma import gm

    _, params = tiny
    export.save_gemma_params(params, tmp_path / "params")
    loaded = gm.ckpts.load_params(str(tmp_path / "params"))
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_hf_directory_is_a_checkpoint_of_a_run(tiny, sp_model, tmp_path):
    """The run's hook (gemmalab.train.params.StartingWeights.read): read straight into fsdp
    shards, and a checkpoint of other dimensions is the usual one-line error."""
    import jax.numpy as jnp

    from gemmalab import plan
    from gemmalab.model import mesh
    from gemmalab.train.params import StartingWeights

    config, params = tiny
    hf_layout.export_hf(params, config, sp_model, tmp_path / "hf", dtype="float32")
    from gemmalab.weights import sources

    resolved = sources.resolve(str(tmp_path / "hf"), "gemma3-tiny", tmp_path)
    assert resolved.format == "hf"
    assert sources.resolve(str(tmp_path), "gemma3-tiny", tmp_path).format == "orbax"
    device_mesh = mesh.make_mesh({"fsdp": -1})

    def initial(model_config):
        model = presets.build_model(model_config, param_dtype=jnp.float32)
        starting = StartingWeights(model, resolved, preset="gemma3-tiny", seed=0,
                                   sample_length=8)
        return starting.read(jnp.float32, device_mesh,
                             plan.abstract_params(model_config, "float32"))

    loaded = initial(config)
    linear = loaded["layer_0"]["mlp"]["linear"]
    assert linear.addressable_shards[0].data.shape == (512, 128 // 8)
    for path, value in hf_layout._flatten(_as_numpy(params)).items():
        np.testing.assert_array_equal(np.asarray(hf_layout._flatten(loaded)[path]), value)
    with pytest.raises(ConfigError, match="^checkpoint: .* does not match gemma3-tiny"):
        initial(presets.model_config("gemma3-tiny", VOCAB + 100))


def _fake_run(run_dir: Path, params, config, tokenizer_path, adapters=None, **settings) -> Path:
    """A run's output_dir as a finished run leaves it: params/ (LoRA: merged), adapters/ (LoRA)
    summary.json and tokenizer.model."""
    from gemmalab.weights import orbax_params

    orbax_params.save_params(params, str(run_dir / "params"))
    if adapters is not None:
        orbax_params.save_params(adapters, str(run_dir / "adapters"))
    summary = {"model_config": presets.config_to_dict(config),
               "params": {"tokenizer": str(tokenizer_path), "checkpoint": "", **settings}}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / export.TOKENIZER_FILE).write_bytes(Path(tokenizer_path).read_bytes())
    return run_dir


def test_cli_exports_a_run(tiny, sp_model, tmp_path, capsys):
    config, params = tiny
    run = _fake_run(tmp_path / "run", params, config, sp_model)
    assert export.main(["--run", str(run), "--format", "hf", "--out", str(tmp_path / "hf"),
                        "--dtype", "float32"]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    loaded = hf_layout.load_hf_params(tmp_path / "hf", _abstract(params))
    np.testing.assert_array_equal(loaded["final_norm"]["scale"], params["final_norm"]["scale"])
    assert export.main(["--run", str(run), "--format", "peft", "--out", str(tmp_path / "p")]) == 2
    assert "format: run" in capsys.readouterr().err


def test_cli_exports_a_lora_runs_merged_weights_and_its_adapters(tiny, adapters, sp_model,
                                                                 tmp_path):
    config, params = tiny
    merged = lora.merge(params, adapters, ALPHA / RANK)
    run = _fake_run(tmp_path / "run", merged, config, sp_model, adapters=adapters,
                    lora_rank=RANK, lora_alpha=ALPHA)
    assert export.main(["--run", str(run), "--format", "peft", "--out",
                        str(tmp_path / "peft")]) == 0
    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (RANK, ALPHA)
    peft_tensors = safetensors_io.read_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert len(peft_tensors) == len(FIXTURE["peft_tensors"])
    export.export_run(run, "hf", tmp_path / "hf", dtype="float32")
    loaded = hf_layout.load_hf_params(tmp_path / "hf", _abstract(params))
    np.testing.assert_array_equal(loaded["layer_1"]["attn"]["q_einsum"]["w"],
                                  merged["layer_1"]["attn"]["q_einsum"]["w"])
    export.export_run(run, "gemma", tmp_path / "gemma", dtype="bfloat16")

    bf16 = orbax_params.load_params(str(tmp_path / "gemma"))
    assert bf16["layer_1"]["mlp"]["linear"].dtype == np.dtype("bfloat16")


@pytest.mark.parametrize("call, parameter", [
    (lambda p, c, tok, out: hf_layout.export_hf(p, c, tok, out, dtype="int8"), "dtype"),
    (lambda p, c, tok, out: hf_layout.export_hf(p, c, tok, out, max_shard_bytes=0),
     "max_shard_bytes"),
    (lambda p, c, tok, out: hf_layout.export_hf(p, c, out / "nothing.model", out / "x"),
     "tokenizer"),
    (lambda p, c, tok, out: hf_layout.export_hf(
        lora.join(p, lora.init_adapters(c, rank=2, modules="mlp", dtype="float32", seed=0)),
        c, tok, out / "x"), "params"),
])
def test_bad_input_is_a_one_line_error(tiny, sp_model, tmp_path, call, parameter):
    config, params = tiny
    with pytest.raises(ConfigError) as error:
        call(params, config, sp_model, tmp_path)
    assert error.value.parameter == parameter
    assert "\n" not in str(error.value)


def test_a_non_empty_out_dir_is_refused(tiny, adapters, sp_model, tmp_path):
    config, params = tiny
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="^out_dir: .* exists and is not empty"):
        hf_layout.export_hf(params, config, sp_model, tmp_path)
    with pytest.raises(ConfigError, match="^out_dir: "):
        peft_adapters.export_peft(adapters, config, tmp_path, rank=RANK, alpha=ALPHA,
                                  base_model_name_or_path="")
    with pytest.raises(ConfigError, match="^rank: "):
        peft_adapters.export_peft(adapters, config, tmp_path / "new", rank=RANK + 1, alpha=ALPHA,
                                  base_model_name_or_path="")
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_the_notebooks_formats_are_checked_and_peft_is_said_to_be_skipped(tmp_path):
    full, lora_run = tmp_path / "full", tmp_path / "lora"
    for run, rank in ((full, 0), (lora_run, 8)):
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({"params": {"lora_rank": rank}}))
        (run / "params").mkdir()
    said = []
    assert export.chosen_formats(["hf", "gemma", "peft"], full, log=said.append) == [
        "hf", "gemma"]
    assert said == [f"peft skipped: {full} trained every weight (lora_rank 0), it has no "
                    "adapters"]
    assert export.chosen_formats("peft", lora_run, log=said.append) == ["peft"]  # one name
    with pytest.raises(ConfigError, match=r"^formats: \['hf', 'hff'\] names \['hff'\]\. Fix: "):
        export.chosen_formats(["hf", "hff"], full)
    with pytest.raises(ConfigError, match=r"^formats: \[\] names no format"):
        export.chosen_formats([], full)
