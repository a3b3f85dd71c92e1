"""QLoRA's quantized base: each format's error bound, what is quantized and what is not, the
scales' shards from the one table, the same function as LoRA over the dequantized weights, and
the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmalab.config import TrainConfig
from gemmalab.errors import ConfigError
from gemmalab.model import lora, mesh, presets, quantization, sharding
from gemmalab.plan.shapes import abstract_params
from gemmalab.train import optimization
from tests.helpers.models import _batch, tiny_model
from tests.helpers.numerics import (
    REORDERED_FLOAT32,
    assert_close_to_scale,
    assert_trees_close_to_scale,
)

FORMATS = ("int8", "int4", "nf4")
# NormalFloat-4's 16 values (QLoRA, appendix E): the widest gap, -1 to -0.6962, bounds its
# rounding at half of it.
NF4_HALF_GAP = (1.0 - 0.6961928) / 2
# The largest rounding error per unit of a group's largest magnitude: qwix's symmetric grids
# put that magnitude at 127.5 (int8) and 7.5 (int4) steps, clipped to 127 and 7: half a step.
BOUND = {"int8": 0.5 / 127.5, "int4": 0.5 / 7.5, "nf4": NF4_HALF_GAP}
ROUNDING = 1e-6  # float32 arithmetic of the scale products, relative


def _groups(array: np.ndarray, axis: int, size: int | None) -> np.ndarray:
    """``|array|``'s largest value in each of its quantization groups, broadcast back."""
    moved = np.moveaxis(np.abs(array), axis, -1)
    size = size or moved.shape[-1]
    peaks = moved.reshape(*moved.shape[:-1], -1, size).max(-1, keepdims=True)
    return np.moveaxis(np.broadcast_to(peaks, (*peaks.shape[:-1], size)).reshape(moved.shape),
                       -1, axis)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("rule", "shape"), [("q_einsum", (4, 256, 32)),
                                             ("attn_vec_einsum", (4, 32, 256)),
                                             ("experts_gating", (4, 2, 48, 128))])
