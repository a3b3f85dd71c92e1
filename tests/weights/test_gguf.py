"""llama.cpp GGUF files as a base (``gemmalab.weights.gguf``), on tiny files written here.

Quantized tensors are built byte by byte from ggml's block layouts (ggml-common.h), with values
on each type's grid (small integers times powers of two), so their dequantized values are known
exactly; ``gguf.quants.quantize`` (which has no K-quant quantizers) is checked separately against
each type's error bound on arbitrary values.
"""

import dataclasses
import math
import os

import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from gemmalab import plan
from gemmalab.errors import ConfigError
from gemmalab.weights import gguf, hf_layout, safetensors_io, sources
from tests.helpers.models import short_tiny
from tests.helpers.numerics import REORDERED_FLOAT32, assert_close_to_scale

Q = GGMLQuantizationType
VOCAB = 64
ROWS = 4  # a test tensor's HF [out, in]: 4 rows of 512, two K-quant super-blocks a row
COLS = 512


def tiny_config(num_layers: int = 1):
    """gemma3-tiny's shapes with ``num_layers`` layers and head_dim 16, so that no projection
    is square (a transposed q/k/v/o cannot pass for the right one)."""
    return dataclasses.replace(short_tiny(VOCAB, num_layers), head_dim=16)


def shape_metadata(config) -> dict[str, int]:
    """The ``gemma3.*`` keys llama.cpp's converter writes, for ``config``'s shape."""
    return {"block_count": config.num_layers, "embedding_length": config.embed_dim,
            "feed_forward_length": config.hidden_dim, "attention.head_count": config.num_heads,
            "attention.head_count_kv": config.num_kv_heads,
            "attention.key_length": config.head_dim,
            "attention.sliding_window": config.sliding_window_size}


# shape_metadata(tiny_config()), without importing gemma for the tests that need no model.
TINY_SHAPE = {"block_count": 1, "embedding_length": 128, "feed_forward_length": 512,
              "attention.head_count": 4, "attention.head_count_kv": 2,
              "attention.key_length": 16, "attention.sliding_window": 128}


def write_gguf(path, tensors, *, arch="gemma3", general_type="model", metadata=None,
               endianess=GGUFEndian.LITTLE, add_fields=None):
    """A GGUF file of ``tensors`` (llama.cpp name -> numpy array in HF order, or ``(raw bytes
    [rows, row bytes], quant type)``), with the 1-layer tiny shape's metadata and whatever
    ``add_fields(writer)`` adds."""
    writer = GGUFWriter(path, arch, endianess=endianess)
    writer.add_type(general_type)
    for key, value in {**TINY_SHAPE, **(metadata or {})}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    if add_fields:
        add_fields(writer)
    for name, value in tensors.items():
        array, raw_dtype = value if isinstance(value, tuple) else (value, None)
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def embedding(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(VOCAB, 128)).astype(np.float32)


def only_tensor(model: gguf.GGUFModel, name: str) -> gguf.GGUFTensor:
    (tensor,) = [t for t in model.tensors if t.name == name]
    return tensor


# ---------------------------------------------------------------------------------------------
# Blocks of each quant type, as ggml lays them out: (raw bytes [ROWS, row bytes], values).


def f16_bytes(values: np.ndarray) -> np.ndarray:
    """[n] -> [n, 2]: little-endian float16."""
    return np.asarray(values, "<f2").reshape(-1, 1).view(np.uint8)


def powers_of_two(rng, n: int) -> np.ndarray:
    return 2.0 ** -rng.integers(2, 7, n)  # exact in float16


