"""Gemma 4's LoRA adapters in PEFT's layout: Hugging Face Gemma 4's module names, the experts as
PEFT's target_parameters (lora_A expert-major [r E, in], lora_B rank-major [out, r E]), and
each exported update equal to what the merge adds to the weight (numpy; transformers and peft
themselves are the interop check's)."""

import json

import jax
import numpy as np
import pytest

from gemmalab.errors import ConfigError
from gemmalab.model import lora, presets
from gemmalab.weights import peft_adapters, safetensors_io
from tests.helpers.numerics import REORDERED_FLOAT32, assert_close_to_scale

VOCAB = 96
RANK, ALPHA = 4, 8.0
PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module", params=["gemma4-tiny", "gemma4-tiny-moe"])
def tiny(request):
    """A tiny preset's config, random float32 weights and trained-looking adapters (b != 0)."""
    import jax.numpy as jnp

    config = presets.model_config(request.param, VOCAB)
    model = presets.build_model(config, param_dtype=jnp.float32)
    params = presets.init_params(model, seed=0, sample_length=8)
    fresh = lora.init_adapters(config, rank=RANK, modules="all", dtype="float32", seed=0)
    leaves, tree = jax.tree.flatten(fresh)
    rng = np.random.default_rng(1)
    adapters = jax.tree.unflatten(tree, [np.asarray(x) + rng.normal(0, 0.1, x.shape).astype(
        np.float32) for x in leaves])
    return request.param, config, params, adapters


def _expected_layout(name):
    """``{tensor name: shape}`` worked out by hand from the tiny presets' dimensions."""
    r = RANK
    expected = {}

    def linear(layer, module, out, in_):
        expected[f"{PREFIX}.{layer}.{module}.lora_A.weight"] = (r, in_)
        expected[f"{PREFIX}.{layer}.{module}.lora_B.weight"] = (out, r)

    if name == "gemma4-tiny":  # D 128, 4 heads of 32 (64 global), 1 KV head, P 16
        for layer in range(10):
            key = 64 if layer in (4, 9) else 32
            ffw = 512 if layer < 5 else 1024  # layers 5-9 share keys: E2B's double-wide MLP
            linear(layer, "self_attn.q_proj", 4 * key, 128)
            linear(layer, "self_attn.o_proj", 128, 4 * key)
            if layer < 5:  # the sharing layers have no keys and values of their own
                linear(layer, "self_attn.k_proj", key, 128)
                linear(layer, "self_attn.v_proj", key, 128)
            linear(layer, "mlp.gate_proj", ffw, 128)
            linear(layer, "mlp.up_proj", ffw, 128)
            linear(layer, "mlp.down_proj", 128, ffw)
            linear(layer, "per_layer_input_gate", 16, 128)
            linear(layer, "per_layer_projection", 128, 16)
        return expected
    # MoE: D 128, 4 heads of 32, 2 KV heads; global layer 5: 64 wide, 1 KV head, k = v;
    # the dense MLP (gemma's mlp2, HF's mlp) 256 wide; 8 experts of 64.
    for layer in range(6):
        key, kv = (64, 1) if layer == 5 else (32, 2)
        linear(layer, "self_attn.q_proj", 4 * key, 128)
        linear(layer, "self_attn.o_proj", 128, 4 * key)
        linear(layer, "self_attn.k_proj", kv * key, 128)
        if layer != 5:
            linear(layer, "self_attn.v_proj", kv * key, 128)
        linear(layer, "mlp.gate_proj", 256, 128)
        linear(layer, "mlp.up_proj", 256, 128)
        linear(layer, "mlp.down_proj", 128, 256)
        gate_up, down = f"{PREFIX}.{layer}.experts.base_layer", f"{PREFIX}.{layer}.experts"
        expected[f"{gate_up}.lora_A.weight"] = (r * 8, 128)
        expected[f"{gate_up}.lora_B.weight"] = (2 * 64, r * 8)
        expected[f"{down}.lora_A.weight"] = (r * 8, 64)
        expected[f"{down}.lora_B.weight"] = (128, r * 8)
    return expected


def test_the_export_has_hf_gemma4_names_shapes_and_targets(tiny, tmp_path):
    name, config, _, adapters = tiny
    written = peft_adapters.export_peft(adapters, config, tmp_path, rank=RANK, alpha=ALPHA,
                                        base_model_name_or_path="google/gemma-4")
    layout = {n: tuple(shape) for n, shape, _ in
              safetensors_io.layout(tmp_path / written[1])}
    expected = _expected_layout(name)
    assert layout == expected, set(layout) ^ set(expected)
    adapter_config = json.loads((tmp_path / "adapter_config.json").read_text())
    linears = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    if name == "gemma4-tiny":
        assert adapter_config["target_modules"] == sorted(
            [*linears, "per_layer_input_gate", "per_layer_projection"])
        assert "target_parameters" not in adapter_config
    else:
        assert adapter_config["target_modules"] == linears
        assert adapter_config["target_parameters"] == ["experts.down_proj",
                                                       "experts.gate_up_proj"]
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (RANK, ALPHA)


