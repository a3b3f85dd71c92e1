"""Weights and optimizer state split over data / fsdp / tensor meshes train like one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gemmalab.config import PRESET_NAMES, resolve_mesh_shape
from gemmalab.errors import ConfigError
from gemmalab.model import mesh, presets, sharding
from gemmalab.train import optimization
from tests.helpers.models import VOCAB, _batch, _train, short_tiny
from tests.helpers.numerics import REORDERED_FLOAT32


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_weight_of_every_preset_has_a_rule(name):
    config = presets.model_config(name, 262_144 if name != "gemma3-tiny" else 600)
    model = presets.build_model(config, param_dtype=jnp.float32)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    device_mesh = mesh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    specs = jax.tree.leaves(sharding.param_sharding(abstract["params"], device_mesh))
    assert len(specs) == len(jax.tree.leaves(abstract["params"]))
    assert any(s.spec != jax.sharding.PartitionSpec() for s in specs)


def test_an_unknown_weight_is_an_error():
    with pytest.raises(ValueError, match="no sharding rule for parameter .*lora_a"):
        sharding.param_sharding({"layer_0": {"lora_a": jnp.zeros((4, 4))}}, mesh.make_mesh())


@pytest.fixture(scope="module")
def one_device():
    return _train({"data": 1}, jax.devices()[:1])


@pytest.mark.slow
def test_bfloat16_compute_on_a_3d_mesh_stays_close_to_one_device():
    reference, _ = _train({"data": 1}, jax.devices()[:1], compute_dtype=jnp.bfloat16)
    losses, _ = _train({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices(),
                       compute_dtype=jnp.bfloat16)
    np.testing.assert_allclose(losses, reference, rtol=PARITY_RTOL[jnp.bfloat16])


# The losses of a mesh against one device's (all of one sign and size: rtol is relative to
# their scale): float32 summed in another order (observed 1.2e-7 on every mesh below);
# bfloat16 compute rounded in another order on both sides and grown over the steps (observed
# 2.6e-4 (data=8) to 1.3e-3 (tensor=2 x data=4)).
PARITY_RTOL = {jnp.float32: REORDERED_FLOAT32, jnp.bfloat16: 1e-2}


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "q_shard"), [
    ({"data": 8}, (4, 128, 32)),
    ({"fsdp": 8}, (4, 16, 32)),
    ({"tensor": 2, "data": 4}, (2, 128, 32)),
    ({"data": 2, "fsdp": 2, "tensor": 2}, (2, 64, 32)),
])
def test_meshes_train_like_one_device_and_really_shard(one_device, shape, q_shard):
    reference, _ = one_device
    losses, state = _train(shape, jax.devices())
    np.testing.assert_allclose(losses, reference, rtol=PARITY_RTOL[jnp.float32])
    q = state.params["layer_0"]["attn"]["q_einsum"]["w"]
    assert q.addressable_shards[0].data.shape == q_shard
    # The optimizer moments live with their weight.
    mu = jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
    moments = next(x for x in mu if hasattr(x, "mu")).mu["layer_0"]["attn"]["q_einsum"]["w"]
    assert moments.sharding == q.sharding
    sizes = resolve_mesh_shape(shape, 8)
    full = sum(x.nbytes for x in jax.tree.leaves(state.params))
    per_device = sharding.shard_bytes(state.params)
    split = sizes["fsdp"] * sizes["tensor"]
    assert full / split <= per_device < full / split * 1.05  # norms (~1%) stay whole


@pytest.mark.slow
def test_lora_on_a_3d_mesh_trains_like_one_device():
    """LoRA's frozen base split by the rules, its replicated adapters: one device's losses."""
    reference, _, _ = _train({"data": 1}, jax.devices()[:1], steps=8, lora_rank=4)
    losses, state, frozen = _train({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices(), steps=8,
                                   lora_rank=4)
    np.testing.assert_allclose(losses, reference, rtol=PARITY_RTOL[jnp.float32])
    assert losses[-1] < losses[0]
    q = frozen["layer_0"]["attn"]["q_einsum"]["w"]
    assert q.addressable_shards[0].data.shape == (2, 64, 32)
    adapter = state.params["layer_0"]["attn"]["q_einsum"]["_LoRAEinsum_0"]["lora"]["a"]
    assert adapter.sharding.is_fully_replicated


@pytest.mark.slow
def test_qlora_on_a_3d_mesh_trains_like_one_device():
    """QLoRA: the nf4 base's values and scales split by the rules, one device's losses."""
    reference, _, _ = _train({"data": 1}, jax.devices()[:1], steps=8, lora_rank=4,
                             base_quantization="nf4")
    losses, _, frozen = _train({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices(), steps=8,
                               lora_rank=4, base_quantization="nf4")
    np.testing.assert_allclose(losses, reference, rtol=PARITY_RTOL[jnp.float32])
    assert losses[-1] < losses[0]
    q = frozen["layer_0"]["attn"]["q_einsum"]["w"]
    assert q.qvalue.addressable_shards[0].data.shape == (2, 64, 32)
    assert q.scale.addressable_shards[0].data.shape == (2, 2, 32)  # 128 / 32 groups over fsdp
    # (and not LoRA's losses over the unquantized base: the base really is quantized)
    plain, _, _ = _train({"data": 1}, jax.devices()[:1], steps=8, lora_rank=4)
    assert np.abs(plain - reference).max() > 1e-4


@pytest.mark.parametrize(("shape", "message"), [
    ({"data": 3}, "uses 3 devices but there are 8"),
    ({"data": 3, "fsdp": -1}, "cannot fill 8 devices"),
    ({"pipeline": 2}, "unknown axis 'pipeline'"),
    ({"data": -1, "fsdp": -1}, "more than one axis is -1"),
    ({"data": 0}, "size 0 of 'data' is not a positive integer"),
])
def test_bad_meshes_are_one_line_errors(shape, message):
    from gemmalab.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^mesh: .*{message}"):
        mesh.make_mesh(shape)


def test_default_and_rest_of_the_devices():
    assert resolve_mesh_shape(None, 8) == {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}
    assert resolve_mesh_shape({"fsdp": -1, "tensor": 2}, 8) == {"data": 1, "fsdp": 4, "expert": 1,
                                                                 "tensor": 2}
    assert mesh.data_parallel_size(mesh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})) == 4


@pytest.mark.slow
def test_two_simulated_slices_put_data_parallelism_across_them(one_device):
    """Multislice on simulated devices: fsdp inside each "slice" of 4, data across the 2."""
    hybrid = mesh.make_mesh({"fsdp": -1}, num_slices=2)
    assert mesh.mesh_shape(hybrid) == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
    ids = np.vectorize(lambda d: d.id)(hybrid.devices)
    assert sorted(ids[0].ravel()) == [d.id for d in jax.devices()[:4]]  # slice 0 ...
    assert sorted(ids[1].ravel()) == [d.id for d in jax.devices()[4:]]  # ... and slice 1
    losses, state = _train({"fsdp": -1}, jax.devices(), num_slices=2)
    np.testing.assert_allclose(losses, one_device[0], rtol=PARITY_RTOL[jnp.float32])
    linear = state.params["layer_0"]["mlp"]["linear"]
    assert linear.addressable_shards[0].data.shape == (linear.shape[0], linear.shape[1] // 4)


def test_slices_must_divide_the_devices():
    from gemmalab.errors import ConfigError

    with pytest.raises(ConfigError, match="^num_slices: 3 does not divide 8 devices"):
        mesh.make_mesh(None, num_slices=3)


@pytest.mark.slow
def test_gradient_accumulation_gives_the_same_updates_with_less_activation_memory(one_device):
    """Micro-batches give the same 20 losses as whole batches (float32) on a data x fsdp mesh,
    and the compiled step needs less temporary memory."""
    losses, _ = _train({"data": 2, "fsdp": 4}, jax.devices(), grad_accum_steps=2)
    np.testing.assert_allclose(losses, one_device[0], rtol=PARITY_RTOL[jnp.float32])

    model = presets.build_model(short_tiny(VOCAB), param_dtype=jnp.float32)
    params = presets.init_params(model, seed=0, sample_length=16)
    device_mesh = mesh.make_mesh({"data": 2, "fsdp": 4})
    schedule = optax.constant_schedule(1e-3)
    optimizer = optimization.make_optimizer(schedule, weight_decay=0.0, b1=0.9, b2=0.95,
                                            max_grad_norm=1.0)
    state, shardings = optimization.init_state(params, optimizer, device_mesh)
    batch = mesh.global_batch(_batch(rows=64, maxlen=64, vocab=VOCAB), device_mesh)

    def temp_bytes(accum):
        step = optimization.make_train_step(model, optimizer, schedule, jnp.float32,
                                            device_mesh, shardings, grad_accum_steps=accum)
        return step.lower(state, batch, None).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(4) < 0.6 * temp_bytes(1)


@pytest.mark.slow
def test_remat_gives_the_same_updates_with_less_activation_memory(one_device):
    """Recomputing blocks in the backward pass changes memory, not the 20 losses (float32); the
    compiled step's temporaries shrink from none to dots to full."""
    losses, _ = _train({"data": 2, "fsdp": 4}, jax.devices(), remat="full")
    np.testing.assert_allclose(losses, one_device[0], rtol=PARITY_RTOL[jnp.float32])

    device_mesh = mesh.make_mesh({"data": 2, "fsdp": 4})
    batch = mesh.global_batch(_batch(rows=64, maxlen=128, vocab=VOCAB), device_mesh)
    schedule = optax.constant_schedule(1e-3)
    optimizer = optimization.make_optimizer(schedule, weight_decay=0.0, b1=0.9, b2=0.95,
                                            max_grad_norm=1.0)

    def temp_bytes(remat):
        # All six layers: what remat saves grows with the layers, the loss's share does not.
        model = presets.build_model(presets.model_config("gemma3-tiny", VOCAB),
                                    param_dtype=jnp.float32, remat=remat)
        params = presets.init_params(model, seed=0, sample_length=16)
        state, shardings = optimization.init_state(params, optimizer, device_mesh)
        step = optimization.make_train_step(model, optimizer, schedule, jnp.float32, device_mesh,
                                            shardings)
        return step.lower(state, batch, None).compile().memory_analysis().temp_size_in_bytes

    none, dots, full = temp_bytes("none"), temp_bytes("dots"), temp_bytes("full")
    assert full < dots < 0.5 * none, (none, dots, full)