def k_scales_bytes(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and mins (get_scale_min_k4, inverted)."""
    return np.concatenate([scales[:, :4] | (scales[:, 4:] >> 4) << 6,
                           mins[:, :4] | (mins[:, 4:] >> 4) << 6,
                           (scales[:, 4:] & 15) | (mins[:, 4:] & 15) << 4], axis=1)


def block_q8_0(rng):  # {f16 d; i8 qs[32]}: d * q
    n = ROWS * COLS // 32
    d, q = powers_of_two(rng, n), rng.integers(-128, 128, (n, 32))
    raw = np.concatenate([f16_bytes(d), q.astype(np.int8).view(np.uint8)], axis=1)
    return raw, d[:, None] * q


def block_q4_0(rng):  # {f16 d; u8 qs[16]}: element j in qs[j] low nibble, j + 16 in its high
    n = ROWS * COLS // 32
    d, u = powers_of_two(rng, n), rng.integers(0, 16, (n, 32))
    qs = u[:, :16] | u[:, 16:] << 4
    return np.concatenate([f16_bytes(d), qs], axis=1).astype(np.uint8), d[:, None] * (u - 8)


def block_q5_0(rng):  # {f16 d; u32 qh; u8 qs[16]}: bit j of qh is element j's fifth bit
    n = ROWS * COLS // 32
    d, u = powers_of_two(rng, n), rng.integers(0, 32, (n, 32))
    qs = (u[:, :16] & 15) | (u[:, 16:] & 15) << 4
    qh = ((u >> 4 & 1) << np.arange(32)).sum(axis=1).astype("<u4").reshape(-1, 1).view(np.uint8)
    raw = np.concatenate([f16_bytes(d), qh, qs.astype(np.uint8)], axis=1)
    return raw, d[:, None] * (u - 16)


def k_quant_min_values(rng, n: int, bits: int):
    """Q4_K/Q5_K: per super-block d and dmin, per 32 values a 6-bit scale and min."""
    d, dmin = powers_of_two(rng, n), powers_of_two(rng, n)
    scales, mins = rng.integers(0, 64, (n, 8)), rng.integers(0, 64, (n, 8))
    u = rng.integers(0, 2**bits, (n, 8, 32))
    values = (d[:, None, None] * scales[..., None] * u - dmin[:, None, None] * mins[..., None])
    head = np.concatenate([f16_bytes(d), f16_bytes(dmin), k_scales_bytes(scales, mins)], axis=1)
    return head, u, values.reshape(n, 256)


def low_nibbles_k(u: np.ndarray) -> np.ndarray:
    """qs[128] of Q4_K/Q5_K: 64 values at a time, the first 32 low nibbles, the next high."""
    pairs = (u & 15).reshape(len(u), 4, 2, 32)
    return (pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(len(u), 128)


def block_q4_k(rng):  # {f16 d, dmin; u8 scales[12]; u8 qs[128]}
    head, u, values = k_quant_min_values(rng, ROWS * COLS // 256, 4)
    return np.concatenate([head, low_nibbles_k(u)], axis=1).astype(np.uint8), values


def block_q5_k(rng):  # {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}
    head, u, values = k_quant_min_values(rng, ROWS * COLS // 256, 5)
    qh = ((u >> 4 & 1) << np.arange(8)[:, None]).sum(axis=1)  # bit s: value 32 s + l's fifth
    raw = np.concatenate([head, qh, low_nibbles_k(u)], axis=1)
    return raw.astype(np.uint8), values


def block_q6_k(rng):  # {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}: d * scale[e // 16] * q
    n = ROWS * COLS // 256
    d, scales = powers_of_two(rng, n), rng.integers(-128, 128, (n, 16))
    u = rng.integers(0, 64, (n, 2, 4, 32))  # per 128 values: 4 quarters of 32
    low = u & 15
    ql = np.concatenate([low[:, :, 0] | low[:, :, 2] << 4, low[:, :, 1] | low[:, :, 3] << 4],
                        axis=2).reshape(n, 128)
    qh = ((u >> 4 & 3) << (2 * np.arange(4))[:, None]).sum(axis=2).reshape(n, 64)
    raw = np.concatenate([ql, qh, scales.astype(np.int8).view(np.uint8), f16_bytes(d)], axis=1)
    values = d[:, None] * np.repeat(scales, 16, axis=1) * (u.reshape(n, 256) - 32)
    return raw.astype(np.uint8), values


def block_f32(rng):
    values = rng.normal(size=(ROWS, COLS)).astype(np.float32)
    return values, values


def block_f16(rng):
    values = rng.normal(size=(ROWS, COLS)).astype(np.float16)
    return values, values


def block_bf16(rng):  # the top half of float32s that bfloat16 holds exactly
    values = rng.normal(size=(ROWS, COLS)).astype(ml_dtypes.bfloat16).astype(np.float32)
    raw = (values.view(np.uint32) >> 16).astype("<u2").view(np.uint8)
    return raw, values


KNOWN_VALUES = {"F32": block_f32, "F16": block_f16, "BF16": block_bf16, "Q8_0": block_q8_0,
                "Q4_0": block_q4_0, "Q5_0": block_q5_0, "Q4_K": block_q4_k, "Q5_K": block_q5_k,
                "Q6_K": block_q6_k}


@pytest.mark.parametrize("quant", list(KNOWN_VALUES))
def test_dequantized_gives_known_values_in_hf_layout(tmp_path, quant):
    # Tolerance 0 for every type: each value is a float32/16 as written, or a small integer
    # (< 2^12) times a power of two (scales that float16 holds exactly), so any IEEE 754
    # arithmetic dequantizes it exactly.
    raw, values = KNOWN_VALUES[quant](np.random.default_rng(list(KNOWN_VALUES).index(quant)))
    values = values.reshape(ROWS, COLS)
    tensor = raw if raw.dtype != np.uint8 else (raw.reshape(ROWS, -1), Q[quant])
    path = write_gguf(tmp_path / "model.gguf", {"token_embd.weight": embedding(),
                                                "blk.0.ffn_down.weight": tensor})

    model = gguf.inspect(path)
    down = only_tensor(model, "blk.0.ffn_down.weight")
    assert (down.hf_name, down.shape, down.quant_type) == (
        "model.layers.0.mlp.down_proj.weight", (ROWS, COLS), quant)
    assert model.quant_types == ({"F32": 2} if quant == "F32" else {"F32": 1, quant: 1})
    out = gguf.dequantized(down)
    assert out.dtype == np.float32 and out.shape == (ROWS, COLS)
    np.testing.assert_allclose(out, values, rtol=0, atol=0)


# Error bounds of gguf's own quantizers, as a converter would use them, per element of a block of
# 32 with largest magnitude amax: F16/BF16 round to nearest (half an ulp: 2^-11 / 2^-8 relative);
# Q8_0 rounds x / d to nearest with d = amax / 127 (d/2, plus 127 d 2^-11 from d in float16);
# Q4_0 and Q5_0 round with d = amax / 8 and / 16, except the top of the range, clipped a whole
# step (d, plus 16 d 2^-11 from d in float16). Plus half float16's subnormal step, 2^-25.
QUANTIZER_BOUNDS = {"F16": (2**-11, 0.0), "BF16": (2**-8, 0.0), "Q8_0": (0.0, 0.57 / 127),
                    "Q4_0": (0.0, 1.01 / 8), "Q5_0": (0.0, 1.01 / 16)}


@pytest.mark.parametrize("quant", list(QUANTIZER_BOUNDS))
def test_dequantized_quantizer_output_within_the_types_error_bound(tmp_path, quant):
    values = np.random.default_rng(3).normal(size=(ROWS, COLS)).astype(np.float32)
    stored = quantize(values, Q[quant])
    tensor = stored if stored.dtype != np.uint8 else (stored, Q[quant])
    path = write_gguf(tmp_path / "model.gguf", {"token_embd.weight": embedding(),
                                                "blk.0.ffn_up.weight": tensor})

    out = gguf.dequantized(only_tensor(gguf.inspect(path), "blk.0.ffn_up.weight"))
    relative, per_amax = QUANTIZER_BOUNDS[quant]
    amax = np.abs(values.reshape(ROWS, -1, 32)).max(axis=2, keepdims=True)
    per_block = np.broadcast_to(per_amax * amax, (ROWS, COLS // 32, 32)).reshape(ROWS, COLS)
    bound = relative * np.abs(values) + per_block + 2**-25
    error = np.abs(out - values)
    assert out.shape == (ROWS, COLS)
    assert np.all(error <= bound), float((error - bound).max())
    assert error.max() > 0  # arbitrary values: quantized for real, not stored as they are


def test_norm_weights_come_back_minus_one(tmp_path):
    # llama.cpp stores Gemma's RMSNorm w as w + 1; multiples of 1/64 keep both exact.
    w = np.random.default_rng(1).integers(-64, 64, 128) / 64
    path = write_gguf(tmp_path / "model.gguf", {
        "token_embd.weight": embedding(), "blk.0.attn_norm.weight": (w + 1).astype(np.float32),
        "blk.0.attn_q_norm.weight": np.full(16, 1.5, np.float32),
        "output_norm.weight": (w + 1).astype(np.float32)})

    model = gguf.inspect(path)
    for name in ("blk.0.attn_norm.weight", "output_norm.weight"):
        np.testing.assert_array_equal(gguf.dequantized(only_tensor(model, name)), w)
    np.testing.assert_array_equal(gguf.dequantized(only_tensor(model, "blk.0.attn_q_norm.weight")),
                                  np.full(16, 0.5))
    np.testing.assert_array_equal(gguf.dequantized(only_tensor(model, "token_embd.weight")),
                                  embedding())  # not a norm: as stored


# ---------------------------------------------------------------------------------------------
# A complete 1-layer model.


def hf_weights(config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of a 1-layer Gemma 3 under HF's names and [out, in] shapes."""
    rng = np.random.default_rng(seed)
    embed, heads, kv, head_dim, hidden = (config.embed_dim, config.num_heads, config.num_kv_heads,
                                          config.head_dim, config.hidden_dim)
    shapes = {
        "model.embed_tokens.weight": (config.num_embed, embed), "model.norm.weight": (embed,),
        "model.layers.0.self_attn.q_proj.weight": (heads * head_dim, embed),
        "model.layers.0.self_attn.k_proj.weight": (kv * head_dim, embed),
        "model.layers.0.self_attn.v_proj.weight": (kv * head_dim, embed),
        "model.layers.0.self_attn.o_proj.weight": (embed, heads * head_dim),
        "model.layers.0.self_attn.q_norm.weight": (head_dim,),
        "model.layers.0.self_attn.k_norm.weight": (head_dim,),
        "model.layers.0.input_layernorm.weight": (embed,),
        "model.layers.0.post_attention_layernorm.weight": (embed,),
        "model.layers.0.pre_feedforward_layernorm.weight": (embed,),
        "model.layers.0.post_feedforward_layernorm.weight": (embed,),
        "model.layers.0.mlp.gate_proj.weight": (hidden, embed),
        "model.layers.0.mlp.up_proj.weight": (hidden, embed),
        "model.layers.0.mlp.down_proj.weight": (embed, hidden),
    }
    # Norms on a 1/64 grid: w + 1 (as llama.cpp stores them) and back stay exact.
    return {name: (rng.integers(-64, 64, shape) / 64 if len(shape) == 1 else
                   rng.normal(size=shape)).astype(np.float32) for name, shape in shapes.items()}


LLAMA_CPP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    **{f"blk.0.{ours}.weight": f"model.layers.0.{hf}.weight" for ours, hf in (
        ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
        ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
        ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
        ("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
        ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"),
        ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"))},
}


def write_model_gguf(path, config, weights, metadata=None):
    """``weights`` (HF names) as llama.cpp writes them: its names, norms plus one."""
    return write_gguf(path, {name: weights[hf] + 1 if name.endswith("norm.weight") else weights[hf]
                             for name, hf in LLAMA_CPP_NAMES.items()},
                      metadata={**shape_metadata(config), **(metadata or {})})


@pytest.fixture
def tiny_model(tmp_path):
    config = tiny_config()
    weights = hf_weights(config)
    return config, weights, gguf.inspect(write_model_gguf(tmp_path / "tiny.gguf", config, weights))


def test_inspect_maps_llama_cpp_names_to_hugging_face(tiny_model):
    config, weights, model = tiny_model
    assert {t.name: t.hf_name for t in model.tensors} == LLAMA_CPP_NAMES
    assert {t.hf_name: t.shape for t in model.tensors} == {n: w.shape for n, w in weights.items()}
    assert {t.hf_name for t in model.tensors if t.is_norm} == {
        n for n in weights if n.endswith(("norm.weight", "layernorm.weight"))}
    assert model.vocab_size == VOCAB
    assert model.quant_types == {"F32": len(LLAMA_CPP_NAMES)}
    assert model.metadata["block_count"] == 1
    assert model.shape_fields() == {
        "num_layers": 1, "embed_dim": 128, "hidden_dim": 512, "num_heads": 4, "num_kv_heads": 2,
        "head_dim": 16, "sliding_window_size": 128, "num_embed": VOCAB}
    for tensor in model.tensors:
        np.testing.assert_array_equal(gguf.dequantized(tensor), weights[tensor.hf_name])


def test_convert_writes_dequantized_tensors_then_reuses_them(tiny_model, tmp_path, monkeypatch):
    _, weights, model = tiny_model
    cache = tmp_path / "cache"
    converted = gguf.convert(model, cache, "float32", workers=2, progress=False)
    assert converted.name == safetensors_io.SINGLE_FILE and converted.is_relative_to(cache)
    tensors = safetensors_io.read_file(converted)
    assert set(tensors) == set(weights)
    for tensor in model.tensors:
        assert tensors[tensor.hf_name].dtype == np.float32
        np.testing.assert_array_equal(tensors[tensor.hf_name], gguf.dequantized(tensor))
    assert not list(converted.parent.glob("*.tmp*"))

    written = converted.stat().st_mtime_ns

    def no_second_conversion(tensor, *rows):
        raise AssertionError(f"{tensor.name} dequantized again")

    monkeypatch.setattr(gguf, "dequantized", no_second_conversion)
    monkeypatch.setattr(gguf, "dequantized_rows", no_second_conversion)
    assert gguf.convert(model, cache, "float32", progress=False) == converted
    assert converted.stat().st_mtime_ns == written
    monkeypatch.undo()

    halves = gguf.convert(model, cache, "bfloat16", progress=False)
    assert halves != converted
    for name, values in safetensors_io.read_file(halves).items():
        assert values.dtype == ml_dtypes.bfloat16
        # bfloat16 keeps 8 significant bits: half an ulp is 2^-8 of the value.
        np.testing.assert_allclose(values.astype(np.float32), weights[name], rtol=2**-8, atol=0)

    with pytest.raises(ConfigError, match=r"^param_dtype: unknown dtype 'float16'"):
        gguf.convert(model, cache, "float16", progress=False)


def test_convert_of_a_changed_file_converts_again(tmp_path):
    config, cache = tiny_config(), tmp_path / "cache"
    path = write_model_gguf(tmp_path / "tiny.gguf", config, hf_weights(config, seed=0))
    first = gguf.convert(gguf.inspect(path), cache, progress=False)
    changed = hf_weights(config, seed=1)
    write_model_gguf(path, config, changed)  # same path and size, other values
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))

    second = gguf.convert(gguf.inspect(path), cache, progress=False)
    assert second != first
    np.testing.assert_array_equal(safetensors_io.read_file(second)["model.norm.weight"],
                                  changed["model.norm.weight"])


def test_converted_gguf_loads_into_gemmas_layout(tiny_model, tmp_path):
    config, weights, model = tiny_model
    converted = gguf.convert(model, tmp_path / "cache", "float32", progress=False)
    params = hf_layout.load_hf_params(converted.parent, plan.abstract_params(config, "float32"))
    layer = params["layer_0"]
    hf = {name.removeprefix("model.layers.0.").removesuffix(".weight"): np.asarray(w)
          for name, w in weights.items()}
    heads, kv, head_dim = config.num_heads, config.num_kv_heads, config.head_dim

    np.testing.assert_array_equal(params["embedder"]["input_embedding"],
                                  hf["model.embed_tokens"])
    np.testing.assert_array_equal(params["final_norm"]["scale"], hf["model.norm"])
    np.testing.assert_array_equal(layer["pre_attention_norm"]["scale"], hf["input_layernorm"])
    np.testing.assert_array_equal(layer["attn"]["_query_norm"]["scale"], hf["self_attn.q_norm"])
    np.testing.assert_array_equal(layer["mlp"]["gating_einsum"],
                                  np.stack([hf["mlp.gate_proj"], hf["mlp.up_proj"]]))
    np.testing.assert_array_equal(layer["mlp"]["linear"], hf["mlp.down_proj"].T)
    # The projections compute what HF's Linear layers compute (x @ W.T, heads head-major).
    # Tolerance: float32 sums of 64..512 products, in another order (numpy's einsum or BLAS,
    # whose kernels depend on the CPU), at each output's scale.
    rel = REORDERED_FLOAT32
    x = np.random.default_rng(2).normal(size=(3, config.embed_dim)).astype(np.float32)
    q = np.einsum("td,ndh->tnh", x, np.asarray(layer["attn"]["q_einsum"]["w"]))
    assert_close_to_scale(q, (x @ hf["self_attn.q_proj"].T).reshape(3, heads, head_dim), rel)
    k, v = np.einsum("td,cndh->ctnh", x, np.asarray(layer["attn"]["kv_einsum"]["w"]))
    assert_close_to_scale(k, (x @ hf["self_attn.k_proj"].T).reshape(3, kv, head_dim), rel)
    assert_close_to_scale(v, (x @ hf["self_attn.v_proj"].T).reshape(3, kv, head_dim), rel)
    o = np.einsum("tnh,nhd->td", q, np.asarray(layer["attn"]["attn_vec_einsum"]["w"]))
    assert_close_to_scale(o, q.reshape(3, -1) @ hf["self_attn.o_proj"].T, rel)


# ---------------------------------------------------------------------------------------------
# The conversion in blocks of rows, bit for bit against gguf.quants.dequantize of whole tensors.

# Where each block layout (ggml-common.h) keeps its float16 scales (d, and dmin or m): bytes
# (block size in bytes, offsets). The rest of a block is any bytes: quant indices, packed scales.
F16_FIELDS = {"Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q5_0": (22, (0,)),
              "Q5_1": (24, (0, 2)), "Q8_0": (34, (0,)), "Q2_K": (84, (80, 82)),
              "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
              "Q6_K": (210, (208,))}
ODD_ROWS = 7  # in blocks of 2 rows: (0, 2), (2, 4), (4, 6), (6, 7)
BLOCK_VALUES = 2 * COLS + 100


def random_blocks(rng, quant: str, rows: int = ODD_ROWS, cols: int = COLS) -> np.ndarray:
    """[rows, row bytes] of random bytes in ``quant``'s blocks, with finite float16 scales (so
    that every value is a number, compared by its bits)."""
    from gguf import GGML_QUANT_SIZES

    type_size, offsets = F16_FIELDS[quant]
    block_size, expected_size = GGML_QUANT_SIZES[Q[quant]]
    assert type_size == expected_size
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in offsets:
        blocks[:, offset:offset + 2] = f16_bytes(rng.uniform(-2, 2, len(blocks)) / 8)
    return blocks.reshape(rows, -1)


def bit_for_bit_tensors() -> dict:
    """llama.cpp name -> (what the GGUF stores, its gguf.quants type): random blocks of every
    supported type, gguf.quants.quantize's output for each type it quantizes, a norm."""
    rng = np.random.default_rng(5)
    floats = rng.normal(size=(ODD_ROWS, COLS)).astype(np.float32)
    stored = {"F32": floats, "F16": floats.astype(np.float16),
              "BF16": quantize(floats, Q.BF16),
              **{quant: random_blocks(rng, quant) for quant in F16_FIELDS}}
    assert set(stored) == set(gguf.SUPPORTED_TYPES)
    tensors = {f"blk.{i}.ffn_up.weight": (raw, quant) for i, (quant, raw) in
               enumerate(stored.items())}
    for i, quant in enumerate(("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")):
        tensors[f"blk.{i}.ffn_gate.weight"] = (quantize(rng.normal(size=(ODD_ROWS, COLS))
                                                        .astype(np.float32), Q[quant]), quant)
    tensors["blk.0.attn_norm.weight"] = (np.float32(1) + floats[0], "F32")
    return {"token_embd.weight": (embedding(), "F32"), **tensors}


def reference(stored: np.ndarray, quant: str, name: str) -> np.ndarray:
    """gguf.quants.dequantize of the whole tensor, in float32 (a norm: minus one)."""
    from gguf.quants import dequantize

    values = np.asarray(dequantize(stored, Q[quant]), np.float32)
    return values - np.float32(1) if name.endswith("norm.weight") else values


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}"))


