"""The tiny model cut short, its params and batches, the one-process sharded training that
tests/model/test_sharding.py compares meshes with (also run by tests/train/'s two processes), and
the equations of a traced model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gemmalab.model import lora, mesh, presets, quantization, sharding
from gemmalab.train import optimization

VOCAB = 64


def short_tiny(vocab: int, num_layers: int = 2):
    """The tiny preset cut to its last ``num_layers`` layers; two: a sliding-window one and the
    global one, every kind of weight and both kinds of attention, and a third of the six
    layers' unrolled program for XLA to compile (what these tests spend their time on); what
    ``TrainConfig.num_layers`` builds."""
    return presets.model_config("gemma3-tiny", vocab, num_layers)


def tiny_model(vocab: int, seed: int = 0):
    """``short_tiny`` at ``vocab`` and float32 random params drawn from ``seed``: one model
    object a vocabulary (so functions jitted over it compile once) and params built once a
    process (also train/test_dpo.py's). A train step donates its state: tests hand steps copies
    (``jax.tree.map(np.asarray, params)``)."""
    return _tiny_preset(vocab)[0], _tiny_params(vocab, seed)


@functools.cache
def _tiny_preset(vocab: int):
    model = presets.build_model(short_tiny(vocab), param_dtype=jnp.float32)
    # Jitted: flax's init run op by op compiles each op on its own (~10 s here).
    init = jax.jit(lambda key: model.init(key, jnp.zeros((1, 8), jnp.int32))["params"])
    return model, init


@functools.cache
def _tiny_params(vocab: int, seed: int):
    return _tiny_preset(vocab)[1](jax.random.key(seed))


def _batch(rows=8, maxlen=16, vocab=64, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab, size=(rows, maxlen)).astype(np.int32)
    segments = np.ones((rows, maxlen), np.int32)
    segments[:, maxlen // 2:] = 2
    segments[::2, -3:] = 0  # padding on half the rows
    positions = np.where(segments == 2, np.arange(maxlen) - maxlen // 2, np.arange(maxlen))
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1) * (segments > 0),
            "segment_ids": segments, "positions": positions.astype(np.int32),
            "loss_mask": (segments > 0).astype(np.int32)}


def _train(shape, devices, steps=20, compute_dtype=jnp.float32, num_slices=1,
           grad_accum_steps=1, remat="none", lora_rank=0, config=None, base_quantization="none"):
    """The losses of ``steps`` steps of ``config`` (default ``short_tiny``) on ``shape``, and the
    final state (with LoRA also the frozen base)."""
    config = short_tiny(VOCAB) if config is None else config
    device_mesh = mesh.make_mesh(shape, devices, num_slices=num_slices)
    model = presets.build_model(config, param_dtype=jnp.float32, remat=remat, mesh=device_mesh)
    params = presets.init_params(model, seed=0, sample_length=16)
    frozen = frozen_shardings = None
    if lora_rank:  # the base frozen (placed by the rules), adapters in the state
        frozen_shardings = sharding.param_sharding(params, device_mesh)
        frozen = quantization.quantize_base(jax.device_put(params, frozen_shardings),
                                            base_quantization, jnp.float32, device_mesh)
        frozen_shardings = sharding.param_sharding(frozen, device_mesh)
        model = lora.wrap(model, rank=lora_rank, alpha=2.0 * lora_rank, modules="all",
                          dtype=jnp.float32, mesh=device_mesh)
        params = lora.init_adapters(config, rank=lora_rank, modules="all", dtype="float32",
                                    seed=1)
    schedule = optimization.learning_rate_schedule(3e-3, steps, warmup_ratio=0.1, min_lr_ratio=0.1)
    optimizer = optimization.make_optimizer(schedule, weight_decay=0.01, b1=0.9, b2=0.95,
                                            max_grad_norm=1.0)
    state, shardings = optimization.init_state(params, optimizer, device_mesh)
    step = optimization.make_train_step(model, optimizer, schedule, compute_dtype, device_mesh,
                                        shardings, grad_accum_steps=grad_accum_steps,
                                        frozen_shardings=frozen_shardings)
    losses = []
    rows = 16 // jax.process_count()  # each process feeds its slice of the same global batch
    for i in range(steps):
        local = {k: v[jax.process_index() * rows:][:rows]
                 for k, v in _batch(rows=16, vocab=VOCAB, seed=i).items()}
        batch = mesh.global_batch(local, device_mesh)
        state, metrics = step(state, batch, frozen)
        losses.append(float(metrics["loss"]))
    if lora_rank:
        return np.asarray(losses), state, frozen
    return np.asarray(losses), state


def jaxpr_equations(jaxpr):
    """Every equation of ``jaxpr``, those of its sub-jaxprs (jit, remat, custom rules) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple | list) else (value,):
                if hasattr(inner, "eqns"):
                    yield from jaxpr_equations(inner)
                elif hasattr(inner, "jaxpr"):  # a closed jaxpr
                    yield from jaxpr_equations(inner.jaxpr)