def _delta(tensors, module_path):
    """``scale * B A`` of an exported adapter, per expert for the experts' ([E, out, in])."""
    a = tensors[f"{module_path}.lora_A.weight"]
    b = tensors[f"{module_path}.lora_B.weight"]
    if ".experts" not in module_path:
        return ALPHA / RANK * b @ a
    experts = a.shape[0] // RANK
    a_e = a.reshape(experts, RANK, -1)  # expert-major
    b_e = b.reshape(b.shape[0], RANK, experts)  # rank-major
    return ALPHA / RANK * np.einsum("ore,eri->eoi", b_e, a_e)


def test_the_exported_updates_are_the_merged_weights_updates(tiny):
    """HF's weight after merging minus before equals PEFT's update, for dense projections and
    for each expert (one checked alone, by its own slices of lora_A and lora_B)."""
    name, config, params, adapters = tiny
    merged = lora.merge(params, adapters, ALPHA / RANK)
    tensors = {t.name: t.values() for t in peft_adapters.peft_adapter_tensors(adapters)}

    def change(*path):
        before, after = params, merged
        for key in path:
            before, after = before[key], after[key]
        return np.asarray(after, np.float64) - np.asarray(before, np.float64)

    def check(got, want):
        # numpy's product against XLA's, and the merged weight's float32 rounding: float32 in
        # another order, at the update's scale (observed 1.1e-7 of it).
        assert_close_to_scale(got, want, REORDERED_FLOAT32)

    # Global layer's queries: q_einsum [N, D, H] is HF's q_proj [N H, D].
    glob = 9 if name == "gemma4-tiny" else 5
    q = change(f"layer_{glob}", "attn", "q_einsum", "w")
    check(_delta(tensors, f"{PREFIX}.{glob}.self_attn.q_proj"),
          q.transpose(0, 2, 1).reshape(-1, config.embed_dim))
    # The MLP's up half: gating [2, F, D], HF's up_proj [F, D]; its down projection [F, D].
    mlp = "mlp" if name == "gemma4-tiny" else "mlp2"
    check(_delta(tensors, f"{PREFIX}.0.mlp.up_proj"), change("layer_0", mlp, "gating_einsum")[1])
    check(_delta(tensors, f"{PREFIX}.0.mlp.down_proj"), change("layer_0", mlp, "linear").T)
    if name == "gemma4-tiny":
        gate = change("layer_2", "per_layer_input_gate", "w")  # [D, P], HF's [P, D]
        check(_delta(tensors, f"{PREFIX}.2.per_layer_input_gate"), gate.T)
        return
    # The global layer's keys, which are its values: k_einsum [K, D, H], HF's k_proj [K H, D].
    k = change("layer_5", "attn", "k_einsum", "w")
    check(_delta(tensors, f"{PREFIX}.5.self_attn.k_proj"),
          k.transpose(0, 2, 1).reshape(-1, config.embed_dim))
    # Experts: gate|up [E, 2, H, D] is HF's gate_up_proj [E, 2H, D]; down [E, H, D] is
    # down_proj [E, D, H].
    gate_up = change("layer_3", "mlp", "gating_einsum", "w")
    experts = gate_up.shape[0]
    check(_delta(tensors, f"{PREFIX}.3.experts.base_layer"), gate_up.reshape(experts, -1,
                                                                              config.embed_dim))
    check(_delta(tensors, f"{PREFIX}.3.experts"),
          change("layer_3", "mlp", "linear", "w").transpose(0, 2, 1))
    e = 6  # one expert alone: lora_A's rows e r .. e r + r, lora_B's columns j E + e
    a = tensors[f"{PREFIX}.3.experts.base_layer.lora_A.weight"][e * RANK:(e + 1) * RANK]
    b = tensors[f"{PREFIX}.3.experts.base_layer.lora_B.weight"][:, e::experts]
    check(ALPHA / RANK * b @ a, gate_up[e].reshape(-1, config.embed_dim))


def test_adapters_the_model_cannot_take_are_refused_in_one_line(tiny, tmp_path):
    name, config, _, adapters = tiny
    if name == "gemma4-tiny":  # keys and values for a layer that reads another's
        layer_7 = {**adapters["layer_7"], "attn": {**adapters["layer_7"]["attn"],
                                                   "kv_einsum": adapters["layer_3"]["attn"][
                                                       "kv_einsum"]}}
        bad, problem = {**adapters, "layer_7": layer_7}, (
            r"^lora_params: base_model\.model\.model\.layers\.7\.self_attn\.k_proj\.lora_A"
            r"\.weight: layer 7 of the model has no self_attn\.k_proj to adapt")
    else:  # one of the two expert weights alone
        mlp = {k: v for k, v in adapters["layer_0"]["mlp"].items() if k != "linear"}
        bad = {"layer_0": {"mlp": mlp}}
        problem = r"^lora_params: the experts' adapters hold experts\.gate_up_proj alone"
    with pytest.raises(ConfigError, match=problem):
        peft_adapters.export_peft(bad, config, tmp_path / "out", rank=RANK, alpha=ALPHA,
                                  base_model_name_or_path="")
