import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmalab import plan
from gemmalab.data import packing
from gemmalab.model import cross_entropy, mesh, presets, sharding
from gemmalab.train import optimization
from tests.helpers.models import _batch, tiny_model
from tests.helpers.numerics import (
    REORDERED_FLOAT32,
    assert_close_to_scale,
    assert_trees_close_to_scale,
)


def test_masked_cross_entropy_matches_a_hand_computed_reference():
    logits = jnp.asarray([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [5.0, 5.0, 5.0]]])
    targets = jnp.asarray([[0, 2, 1]])
    mask = jnp.asarray([[True, True, False]])
    total, count = cross_entropy.masked_cross_entropy(logits, targets, mask)
    first = -(2.0 - math.log(math.exp(2) + 2))  # -log softmax([2,0,0])[0]
    second = -(0.0 - math.log(math.e + 2))  # -log softmax([0,1,0])[2]
    assert float(count) == 2.0
    assert float(total) == pytest.approx(first + second, rel=1e-6)


def test_masked_positions_contribute_nothing():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 5, 7)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 7, size=(2, 5)))
    mask = jnp.asarray(rng.random((2, 5)) > 0.4)
    other = jnp.where(mask, targets, (targets + 3) % 7)  # change only masked-out targets
    noisy = jnp.where(mask[..., None], logits, logits * 100)
    reference = [float(x) for x in cross_entropy.masked_cross_entropy(logits, targets, mask)]
    changed = [float(x) for x in cross_entropy.masked_cross_entropy(noisy, other, mask)]
    assert changed == pytest.approx(reference)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_nll_gradient_is_softmax_minus_onehot_in_the_logits_dtype(dtype):
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(3, 4, 9)) * 4, dtype)
    targets = jnp.asarray(rng.integers(0, 9, size=(3, 4)))
    weights = jnp.asarray(rng.random((3, 4)), jnp.float32)
    value, grad = jax.value_and_grad(
        lambda x: jnp.sum(cross_entropy.token_nll(x, targets) * weights))(logits)
    wide = np.asarray(logits, np.float64)
    log_probs = wide - np.log(np.exp(wide).sum(-1, keepdims=True))
    onehot = np.eye(9)[np.asarray(targets)]
    expected_value = -(np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]
                       * np.asarray(weights)).sum()
    expected_grad = (np.exp(log_probs) - onehot) * np.asarray(weights)[..., None]
    assert grad.dtype == dtype
    # fp32 arithmetic inside either way; a bf16 gradient is rounded to bf16's 8 bits.
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    assert float(value) == pytest.approx(expected_value, rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad, np.float64), expected_grad, atol=tolerance)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_nll_ignores_logits_of_minus_infinity(dtype):
    """Vocabulary entries masked to -inf drop out of the softmax; the NLL stays finite."""
    logits = jnp.asarray([[1.0, -jnp.inf, 3.0, -jnp.inf]], dtype)
    nll = cross_entropy.token_nll(logits, jnp.asarray([2]))
    # The log-sum-exp (3.13) less the target's logit (3): float32 rounding at their scale (as
    # another CPU's exp and log round it), not at the difference's 0.127.
    lse = math.log(math.exp(1) + math.exp(3))
    assert float(nll[0]) == pytest.approx(lse - 3, abs=REORDERED_FLOAT32 * lse)