def test_remat_keeps_the_weight_names_and_rejects_unknown_policies():
    config = presets.model_config("gemma3-tiny", VOCAB)
    tokens = jnp.zeros((1, 8), jnp.int32)
    plain = jax.eval_shape(presets.build_model(config, param_dtype=jnp.float32).init,
                           jax.random.key(0), tokens)
    remat = jax.eval_shape(presets.build_model(config, param_dtype=jnp.float32, remat="dots").init,
                           jax.random.key(0), tokens)
    assert jax.tree.structure(plain) == jax.tree.structure(remat)
    with pytest.raises(ConfigError, match="^remat: unknown policy 'some'"):
        presets.build_model(config, param_dtype=jnp.float32, remat="some")


@pytest.mark.slow
def test_an_expert_axis_trains_a_mixture_like_one_device():
    """gemma4-tiny-moe's experts split over ``expert`` (and the batch over data x fsdp x
    expert) train as on one device, within the dense meshes' float32 tolerance."""
    moe = presets.model_config("gemma4-tiny-moe", VOCAB, num_layers=2)
    reference, _ = _train({"data": 1}, jax.devices()[:1], steps=8, config=moe)
    shape = {"data": 2, "fsdp": 2, "expert": 2}
    losses, state = _train(shape, jax.devices(), steps=8, config=moe)
    np.testing.assert_allclose(losses, reference, rtol=PARITY_RTOL[jnp.float32])
    experts = state.params["layer_0"]["mlp"]["gating_einsum"]["w"]
    assert experts.sharding.spec[0] == "expert"
    assert experts.addressable_shards[0].data.shape[0] == moe.num_experts // 2
    # LoRA, each expert's adapters with it, the experts' width split over tensor as well.
    reference, *_ = _train({"data": 1}, jax.devices()[:1], steps=8, config=moe, lora_rank=4)
    losses, state, _ = _train({"data": 2, "expert": 2, "tensor": 2}, jax.devices(), steps=8,
                              config=moe, lora_rank=4)
    np.testing.assert_allclose(losses, reference, rtol=PARITY_RTOL[jnp.float32])
    assert losses[-1] < losses[0] - 0.05  # the adapters trained