@pytest.mark.parametrize("workers", [1, 3])
def test_convert_in_row_blocks_is_gguf_quants_bit_for_bit(tmp_path, workers):
    stored = bit_for_bit_tensors()
    path = write_gguf(tmp_path / "model.gguf", {
        name: raw if raw.dtype != np.uint8 else (raw, Q[quant])
        for name, (raw, quant) in stored.items()})
    model = gguf.inspect(path)
    up = only_tensor(model, "blk.0.ffn_up.weight")
    assert gguf.row_blocks(up, BLOCK_VALUES) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert gguf.row_blocks(only_tensor(model, "blk.0.attn_norm.weight"), BLOCK_VALUES) == [(0, 1)]
    assert set(model.quant_types) == set(gguf.SUPPORTED_TYPES)

    for dtype in ("float32", "bfloat16"):
        timings: dict = {}
        converted = gguf.convert(model, tmp_path / "cache", dtype, workers=workers,
                                 block_values=BLOCK_VALUES, progress=False, timings=timings)
        out = safetensors_io.read_file(converted)
        assert len(out) == len(model.tensors)
        for tensor in model.tensors:
            raw, quant = stored[tensor.name]
            assert tensor.quant_type == quant
            expected = reference(raw, quant, tensor.name).reshape(tensor.shape)
            if dtype == "bfloat16":
                expected = expected.astype(ml_dtypes.bfloat16)
            assert same_bits(out[tensor.hf_name], expected), (tensor.name, quant, dtype)
        assert timings["workers"] == workers and timings["values"] == sum(
            math.prod(t.shape) for t in model.tensors)
        assert timings["bytes"] == converted.stat().st_size - 8 - len(json_header(converted))
        assert set(timings) == {"hash_s", "layout_s", "convert_s", *gguf.PHASES, "values",
                                "bytes", "workers"}
        assert all(timings[phase] > 0 for phase in gguf.PHASES)
        # Each block's steps are timed inside the workers' wall time: summed over the blocks,
        # at most that time per worker.
        assert sum(timings[phase] for phase in gguf.PHASES) <= timings["convert_s"] * workers


