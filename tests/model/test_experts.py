"""The experts' expert-parallel computation (``gemmalab.model.experts``) against the same
computation on the whole batch at once, on 8 virtual devices, float32: each comparison is of
float32 summed in another order (sorted, split, token by token), to rounding at its scale."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmalab.model import experts, mesh
from tests.helpers.numerics import (
    REORDERED_FLOAT32,
    assert_close_to_scale,
    assert_trees_close_to_scale,
)

EXPERTS, TOP_K, FEATURES, HIDDEN, RANK = 8, 2, 16, 12, 4
ROWS, LENGTH = 8, 6


def _inputs(seed: int = 0, lora: bool = True, skew: bool = False):
    keys = iter(jax.random.split(jax.random.key(seed), 12))

    def normal(*shape):  # of unit scale through each product: 1 / sqrt(its input width)
        return jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[-2] if
                                                                             len(shape) > 2 else 1)

    x = normal(ROWS, LENGTH, FEATURES)
    logits = normal(ROWS, LENGTH, EXPERTS)
    if skew:  # every token's first choice is expert 5: one device gets all of them
        logits = logits.at[..., 5].add(100.0)
    _, choices = jax.lax.top_k(logits, TOP_K)
    combine = jax.nn.softmax(normal(ROWS, LENGTH, TOP_K), axis=-1)
    gate = experts.ExpertWeights(
        normal(EXPERTS, 2, HIDDEN, FEATURES),
        *((normal(EXPERTS, FEATURES, RANK), normal(EXPERTS, RANK, 2, HIDDEN)) if lora else ()),
        lora_scale=0.5)
    linear = experts.ExpertWeights(
        normal(EXPERTS, HIDDEN, FEATURES),
        *((normal(EXPERTS, HIDDEN, RANK), normal(EXPERTS, RANK, FEATURES)) if lora else ()),
        lora_scale=0.5)
    scale = 1.0 + 0.1 * normal(EXPERTS)
    return x, choices, combine, gate, linear, scale


def _dense_reference(x, choices, combine, gate, linear, scale):
    """Each token through each of its experts one by one, dense weights (no sorting)."""
    def project(weights, expert, v):
        w = weights.w[expert]
        if w.ndim == 3:  # gate|up [2, H, D]
            out = jnp.einsum("d,nhd->nh", v, w).reshape(-1)
            if weights.a is not None:
                out += weights.lora_scale * (v @ weights.a[expert] @ weights.b[expert].reshape(
                    RANK, -1))
            return out
        out = v @ w
        if weights.a is not None:
            out += weights.lora_scale * (v @ weights.a[expert] @ weights.b[expert])
        return out

    def token(v, chosen, weights_k):
        total = 0.0
        for k in range(TOP_K):
            e = chosen[k]
            gate_up = project(gate, e, v).reshape(2, HIDDEN)
            hidden = jax.nn.gelu(gate_up[0]) * gate_up[1]
            total += weights_k[k] * scale[e] * project(linear, e, hidden)
        return total

    flat = jax.vmap(token)(x.reshape(-1, FEATURES), choices.reshape(-1, TOP_K),
                           combine.reshape(-1, TOP_K))
    return flat.reshape(x.shape)


MESHES = [{"expert": 8}, {"data": 2, "expert": 4}, {"fsdp": 2, "expert": 2, "tensor": 2},
          {"data": 2, "fsdp": 4}]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_expert_parallel_output_and_gradients_equal_the_whole_batch(shape):
    inputs = _inputs()
    device_mesh = mesh.make_mesh(shape)
    reference = _dense_reference(*inputs)
    whole, dropped = experts.routed_ffw(*inputs)
    assert_close_to_scale(whole, reference, REORDERED_FLOAT32)
    split, split_dropped = jax.jit(lambda *a: experts.routed_ffw(*a, mesh=device_mesh))(*inputs)
    assert_close_to_scale(split, whole, REORDERED_FLOAT32)
    assert float(dropped) == float(split_dropped) == 0.0

    def loss(x, gate, linear, scale, mesh_=None):
        out, _ = experts.routed_ffw(x, inputs[1], inputs[2], gate, linear, scale, mesh=mesh_)
        return jnp.sum(jnp.sin(out))

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(inputs[0], *inputs[3:])
    split_grads = jax.jit(jax.grad(lambda *a: loss(*a, mesh_=device_mesh), argnums=(0, 1, 2, 3)))(
        inputs[0], *inputs[3:])
    assert_trees_close_to_scale(split_grads, grads, REORDERED_FLOAT32)


def test_no_token_is_dropped_when_every_token_picks_one_expert():
    """Dropless: one expert's device receives every row's first choice from all 8 devices."""
    inputs = _inputs(seed=1, skew=True)
    assert bool((inputs[1][..., 0] == 5).all())
    device_mesh = mesh.make_mesh({"expert": 8})
    split, dropped = jax.jit(lambda *a: experts.routed_ffw(*a, mesh=device_mesh))(*inputs)
    assert_close_to_scale(split, _dense_reference(*inputs), REORDERED_FLOAT32)
    assert float(dropped) == 0.0


def test_devices_exchange_tokens_not_weights():
    """The compiled expert-parallel program exchanges tokens (all-to-alls of them and their
    counts): no device gathers another's experts or rows, or sums a partial result over all of
    them; its expert weights are one shard's, E / 8 experts."""
    inputs = _inputs(lora=False)
    device_mesh = mesh.make_mesh({"expert": 8})
    sharded = jax.device_put(inputs[3].w, jax.NamedSharding(device_mesh, jax.P("expert")))
    args = (*inputs[:3], experts.ExpertWeights(sharded), *inputs[4:])
    program = jax.jit(lambda *a: experts.routed_ffw(*a, mesh=device_mesh)).lower(*args).compile(
    ).as_text()
    collectives = set(re.findall(r" (all-to-all|all-gather|all-reduce|reduce-scatter|"
                                 r"collective-permute)(?:-start)?\(", program))
    summed = {shape.split("{")[0] for shape in re.findall(r"= (\S+) all-reduce(?:-start)?\(",
                                                          program)}
    # Tokens and their counts; besides, one sum of a number: the dropped copies.
    assert collectives == {"all-to-all", "all-reduce"}, collectives
    assert summed == {"f32[]"}, summed
    assert f"f32[{EXPERTS // 8},2,{HIDDEN},{FEATURES}]" in program  # one shard's gate|up
    assert f"f32[{EXPERTS},2,{HIDDEN},{FEATURES}]" not in program