def test_loss_gradient_holds_the_float32_logits_once_and_their_gradient_in_bf16():
    """A chunk's logits are written once in float32 and its gradient in the compute dtype, with
    no other copy: the softmax's widening shared between the log-sum-exp and the gradient was a
    second float32 copy of the whole logits (the 270M's: 1 GiB a 1,024-token chunk)."""
    tokens, vocab, dim = 64, 512, 32
    hidden = jnp.ones((2, tokens // 2, dim), jnp.bfloat16)
    embedding = jnp.ones((vocab, dim), jnp.bfloat16)
    targets, mask = jnp.zeros((2, tokens // 2), jnp.int32), jnp.ones((2, tokens // 2))

    def loss(h: jax.Array, e: jax.Array) -> jax.Array:  # one chunk, LoRA's frozen head
        return cross_entropy.chunked_cross_entropy(h, e, targets, mask, max_logits=1 << 20)[0]

    compiled = jax.jit(jax.grad(loss, argnums=0)).lower(hidden, embedding).compile()
    f32_logits, bf16_gradient = tokens * vocab * 4, tokens * vocab * 2
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    assert f32_logits <= temporaries < f32_logits + bf16_gradient + tokens * vocab, temporaries


def test_attention_mask_is_causal_within_segments_and_empty_for_padding():
    segments = jnp.asarray([[1, 1, 2, 2, 0]])
    expected = np.array([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0],
    ], bool)
    np.testing.assert_array_equal(optimization.attention_mask(segments)[0], expected)


def test_schedule_warms_up_then_decays_to_the_floor():
    schedule = optimization.learning_rate_schedule(1e-3, 100, warmup_ratio=0.1, min_lr_ratio=0.1)
    assert float(schedule(0)) == 0.0
    assert float(schedule(10)) == pytest.approx(1e-3)
    assert float(schedule(100)) == pytest.approx(1e-4)
    assert float(schedule(5)) == pytest.approx(5e-4)


@pytest.mark.slow
def test_params_are_fp32_masters_and_a_step_learns():
    model, params = tiny_model(64)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    device_mesh = mesh.make_mesh()
    assert mesh.data_parallel_size(device_mesh) == 8  # conftest: 8 virtual CPU devices
    schedule = optimization.learning_rate_schedule(1e-2, 20, warmup_ratio=0.0, min_lr_ratio=1.0)
    optimizer = optimization.make_optimizer(schedule, weight_decay=0.0, b1=0.9, b2=0.95,
                                            max_grad_norm=1.0)
    # A copy: the step donates its state, and tiny_model's params are shared.
    state, shardings = optimization.init_state(jax.tree.map(np.asarray, params), optimizer,
                                               device_mesh)
    step = optimization.make_train_step(model, optimizer, schedule, jnp.bfloat16, device_mesh,
                                        shardings)
    batch = mesh.global_batch(_batch(), device_mesh)
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch, None)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 8
    assert float(metrics["useful_tokens"]) == 8 * 16 - 4 * 3
    assert losses[-1] < losses[0] - 0.5
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert float(metrics["grad_norm"]) > 0


@pytest.mark.slow
def test_padding_does_not_change_loss_or_gradients():
    model, params = tiny_model(64)
    batch = _batch()
    changed = dict(batch)
    pad = batch["segment_ids"] == 0
    changed["tokens"] = np.where(pad, 7, batch["tokens"])
    changed["targets"] = np.where(pad, 9, batch["targets"])

    def loss(p, b):
        total, count, _ = optimization.forward_loss(model, p, b, jnp.float32)
        return total / count

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    value, grads = value_and_grad(params, batch)
    value2, grads2 = value_and_grad(params, changed)
    assert float(value) == pytest.approx(float(value2), rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_packed_segments_do_not_see_each_other():
    """The loss of a story is the same alone or packed after another story."""
    model, params = tiny_model(64)
    story = np.asarray([2, 11, 12, 13, 14, 15, 1], np.int32)
    alone = {"tokens": np.zeros((1, 16), np.int32), "targets": np.zeros((1, 16), np.int32),
             "segment_ids": np.zeros((1, 16), np.int32), "positions": np.zeros((1, 16), np.int32)}
    alone["tokens"][0, :6], alone["targets"][0, :6] = story[:-1], story[1:]
    alone["segment_ids"][0, :6], alone["positions"][0, :6] = 1, np.arange(6)
    alone["loss_mask"] = alone["segment_ids"].copy()
    packed = {k: v.copy() for k, v in alone.items()}
    packed["tokens"][0, 6:12], packed["targets"][0, 6:12] = story[:-1] + 20, story[1:] + 20
    packed["segment_ids"][0, 6:12], packed["positions"][0, 6:12] = 2, np.arange(6)
    only_first = dict(packed, segment_ids=np.where(packed["segment_ids"] == 2, 3, 1) *
                      (packed["segment_ids"] > 0))
    total_alone, _, _ = jax.jit(lambda p: optimization.forward_loss(model, p, alone,
                                                                  jnp.float32))(params)

    @jax.jit
    def first_story_loss(p):
        output = model.apply({"params": p}, jnp.asarray(packed["tokens"]),
                             positions=jnp.asarray(packed["positions"]),
                             attention_mask=optimization.attention_mask(
                                 jnp.asarray(packed["segment_ids"])))
        return cross_entropy.masked_cross_entropy(
            output.logits, jnp.asarray(packed["targets"]),
            jnp.asarray(only_first["segment_ids"] == 1))[0]

    # Another row and program: float32 summed in another order.
    assert float(first_story_loss(params)) == pytest.approx(float(total_alone),
                                                            rel=REORDERED_FLOAT32)


def test_evaluate_counts_every_real_target():
    model, params = tiny_model(64)
    device_mesh = mesh.make_mesh()
    eval_step = optimization.make_eval_step(model, jnp.float32, device_mesh,
                                            sharding.param_sharding(params, device_mesh))
    batches = [_batch(seed=1), _batch(seed=2)]
    held_out = optimization.evaluate(eval_step, jax.device_put(params), batches, device_mesh)
    loss, perplexity = held_out["eval_loss"], held_out["eval_perplexity"]
    forward_loss = jax.jit(lambda p, b: optimization.forward_loss(model, p, b, jnp.float32))
    totals = [forward_loss(params, b) for b in batches]
    expected = sum(float(t) for t, _, _ in totals) / sum(float(n) for _, n, _ in totals)
    # The mesh's eval step against one program a batch: float32 summed in another order; exp
    # turns the loss's absolute error into the perplexity's relative one.
    assert loss == pytest.approx(expected, rel=REORDERED_FLOAT32)
    assert perplexity == pytest.approx(math.exp(expected), rel=REORDERED_FLOAT32 * expected)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_chunked_loss_equals_the_full_loss_and_its_gradient(softcap):
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(3, 10, 8)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(50, 8)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 50, size=(3, 10)))
    mask = jnp.asarray(rng.random((3, 10)) > 0.3)

    def full(h, e):
        logits = h @ e.T
        if softcap is not None:
            logits = jnp.tanh(logits / softcap) * softcap
        total, _ = cross_entropy.masked_cross_entropy(logits, targets, mask)
        return total

    def chunked(h, e):  # 2 positions of the 3 rows per chunk: 5 chunks
        return cross_entropy.chunked_cross_entropy(h, e, targets, mask, softcap=softcap,
                                                   max_logits=7 * 50)[0]

    def padded(h, e):  # 3 positions per chunk: 4 chunks, the last one padded
        return cross_entropy.chunked_cross_entropy(h, e, targets, mask, softcap=softcap,
                                                   max_logits=9 * 50)[0]

    for loss in (chunked, padded):  # float32 summed in another order, at each one's scale
        assert_close_to_scale(loss(hidden, table), full(hidden, table), REORDERED_FLOAT32)
        assert_trees_close_to_scale(jax.grad(loss, (0, 1))(hidden, table),
                                    jax.grad(full, (0, 1))(hidden, table), REORDERED_FLOAT32)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("per_segment", [False, True])
@pytest.mark.parametrize("trained", [("hidden", "update"), ("hidden", "embedding", "update")])
def test_the_chunked_gradient_taken_in_the_forward_pass_is_autodiffs(softcap, per_segment,
                                                                      trained):
    """Chunked, the loss's gradient is formed in its forward pass (no recompute of the logits):
    for the hidden states and LoRA's token rows (the frozen head), and for the embedding too
    (full fine-tuning), summed or per segment, it equals autodiff through the whole logits."""
    rng = np.random.default_rng(4)
    rows, length, dim, vocab = 2, 10, 8, 50
    args = {"hidden": jnp.asarray(rng.normal(size=(rows, length, dim)), jnp.float32),
            "embedding": jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32),
            "update": jnp.asarray(rng.normal(size=(2, dim)) * 0.1, jnp.float32)}
    targets = jnp.asarray(rng.integers(0, vocab, (rows, length)))
    mask = jnp.asarray(rng.random((rows, length)) > 0.3)
    segment_ids = jnp.asarray(np.repeat([[1, 1, 1, 2, 2, 3, 3, 3, 3, 0]], rows, 0))
    ids = jnp.asarray([3, 7], jnp.int32)

    def loss(values, max_logits):
        every = {**args, **values}
        kwargs = {"softcap": softcap, "max_logits": max_logits,
                  "row_updates": (ids, every["update"])}
        if per_segment:
            sums, _ = cross_entropy.chunked_segment_nll(
                every["hidden"], every["embedding"], targets, mask, segment_ids,
                num_segments=3, **kwargs)
            return jnp.sum(sums * jnp.asarray([1.0, -2.0, 0.5]))
        return cross_entropy.chunked_cross_entropy(every["hidden"], every["embedding"],
                                                   targets, mask, **kwargs)[0]

    values = {name: args[name] for name in trained}
    whole = jax.value_and_grad(loss)(values, 1 << 20)
    chunked = jax.jit(jax.value_and_grad(loss), static_argnums=1)(values, 3 * vocab * rows)
    # float32 summed in another order, at each one's scale.
    assert_close_to_scale(chunked[0], whole[0], REORDERED_FLOAT32)
    assert_trees_close_to_scale(chunked[1], whole[1], REORDERED_FLOAT32)