def json_header(path) -> bytes:
    with open(path, "rb") as f:
        return f.read(8 + int.from_bytes(f.read(8), "little"))[8:]


def test_a_failed_conversion_leaves_no_file(tmp_path, monkeypatch):
    model = gguf.inspect(write_gguf(tmp_path / "model.gguf", {
        "token_embd.weight": embedding(), "output_norm.weight": np.ones(128, np.float32)}))
    real = gguf.dequantized_rows

    def fails_on_the_embedding(tensor, start, stop):
        if tensor.name == "token_embd.weight":
            raise MemoryError("no room")
        return real(tensor, start, stop)

    monkeypatch.setattr(gguf, "dequantized_rows", fails_on_the_embedding)
    with pytest.raises(MemoryError):
        gguf.convert(model, tmp_path / "cache", workers=2, progress=False)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()
                and p.name != "sha256.json"]


@pytest.mark.slow
def test_the_embedded_files_tensors_convert_bit_for_bit(cache_dir, tmp_path):
    # Every quant type of the real file (F32, Q5_0, Q4_K, Q8_0, Q6_K), its 262144 x 640 Q8_0
    # token embedding in uneven blocks of 300 rows, three workers.
    from gemmalab.weights import embedded

    model = gguf.inspect(embedded.gguf_path("embedded:gemma3-270m", cache_dir))
    assert set(model.quant_types) == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}
    block_values = 300 * 640 + 1
    embedding_rows = gguf.row_blocks(only_tensor(model, "token_embd.weight"), block_values)
    assert len(embedding_rows) == 874 and embedding_rows[-1] == (261900, 262144)
    out = safetensors_io.read_file(gguf.convert(model, tmp_path / "cache", "float32", workers=3,
                                                block_values=block_values, progress=False))
    for tensor in model.tensors:
        assert same_bits(out[tensor.hf_name], gguf.dequantized(tensor)), tensor.name