def _kept_copies(choices, devices: int, capacity: int) -> np.ndarray:
    """Which routed copies ``[B, L, k]`` a capacity keeps, worked out apart from the code: each
    device (its rows) sorts its copies by expert, stably, and sends each expert shard at most
    ``capacity`` of them, the first."""
    choices = np.asarray(choices)
    kept = np.zeros(choices.shape, bool)
    per_shard = EXPERTS // devices
    for rows in np.split(np.arange(choices.shape[0]), devices):
        copies = [(int(choices[r, t, k]), r, t, k) for r in rows for t in range(LENGTH)
                  for k in range(TOP_K)]
        copies.sort(key=lambda c: c[0])  # stable: (row, token, k) order within an expert
        sent = [0] * devices
        for expert, r, t, k in copies:
            shard = expert // per_shard
            if sent[shard] < capacity:
                kept[r, t, k] = True
            sent[shard] += 1
    return kept


def test_a_capacity_drops_the_copies_past_it_and_counts_them():
    x, choices, combine, gate, linear, scale = _inputs(seed=2, skew=True)
    device_mesh = mesh.make_mesh({"expert": 8})
    slots = LENGTH * TOP_K  # one row a device
    capacity = experts.block_capacity(slots, 8, 2.0)
    assert capacity == 3
    run = jax.jit(lambda *a: experts.routed_ffw(*a, mesh=device_mesh, capacity_factor=2.0))
    out, dropped = run(x, choices, combine, gate, linear, scale)
    kept = _kept_copies(choices, 8, capacity)
    assert 0 < (~kept).sum() < kept.size
    assert float(dropped) == pytest.approx((~kept).sum() / kept.size)
    expected = _dense_reference(x, choices, combine * kept, gate, linear, scale)
    assert_close_to_scale(out, expected, REORDERED_FLOAT32)
    # Room for every copy: nothing dropped, the dropless result.
    roomy = jax.jit(lambda *a: experts.routed_ffw(*a, mesh=device_mesh, capacity_factor=8.0))
    out, dropped = roomy(x, choices, combine, gate, linear, scale)
    assert float(dropped) == 0.0
    assert_close_to_scale(out, _dense_reference(x, choices, combine, gate, linear, scale),
                          REORDERED_FLOAT32)