def test_chunks_of_the_loss_stay_on_the_devices_of_their_rows():
    """Under data parallelism each device computes its own rows' logits, chunk after chunk:
    no hidden state is gathered, and a device's FLOPs are its share of the loss's."""
    from jax.sharding import NamedSharding, PartitionSpec

    devices = np.asarray(jax.devices()[:4])
    if len(devices) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    rows_sharded = NamedSharding(jax.sharding.Mesh(devices, ("data",)), PartitionSpec("data"))
    replicated = NamedSharding(rows_sharded.mesh, PartitionSpec())
    rows, length, dim, vocab = 16, 64, 32, 4096

    def flops(max_logits: int) -> float:
        def loss(h, e, t, m):
            return cross_entropy.chunked_cross_entropy(h, e, t, m, max_logits=max_logits)[0]

        args = (jax.ShapeDtypeStruct((rows, length, dim), jnp.bfloat16, sharding=rows_sharded),
                jax.ShapeDtypeStruct((vocab, dim), jnp.bfloat16, sharding=replicated),
                jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=rows_sharded),
                jax.ShapeDtypeStruct((rows, length), jnp.bool_, sharding=rows_sharded))
        compiled = jax.jit(jax.grad(loss, (0, 1))).lower(*args).compile()
        assert "all-gather" not in compiled.as_text()
        return plan.compiled_cost(compiled)["flops"]

    one_chunk = flops(rows * length * vocab)
    # XLA counts a loop's body once: 8 chunks of 8 positions count an eighth of the work
    # (plus the recompute), if each device does only its rows' part of each chunk.
    eight_chunks = flops(rows * 8 * vocab)
    assert eight_chunks < one_chunk / 4