# ---------------------------------------------------------------------------------------------
# The header reader, against gguf's own GGUFReader.


def every_kind_of_field(writer):
    """One field of each GGUF value type, and arrays of numbers, strings and booleans."""
    for add, value in ((writer.add_uint8, 200), (writer.add_int8, -100),
                       (writer.add_uint16, 60_000), (writer.add_int16, -30_000),
                       (writer.add_uint32, 4_000_000_000), (writer.add_int32, -2_000_000_000),
                       (writer.add_float32, 0.25), (writer.add_uint64, 2**40 + 1),
                       (writer.add_int64, -(2**40)), (writer.add_float64, 1 / 3),
                       (writer.add_bool, True), (writer.add_string, "h\u00e9llo \u2581w")):
        add(f"test.{add.__name__.removeprefix('add_')}", value)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.5])
    writer.add_array("test.strings", ["a", "\u2581b", "<start_of_turn>"])
    writer.add_array("test.bools", [True, False])
    writer.add_key_value("test.uint64s", [1, 2**40], GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.UINT64)


def tensors_of_every_layout() -> dict:
    """Float tensors of 1-3 axes, an integer one, and raw blocks of quant types and BF16."""
    rng = np.random.default_rng(4)
    q8_0, _ = block_q8_0(rng)
    q4_k, _ = block_q4_k(rng)
    bf16, _ = block_bf16(rng)
    return {"token_embd.weight": embedding(),
            "blk.0.attn_norm.weight": np.arange(128, dtype=np.float32),
            "f16": rng.normal(size=(3, 64)).astype(np.float16),
            "f32_3d": rng.normal(size=(2, 3, 32)).astype(np.float32),
            "i32": np.arange(-5, 5, dtype=np.int32),
            "q8_0": (q8_0.reshape(ROWS, -1), Q.Q8_0), "q4_k": (q4_k.reshape(ROWS, -1), Q.Q4_K),
            "bf16": (bf16.reshape(ROWS, -1), Q.BF16)}