def test_an_expert_axis_is_refused_where_it_splits_nothing_or_unevenly():
    from gemmalab.config import EXPERT_COUNTS, PRESET_NAMES
    from gemmalab.data_parallel import check_expert_axis

    with pytest.raises(ConfigError, match="^mesh: an expert axis of 2 splits nothing: "
                                          "gemma3-tiny has no experts"):
        check_expert_axis({"expert": 2}, "gemma3-tiny")
    with pytest.raises(ConfigError, match="^mesh: the expert axis \\(3\\) does not divide "
                                          "gemma4-tiny-moe's 8 experts"):
        check_expert_axis({"expert": 3}, "gemma4-tiny-moe")
    check_expert_axis({"expert": 4}, "gemma4-tiny-moe")
    with pytest.raises(ConfigError, match="^expert_capacity_factor: bounds the tokens an expert "
                                          "axis exchanges, and mesh has none"):
        check_expert_axis({"data": 8}, "gemma4-tiny-moe", capacity_factor=1.5)
    check_expert_axis({"expert": 4}, "gemma4-tiny-moe", capacity_factor=1.5)
    check_expert_axis({"expert": 1}, "gemma3-tiny")
    # The ground's table is gemma's configs' (the cluster config checks without the model).
    assert {name: presets.expert_count(name) for name in PRESET_NAMES
            if presets.expert_count(name)} == EXPERT_COUNTS