def test_the_loss_under_fsdp_gathers_the_embedding_and_keeps_its_numbers():
    """With the mesh, the chunks are pinned to the rows' devices and the embedding (its embed
    dimension split by fsdp) gathered first: the same loss and gradients as without."""
    from jax.sharding import NamedSharding, PartitionSpec

    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    device_mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2, 1),
                                    ("data", "fsdp", "tensor"))
    rng = np.random.default_rng(2)
    rows, length, dim, vocab = 8, 12, 16, 64
    rows_sharded = NamedSharding(device_mesh, PartitionSpec(("data", "fsdp")))
    hidden = jax.device_put(jnp.asarray(rng.normal(size=(rows, length, dim)), jnp.float32),
                            rows_sharded)
    table = jax.device_put(jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32),
                           NamedSharding(device_mesh, PartitionSpec("tensor", "fsdp")))
    targets = jax.device_put(jnp.asarray(rng.integers(0, vocab, size=(rows, length))),
                             rows_sharded)
    mask = jax.device_put(jnp.asarray(rng.random((rows, length)) > 0.2), rows_sharded)

    def loss(h, e, mesh):  # 5 positions per chunk: 3 chunks, the last one padded
        return cross_entropy.chunked_cross_entropy(h, e, targets, mask, max_logits=rows * 5 * vocab,
                                                   mesh=mesh)[0]

    placed = jax.jit(jax.value_and_grad(lambda h, e: loss(h, e, device_mesh), (0, 1)))
    free = jax.jit(jax.value_and_grad(lambda h, e: loss(h, e, None), (0, 1)))
    (value, grads), (expected, expected_grads) = placed(hidden, table), free(hidden, table)
    # float32 summed in another order over the mesh, at each one's scale.
    assert_close_to_scale(value, expected, REORDERED_FLOAT32)
    assert_trees_close_to_scale(grads, expected_grads, REORDERED_FLOAT32)