def as_lists(value):
    return [as_lists(v) for v in value] if isinstance(value, tuple) else value


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["le", "be"])
@pytest.mark.parametrize("alignment", [32, 64])
def test_read_header_reads_what_gguf_reader_reads(tmp_path, endianess, alignment):
    def add_fields(writer):
        every_kind_of_field(writer)
        if alignment != 32:
            writer.add_custom_alignment(alignment)

    path = write_gguf(tmp_path / "model.gguf", tensors_of_every_layout(), endianess=endianess,
                      add_fields=add_fields)
    header, reader = gguf.read_header(path), GGUFReader(path)

    assert (header.version, header.byte_order) == (3, "<" if endianess == GGUFEndian.LITTLE
                                                   else ">")
    assert (header.alignment, header.data_start) == (alignment, reader.data_offset)
    assert header.data_start % alignment == 0 and header.file_size == path.stat().st_size
    assert set(header.fields) == {key for key in reader.fields if not key.startswith("GGUF.")}
    assert {key for key in header.fields if key.startswith("test.")} == {
        "test.uint8", "test.int8", "test.uint16", "test.int16", "test.uint32", "test.int32",
        "test.float32", "test.uint64", "test.int64", "test.float64", "test.bool", "test.string",
        "test.ints", "test.floats", "test.strings", "test.bools", "test.uint64s"}
    for key, value in header.fields.items():
        expected = reader.fields[key].contents()
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(value, np.asarray(expected), err_msg=key)
        else:
            assert as_lists(value) == expected, key

    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert ours.dims == tuple(int(n) for n in theirs.shape), ours.name  # ggml's order
        assert ours.n_dims == len(theirs.shape)
        assert ours.ggml_type == theirs.tensor_type
        assert (ours.n_elements, ours.n_bytes) == (theirs.n_elements, theirs.n_bytes)
        assert header.data_start + ours.offset == theirs.data_offset
        assert ours.offset % alignment == 0
        data = header.tensor_data(ours)
        assert (data.dtype, data.shape) == (theirs.data.dtype, theirs.data.shape), ours.name
        assert data.tobytes() == theirs.data.tobytes(), ours.name
        assert np.shares_memory(data, np.frombuffer(header.buffer, np.uint8))  # not copied