def test_each_format_rounds_within_half_a_step_of_its_group(fmt, rule, shape):
    """Heavy-tailed weights (Student-t, as trained ones): every value within half a grid step
    of its group's scale, the scales per output channel (int8) or per 32 of its inputs
    (4-bit)."""
    weight = 0.02 * jax.random.t(jax.random.key(1), 4.0, shape)
    packed = quantization.quantize_leaf(weight, rule, fmt, jnp.float32)
    axis = quantization.INPUT_AXIS[rule]
    size = quantization.group_size(fmt, shape[axis])
    assert packed.qvalue.shape == shape
    assert packed.scale.shape == tuple(
        (dim // size if size else 1) if a == axis else dim for a, dim in enumerate(shape))
    error = np.abs(np.asarray(quantization.as_array(packed)) - np.asarray(weight))
    peaks = _groups(np.asarray(weight), axis, size)
    assert np.all(error <= peaks * (BOUND[fmt] + ROUNDING))
    assert error.max() > peaks.max() * BOUND[fmt] / 10  # (a real rounding, not a copy)


def test_int8_is_the_closest_format_on_normal_weights():
    weight = 0.02 * jax.random.normal(jax.random.key(2), (4, 512, 64))
    rms = {fmt: float(jnp.sqrt(jnp.mean((quantization.as_array(quantization.quantize_leaf(
        weight, "q_einsum", fmt, jnp.float32)) - weight) ** 2))) for fmt in FORMATS}
    assert rms["int8"] < min(rms["nf4"], rms["int4"]) / 10


@pytest.mark.parametrize("name", ["gemma3-tiny", "gemma4-tiny", "gemma4-tiny-moe"])
def test_the_projections_are_quantized_and_nothing_else(name):
    """Attention, MLP and experts quantized; the embedding tables, the router, Gemma 4's
    per-layer projection and every norm or scalar kept as they were, bit for bit."""
    model = presets.build_model(presets.model_config(name, 64), param_dtype=jnp.float32)
    params = presets.init_params(model, seed=0, sample_length=8)
    packed = quantization.quantize_base(params, "nf4", jnp.float32)
    flat = dict(jax.tree_util.tree_flatten_with_path(
        packed, is_leaf=quantization.is_quantized)[0])
    quantized = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        rule = sharding.rule_name(path, leaf.ndim)
        if quantization.is_quantized(flat[path]):
            quantized.add(rule)
        else:
            np.testing.assert_array_equal(np.asarray(flat[path]), np.asarray(leaf))
    expected = {rule for rule in quantization.QUANTIZED_RULES
                if any(sharding.rule_name(p, x.ndim) == rule
                       for p, x in jax.tree_util.tree_leaves_with_path(params))}
    assert quantized == expected
    assert {"q_einsum", "gating_einsum", "linear"} <= quantized
    assert presets.parameter_count(packed) == presets.parameter_count(params)
    # Whole-model: the interceptor's forward pass equals the dequantized tree's.
    tokens = jnp.arange(8, dtype=jnp.int32)[None] % 60 + 2
    with quantization.dequantizing():
        logits = model.apply({"params": packed}, tokens).logits
    np.testing.assert_array_equal(
        np.asarray(logits),
        np.asarray(model.apply({"params": quantization.dequantized(packed)}, tokens).logits))


def test_the_quantized_base_is_cut_by_the_one_table():
    """Values shard as their weight; scales by the same rule, whole where an axis does not
    divide them; the same values as an unsharded quantization."""
    model, params = tiny_model(64)
    device_mesh = mesh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices())
    placed = jax.device_put(params, sharding.param_sharding(params, device_mesh))
    packed = quantization.quantize_base(placed, "int4", jnp.float32, device_mesh)
    alone = quantization.quantize_base(params, "int4", jnp.float32)
    q = packed["layer_0"]["attn"]["q_einsum"]["w"]
    rule = sharding.RULES["q_einsum"]
    assert q.qvalue.sharding.spec == sharding.weight_spec(
        tuple(jax.tree_util.DictKey(k) for k in ("layer_0", "attn", "q_einsum", "w")),
        q.shape, device_mesh)
    assert tuple(q.scale.sharding.spec) == tuple(
        a if d % 2 == 0 and d > 1 else None for a, d in zip(rule, q.scale.shape, strict=True))
    for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(alone), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sharding.array_bytes(q.qvalue) == q.qvalue.size // 2  # 4 bits a value


def test_a_qlora_step_is_lora_over_the_dequantized_base():
    """The same function: QLoRA's loss and adapter gradients equal LoRA's with the dequantized
    weights as its frozen base (float32; the dequantization is exact arithmetic on both)."""
    model, params = tiny_model(64)
    wrapped = lora.wrap(model, rank=4, alpha=8.0, modules="all", dtype=jnp.float32)
    adapters = jax.tree.map(
        lambda x: x + 0.05, lora.init_adapters(model.config, rank=4, modules="all",
                                               dtype="float32", seed=1))
    batch = {k: jnp.asarray(v) for k, v in _batch(rows=4, maxlen=16, vocab=64).items()}
    for fmt in FORMATS:
        packed = quantization.quantize_base(params, fmt, jnp.float32)

        def loss(adapters, frozen):
            total, count, _ = optimization.forward_loss(wrapped, adapters, batch, jnp.float32,
                                                        frozen)
            return total / count

        quantized = jax.value_and_grad(loss)(adapters, packed)
        plain = jax.value_and_grad(loss)(adapters, quantization.dequantized(packed))
        # Decoded in the model (under a barrier) or before it: float32 summed in another order
        # at most, at each gradient's own scale.
        assert_close_to_scale(quantized[0], plain[0], REORDERED_FLOAT32)
        assert_trees_close_to_scale(quantized[1], plain[1], REORDERED_FLOAT32)


def test_quantization_is_refused_where_it_cannot_serve():
    with pytest.raises(ConfigError, match=r"^base_quantization: 'nf4' quantizes a frozen base "
                                          r"under LoRA adapters, but lora_rank=0"):
        TrainConfig.flat(base_quantization="nf4")
    with pytest.raises(ConfigError, match=r"^base_quantization: unknown format 'fp4'"):
        TrainConfig.flat(lora_rank=4, base_quantization="fp4")
    # Gemma 3 270M's width 640 is twenty groups of 32: fsdp 8 would cut groups.
    base = abstract_params(presets.model_config("gemma3-270m", 0), "float32")
    with pytest.raises(ConfigError, match=r"^mesh: fsdp=8 cuts layer_0/attn/kv_einsum/w's 640 "
                                          r"inputs into pieces of 80, not whole nf4 groups of "
                                          r"32\. Fix: use a fsdp size that divides 20, e\.g\. 4"):
        quantization.check_base("nf4", base, {"fsdp": 8})
    quantization.check_base("nf4", base, {"fsdp": 4, "tensor": 2})
    quantization.check_base("int8", base, {"fsdp": 8})  # one scale a row: nothing to cut
    odd = {"layer_0": {"mlp": {"linear": jax.ShapeDtypeStruct((100, 64), jnp.float32)}}}
    with pytest.raises(ConfigError, match=r"^base_quantization: layer_0/mlp/linear's 100 inputs"):
        quantization.check_base("int4", odd, {})


def test_nf4_decodes_as_qwix_does_by_selects_and_under_a_barrier():
    """gemmalab decodes nf4 by elementwise selects (qwix's gather costs libtpu 3 GiB of program
    on 1B) and ties each dequantization to its activation: the same numbers as qwix's."""
    import qwix

    weight = 0.02 * jax.random.normal(jax.random.key(3), (2, 96, 64))
    for dtype in (jnp.float32, jnp.bfloat16):
        packed = quantization.quantize_leaf(weight.astype(dtype), "gating_einsum", "nf4", dtype)
        np.testing.assert_array_equal(
            np.asarray(quantization.as_array(packed, after=jnp.ones((3, 64), dtype))),
            np.asarray(qwix.dequantize(packed)))


def test_a_split_quantized_projection_is_read_through_its_input():
    """Under fsdp libtpu hoisted every layer's dequantized attention output projection to the
    step's start (the 31B QLoRA, 13.5 GiB a chip); read through a data dependency on its input
    (scale and values: integers by an or, ``x * 0`` folds for them) it compiles to 10.8. The
    values are unchanged; on one device nothing is added."""
    from tests.helpers.models import jaxpr_equations

    model, params = tiny_model(64)
    adapters = jax.tree.map(lambda x: x + 0.05, lora.init_adapters(
        model.config, rank=4, modules="all", dtype="float32", seed=1))
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 12)), jnp.int32)
    split_mesh = mesh.make_mesh({"fsdp": 2}, jax.devices()[:2])
    for fmt in FORMATS:
        frozen = quantization.quantize_base(params, fmt, jnp.float32)

        def logits(wrapped, frozen=frozen):
            return wrapped.apply({"params": lora.join(frozen, adapters)}, tokens).logits

        def ors(wrapped):
            jaxpr = jax.make_jaxpr(logits, static_argnums=0)(wrapped).jaxpr
            return sum(e.primitive.name == "or" for e in jaxpr_equations(jaxpr))

        alone, split = (lora.wrap(model, rank=4, alpha=8.0, modules="all", dtype=jnp.float32,
                                  mesh=m) for m in (None, split_mesh))
        assert ors(alone) == 0
        assert ors(split) == 5 * model.config.num_layers  # q, kv, output, gate|up, down
        np.testing.assert_array_equal(logits(split), logits(alone))