@pytest.mark.slow
def test_the_loss_never_holds_all_logits(monkeypatch):
    """Chunking saves at least one fp32 copy of the batch's logits in the compiled step."""
    vocab, rows, maxlen = 32_768, 8, 256
    config = presets.model_config("gemma3-tiny", vocab)
    model = presets.build_model(config, param_dtype=jnp.float32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                               jnp.zeros((1, maxlen), jnp.int32)))["params"]
    batch = {k: jax.ShapeDtypeStruct((rows, maxlen), jnp.int32)
             for k in packing.FIELDS}

    def full(p, b):
        output = model.apply({"params": p}, b["tokens"], positions=b["positions"],
                             attention_mask=optimization.attention_mask(b["segment_ids"]))
        return cross_entropy.masked_cross_entropy(output.logits, b["targets"],
                                                  b["segment_ids"] > 0)[0]

    def chunked(p, b):
        return optimization.forward_loss(model, p, b, jnp.float32)[0]

    def temp_bytes(loss):
        return jax.jit(jax.grad(loss)).lower(params, batch).compile().memory_analysis(
        ).temp_size_in_bytes

    monkeypatch.setattr(cross_entropy, "CPU_LOSS_CHUNK_LOGITS", 256 * vocab)  # 8 chunks of 256
    saved = temp_bytes(full) - temp_bytes(chunked)
    assert saved > rows * maxlen * vocab * 4


def test_full_fine_tuning_forms_the_embedding_gradient_without_recomputing_the_logits(
        monkeypatch):
    """The batch's summed loss: the embedding's gradient is formed in the chunked loss's forward
    pass, three [tokens, V] products a chunk (logits, the hidden states' and the embedding's
    gradients) where recomputing the logits in the backward pass took four."""
    rows, length, dim, vocab = 4, 64, 32, 4096

    def flops() -> float:
        def loss(h, e, t, m):
            return cross_entropy.chunked_cross_entropy(h, e, t, m,
                                                       max_logits=rows * 8 * vocab)[0]

        args = (jax.ShapeDtypeStruct((rows, length, dim), jnp.bfloat16),
                jax.ShapeDtypeStruct((vocab, dim), jnp.bfloat16),
                jax.ShapeDtypeStruct((rows, length), jnp.int32),
                jax.ShapeDtypeStruct((rows, length), jnp.bool_))
        return plan.compiled_cost(jax.jit(jax.grad(loss, (0, 1))).lower(*args).compile())["flops"]

    now = flops()
    monkeypatch.setattr(cross_entropy, "EMBEDDING_GRADIENT_IN_FORWARD", False)
    recomputed = flops()
    product = 2 * rows * 8 * vocab * dim  # one [tokens, V] product of a chunk (a loop body)
    assert recomputed - now == pytest.approx(product, rel=0.1)