def test_a_big_endian_file_dequantizes_as_written(tmp_path):
    values = {"token_embd.weight": embedding(), "output_norm.weight": np.full(128, 1.5, np.float32),
              "blk.0.ffn_up.weight": np.linspace(-2, 2, 512 * 128).astype(np.float16)
              .reshape(512, 128)}
    model = gguf.inspect(write_gguf(tmp_path / "model.gguf", values, endianess=GGUFEndian.BIG))
    for name, expected in values.items():
        tensor = only_tensor(model, name)
        out = gguf.dequantized(tensor)
        np.testing.assert_array_equal(out, expected - 1 if name.endswith("norm.weight")
                                      else expected.astype(np.float32), err_msg=name)
        rows = gguf.row_count(tensor)
        np.testing.assert_array_equal(gguf.dequantized_rows(tensor, 1, rows),
                                      out.reshape(rows, -1)[1:], err_msg=name)


def test_read_header_parses_a_file_once_until_it_changes(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", {"token_embd.weight": embedding()})
    header = gguf.read_header(path)
    assert gguf.read_header(path) is header
    mapped = np.frombuffer(header.buffer, np.uint8)
    assert np.shares_memory(gguf.inspect(path).tensors[0].data, mapped)  # inspect reads it too
    with pytest.raises(TypeError):
        header.fields["general.type"] = "changed"  # shared by every caller: read-only

    write_gguf(path, {"token_embd.weight": embedding()}, metadata={"block_count": 2})
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed = gguf.read_header(path)
    assert changed is not header and changed.field("gemma3.block_count") == 2


# ---------------------------------------------------------------------------------------------
# The file against the model's shape.


def test_check_fits_accepts_the_files_shape_and_names_the_preset_that_fits(tmp_path):
    one, two = tiny_config(1), tiny_config(2)
    assert shape_metadata(one) == TINY_SHAPE
    fitting = gguf.inspect(write_gguf(tmp_path / "one.gguf", {"token_embd.weight": embedding()}))
    gguf.check_fits(fitting, one, "one-layer", {"two-layer": two})

    model = gguf.inspect(write_gguf(tmp_path / "two.gguf", {"token_embd.weight": embedding()},
                                    metadata={"block_count": 2}))
    with pytest.raises(ConfigError) as error:
        gguf.check_fits(model, one, "one-layer", {"one-layer": one, "two-layer": two})
    message = str(error.value)
    assert message.startswith("model: 'one-layer' does not fit the GGUF at ")
    assert "num_layers 2 (model: 1)" in message and "\n" not in message
    assert message.endswith("Fix: use model='two-layer'")
    assert "embed_dim" not in message  # only the fields that differ

    with pytest.raises(ConfigError, match="num_layers 2 .*Fix: give the GGUF of a Gemma 3 size"):
        gguf.check_fits(model, one, "one-layer", {"one-layer": one})


# ---------------------------------------------------------------------------------------------
# Files that cannot be a base: one line naming checkpoint, from inspect.


def assert_checkpoint_error(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert isinstance(error.value, ConfigError) and error.value.parameter == "checkpoint"
    assert message.startswith("checkpoint: ") and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_another_architecture_is_refused(tmp_path):
    path = write_gguf(tmp_path / "llama.gguf", {"token_embd.weight": embedding()}, arch="llama")
    with pytest.raises(ConfigError) as error:
        gguf.inspect(path)
    assert_checkpoint_error(error, "holds a llama model, not Gemma 3")


@pytest.mark.parametrize("arch, general_type", [("clip", "mmproj"), ("clip", "model"),
                                                ("gemma3", "mmproj")])
def test_a_vision_projector_is_refused(tmp_path, arch, general_type):
    path = write_gguf(tmp_path / "mmproj.gguf", {"token_embd.weight": embedding()}, arch=arch,
                      general_type=general_type)
    with pytest.raises(ConfigError) as error:
        gguf.inspect(path)
    assert_checkpoint_error(error, "vision projector (mmproj)", "text model's .gguf")


@pytest.mark.parametrize("cut, expected", [
    ("in the last tensor", "is truncated: tensor token_embd.weight ends past the file's"),
    ("where the data starts", "is truncated: tensor token_embd.weight ends past the file's"),
    ("in the header", "is not a readable GGUF file, or it is truncated"),
])
def test_a_truncated_file_is_refused(tmp_path, cut, expected):
    path = write_gguf(tmp_path / "model.gguf", {"token_embd.weight": embedding()})
    sizes = {"in the last tensor": path.stat().st_size - embedding().nbytes // 2,
             "where the data starts": gguf.read_header(path).data_start, "in the header": 40}
    os.truncate(path, sizes[cut])
    with pytest.raises(ConfigError) as error:
        gguf.inspect(path)
    assert_checkpoint_error(error, expected, "again")


def set_alignment_48(writer):  # the writer still aligns to 32; the key is what is wrong
    writer.add_uint32("general.alignment", 48)


def set_alignment_as_uint64(writer):
    writer.add_uint64("general.alignment", 64)


@pytest.mark.parametrize("add_fields, problem", [
    (set_alignment_48, "general.alignment 48 is not a uint32 power of two"),
    (set_alignment_as_uint64, "general.alignment 64 is not a uint32 power of two"),
])
def test_a_bad_alignment_is_refused(tmp_path, add_fields, problem):
    path = write_gguf(tmp_path / "model.gguf", {"token_embd.weight": embedding()},
                      add_fields=add_fields)
    with pytest.raises(ConfigError) as error:
        gguf.inspect(path)
    assert_checkpoint_error(error, "is not a readable GGUF file", problem)


def test_a_gguf_v1_file_is_refused(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", {"token_embd.weight": embedding()})
    with open(path, "r+b") as file:
        file.seek(4)
        file.write((1).to_bytes(4, "little"))
    with pytest.raises(ConfigError) as error:
        gguf.inspect(path)
    assert_checkpoint_error(error, "GGUF version 1; versions 2 and 3 are supported")


@pytest.mark.parametrize("quant", ["IQ2_XXS", "TQ1_0"])
def test_an_unsupported_quant_type_is_refused(tmp_path, quant):
    from gguf import GGML_QUANT_SIZES

    block_size, type_size = GGML_QUANT_SIZES[Q[quant]]
    raw = np.zeros((ROWS, COLS // block_size * type_size), np.uint8)
    path = write_gguf(tmp_path / "model.gguf", {"token_embd.weight": embedding(),
                                                "blk.0.ffn_up.weight": (raw, Q[quant])})
    with pytest.raises(ConfigError) as error:
        gguf.inspect(path)
    assert_checkpoint_error(error, f"blk.0.ffn_up.weight is {quant}", "Q4_K_M")


def test_a_tensor_outside_the_text_model_is_refused(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", {"token_embd.weight": embedding(),
                                                "v.blk.0.attn_q.weight": embedding()})
    with pytest.raises(ConfigError) as error:
        gguf.inspect(path)
    assert_checkpoint_error(error, "v.blk.0.attn_q.weight is not part of a Gemma 3 text model")


def test_a_file_without_token_embedding_is_refused(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", {"output_norm.weight": np.ones(128, np.float32)})
    with pytest.raises(ConfigError) as error:
        gguf.inspect(path)
    assert_checkpoint_error(error, "no token_embd.weight")


def test_a_missing_or_non_gguf_file_is_refused(tmp_path):
    with pytest.raises(ConfigError) as error:
        gguf.inspect(tmp_path / "absent.gguf")
    assert_checkpoint_error(error, "no GGUF file at", "absent.gguf")

    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, say" * 16)
    assert not gguf.is_gguf(not_gguf)
    with pytest.raises(ConfigError) as error:
        gguf.read_header(not_gguf)
    assert_checkpoint_error(error, "is not a readable GGUF file", "no GGUF magic number")
    with pytest.raises(ConfigError) as error:
        gguf.inspect(not_gguf)
    assert_checkpoint_error(error, "is not a readable GGUF file")


# ---------------------------------------------------------------------------------------------
# Through the checkpoint parameter.


def test_resolve_refuses_a_llama_gguf_in_one_line(tmp_path):
    path = write_gguf(tmp_path / "llama.gguf", {"token_embd.weight": embedding()}, arch="llama")
    with pytest.raises(ConfigError) as error:
        sources.resolve(str(path), "gemma3-270m", tmp_path / "cache")
    assert_checkpoint_error(error, "holds a llama model")


def test_resolve_refuses_a_file_that_is_not_a_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ConfigError) as error:
        sources.resolve(str(path), "gemma3-270m", tmp_path / "cache")
    assert_checkpoint_error(error, "is a file but not a GGUF model")
    with pytest.raises(ConfigError) as error:
        sources.resolve(str(tmp_path / "absent.gguf"), "gemma3-270m", tmp_path / "cache")
    assert_checkpoint_error(error, "no GGUF file at")


def test_resolve_names_model_for_a_gguf_of_another_size(tiny_model, tmp_path):
    path = tiny_model[2].path
    with pytest.raises(ConfigError, match=r"^model: the tiny preset has no pretrained weights"):
        sources.resolve(str(path), "gemma3-tiny", tmp_path / "cache")
    with pytest.raises(ConfigError) as error:
        sources.resolve(str(path), "gemma3-270m", tmp_path / "cache")
    message = str(error.value)
    assert message.startswith("model: 'gemma3-270m' does not fit the GGUF at ")
    assert "num_layers 1 (model: 18)" in message and "\n" not in message
