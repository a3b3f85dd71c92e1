"""Fused attention (gemmalab.model.attention) against gemma's own: the same loss, hidden states and
gradients on packed rows (several segments, padding, sliding-window layers whose window is
shorter than the row), with LoRA and remat, sharded over a mesh, and re-traced whenever the
implementation changes. Splash runs in Pallas' interpreter here; the TPU compile is below.

Tolerances: float32, REORDERED_FLOAT32 of each tensor's scale (the kernels sum in another
order). bfloat16: a fused kernel's error against the float32 reference is at most twice gemma's
own bfloat16 error plus 1% of the scale (the kernels keep scores in float32, gemma rounds them to
bf16).
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmalab import plan
from gemmalab.accelerators import GIB, Accelerator
from gemmalab.config import TrainConfig
from gemmalab.errors import ConfigError
from gemmalab.model import attention, lora, mesh, presets
from gemmalab.train import aot, optimization
from tests.helpers.models import short_tiny
from tests.helpers.numerics import REORDERED_FLOAT32

WINDOW = 16  # the tiny preset's local layers, narrowed well below the row
LENGTH = 96  # not a multiple of splash's 128 lanes: the kernel's padding is exercised
FUSED = ("dot_product", "splash", "blocked")
BLOCK_ROWS = 40  # "blocked": blocks of 40, 40 and 16 queries; a local block sees 55 keys or fewer


@pytest.fixture(scope="module")
def tiny():
    config = dataclasses.replace(short_tiny(600), sliding_window_size=WINDOW)
    assert WINDOW < LENGTH and len(set(config.attention_types)) == 2  # local and global layers
    params = presets.init_params(presets.build_model(config, param_dtype=jnp.float32), seed=0,
                                 sample_length=8)
    return config, params


@pytest.fixture(scope="module")
def gemma_runs(tiny):
    """gemma's own ``run`` of ``packed_batch(seed=seed)`` by ``(seed, dtype)``, computed once."""
    config, params = tiny
    done = {}

    def get(seed, dtype=jnp.float32):
        if (seed, dtype) not in done:
            done[seed, dtype] = run(build(config, "gemma"), params, packed_batch(seed=seed),
                                    dtype)
        return done[seed, dtype]

    return get


def packed_batch(rows: int = 4, seed: int = 0) -> dict[str, jax.Array]:
    """Rows of several stories each (positions restart at 0), the last ones padded."""
    rng = np.random.default_rng(seed)
    layouts = [[40, 30, 20], [96], [10, 5, 60], [70]]
    segment_ids = np.zeros((rows, LENGTH), np.int32)
    positions = np.zeros((rows, LENGTH), np.int32)
    for row in range(rows):
        start = 0
        for number, size in enumerate(layouts[row % len(layouts)], 1):
            segment_ids[row, start:start + size] = number
            positions[row, start:start + size] = np.arange(size)
            start += size
    tokens = np.where(segment_ids > 0, rng.integers(3, 600, (rows, LENGTH)), 0)
    targets = np.where(segment_ids > 0, rng.integers(3, 600, (rows, LENGTH)), 0)
    return {"tokens": jnp.asarray(tokens, jnp.int32), "targets": jnp.asarray(targets, jnp.int32),
            "segment_ids": jnp.asarray(segment_ids), "positions": jnp.asarray(positions),
            "loss_mask": jnp.asarray(segment_ids > 0, jnp.int32)}


def build(config, attention_name, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # splash interpreted off TPU: slow, said once
        model = presets.build_model(config, param_dtype=jnp.float32, attention=attention_name,
                                    **kwargs)
    if attention_name == "blocked":  # blocks shorter than the row, one shorter than the rest
        model = model.clone(attention=dataclasses.replace(model.attention,
                                                          block_rows=BLOCK_ROWS))
    return model


def run(model, params, batch, dtype=jnp.float32, frozen=None):
    """``(loss sum, hidden states, gradients)``, as the train step computes them."""
    def loss(p):
        return optimization.forward_loss(model, p, batch, dtype, frozen)[0]

    def hidden(p):
        p = presets.cast_params(p, dtype)
        if frozen is not None:
            p = lora.join(presets.cast_params(frozen, dtype), p)
        mask = (attention.segment_starts(batch["segment_ids"]) if attention.kernel_of(model)
                else optimization.attention_mask(batch["segment_ids"]))
        return model.apply({"params": p}, batch["tokens"], positions=batch["positions"],
                           attention_mask=mask, return_hidden_states=True).hidden_states

    total, grads = jax.jit(jax.value_and_grad(loss))(params)
    return total, jax.jit(hidden)(params).astype(jnp.float32), grads


def scaled_error(got, want, where=None):
    """Largest |got - want| over ``want``'s largest magnitude, at ``where`` (all if None)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if where is not None:
        got, want = got[where], want[where]
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def worst_grad_error(got, want):
    return max(scaled_error(g, w) for g, w in
               zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


# --- choosing ------------------------------------------------------------------------------

def test_an_unknown_implementation_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match=r"^attention: unknown implementation 'flash'\. Fix: "
                                          r"use one of \('auto', 'gemma'"):
        TrainConfig.flat(attention="flash")
    assert TrainConfig().model.attention == "auto"


@pytest.mark.parametrize(("platform", "chosen"), [("tpu", "splash"), ("gpu", "dot_product"),
                                                  ("cpu", "blocked")])
def test_auto_picks_the_platforms_kernel(platform, chosen):
    assert attention.resolve("auto", platform) == chosen
    assert attention.resolve("dot_product", platform) == "dot_product"


def test_a_soft_capped_model_refuses_dot_product_and_auto_falls_back_to_gemma():
    with pytest.raises(ConfigError, match="^attention: dot_product has no attention-logit soft"):
        attention.kernel_for("dot_product", platform="gpu", soft_cap=50.0)
    assert attention.kernel_for("auto", platform="gpu", soft_cap=50.0) is None
    assert attention.kernel_for("auto", platform="tpu", soft_cap=50.0).name == "splash"


def test_blocked_attention_computes_only_the_scores_its_queries_see():
    assert attention.blocks(96, 40, None) == [(0, 40, 0), (40, 80, 0), (80, 96, 0)]
    assert attention.blocks(96, 40, 16) == [(0, 40, 0), (40, 80, 25), (80, 96, 65)]
    assert attention.blocks(96, 128, None) == [(0, 96, 0)]  # one block: gemma's scores
    assert attention.blocked_score_share(96, 128, None) == 1.0
    assert attention.blocked_score_share(512, 128, None) == pytest.approx(5 / 8)
    assert attention.blocked_score_share(2048, 128, 512) == pytest.approx(0.2731, abs=1e-4)
    kernel = attention.kernel_for("blocked", platform="cpu", soft_cap=50.0)  # caps like gemma
    assert kernel.name == "blocked" and kernel.block_rows == attention.BLOCK_ROWS


def test_segment_starts_carry_the_segments():
    segment_ids = packed_batch()["segment_ids"]
    starts = attention.segment_starts(segment_ids)
    assert starts.shape == (*segment_ids.shape, 1) and starts.dtype == jnp.bool_
    ids = np.asarray(attention.segments_from_starts(starts))
    same = np.asarray(segment_ids)[:, :, None] == np.asarray(segment_ids)[:, None, :]
    # The same partition of each row (padding its own segment), only renumbered.
    np.testing.assert_array_equal(ids[:, :, None] == ids[:, None, :], same)


# --- numerics against gemma's attention ------------------------------------------------------

@pytest.mark.parametrize("name", FUSED)
@pytest.mark.slow
def test_float32_loss_hidden_states_and_gradients_match_gemma(tiny, gemma_runs, name):
    config, params = tiny
    batch = packed_batch()
    real = np.asarray(batch["segment_ids"]) > 0  # padding's outputs bear no loss
    want_loss, want_hidden, want_grads = gemma_runs(0)
    loss, hidden, grads = run(build(config, name), params, batch)
    assert float(loss) == pytest.approx(float(want_loss), rel=REORDERED_FLOAT32)
    assert scaled_error(hidden, want_hidden, real) < REORDERED_FLOAT32
    assert worst_grad_error(grads, want_grads) < REORDERED_FLOAT32


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.slow
def test_bfloat16_error_is_no_worse_than_gemmas_own(tiny, gemma_runs, name):
    config, params = tiny
    batch = packed_batch(seed=1)
    real = np.asarray(batch["segment_ids"]) > 0
    exact_loss, exact_hidden, exact_grads = gemma_runs(1)
    gemma_loss, gemma_hidden, gemma_grads = gemma_runs(1, jnp.bfloat16)
    loss, hidden, grads = run(build(config, name), params, batch, jnp.bfloat16)
    assert abs(float(loss - exact_loss)) <= 2 * abs(float(gemma_loss - exact_loss)) + \
        1e-3 * abs(float(exact_loss))
    assert scaled_error(hidden, exact_hidden, real) <= \
        2 * scaled_error(gemma_hidden, exact_hidden, real) + 0.01
    assert worst_grad_error(grads, exact_grads) <= 2 * worst_grad_error(gemma_grads,
                                                                        exact_grads) + 0.01


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.slow
def test_lora_adapters_train_through_the_fused_kernel(tiny, name):
    """LoRA wraps Attention's einsums: the fused path calls those same submodules, so the
    adapters on q/kv/output get the gradients they get under gemma's attention."""
    config, params = tiny
    batch = packed_batch()
    adapters = lora.init_adapters(config, rank=4, modules="attention", dtype="float32", seed=1)
    leaves, tree = jax.tree.flatten(adapters)  # b != 0, as after some training
    keys = jax.random.split(jax.random.key(2), len(leaves))
    adapters = jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape) for k, x in
                                         zip(keys, leaves, strict=True)])

    def wrapped(attention_name):
        return lora.wrap(build(config, attention_name), rank=4, alpha=8.0, modules="attention",
                         dtype=jnp.float32)

    model = wrapped(name)
    assert attention.kernel_of(model).name == name
    want_loss, _, want_grads = run(wrapped("gemma"), adapters, batch, frozen=params)
    loss, _, grads = run(model, adapters, batch, frozen=params)
    assert float(loss) == pytest.approx(float(want_loss), rel=REORDERED_FLOAT32)
    assert worst_grad_error(grads, want_grads) < REORDERED_FLOAT32
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


@pytest.mark.slow
def test_remat_recomputes_the_fused_kernel(tiny, gemma_runs):
    config, params = tiny
    batch = packed_batch()
    want_loss, _, want_grads = gemma_runs(0)
    loss, _, grads = run(build(config, "dot_product", remat="full"), params, batch)
    assert float(loss) == pytest.approx(float(want_loss), rel=REORDERED_FLOAT32)
    assert worst_grad_error(grads, want_grads) < REORDERED_FLOAT32


@pytest.mark.slow
def test_splash_runs_each_devices_rows_and_heads_under_shard_map(tiny, gemma_runs):
    """8 CPU devices as data 4 x tensor 2: each runs its row and its half of the heads."""
    config, params = tiny
    device_mesh = mesh.make_mesh({"data": 4, "tensor": 2})
    batch = jax.device_put(packed_batch(), mesh.batch_sharding(device_mesh))
    specs = attention._shard_specs(device_mesh, 4, config.num_heads, config.num_kv_heads)
    assert specs[0] == jax.sharding.PartitionSpec("data", "tensor", None, None)
    want_loss, _, want_grads = gemma_runs(0)
    loss, _, grads = run(build(config, "splash", mesh=device_mesh), params, batch)
    assert float(loss) == pytest.approx(float(want_loss), rel=REORDERED_FLOAT32)
    assert worst_grad_error(grads, want_grads) < REORDERED_FLOAT32


# --- tracing: the implementation is part of the model's static key ---------------------------

@pytest.mark.slow
def test_switching_implementation_in_one_process_retraces(tiny, monkeypatch):
    """gemma jit-compiles Transformer.__call__ with the module static: equal-looking models
    would share a trace. Each implementation here must run its own kernel, eagerly called with
    the same shapes, one after the other (gemma's again last)."""
    config, params = tiny
    batch = packed_batch(rows=2)
    ran = []
    fused_attend = attention.attend
    monkeypatch.setattr(attention, "attend",
                        lambda *args: ran.append(args[-1].name) or fused_attend(*args))
    outputs = {}
    for name in ("gemma", *FUSED, "gemma"):
        ran.clear()
        model = build(config, name)
        mask = (attention.segment_starts(batch["segment_ids"]) if attention.kernel_of(model)
                else optimization.attention_mask(batch["segment_ids"]))
        outputs[name] = model.apply({"params": params}, batch["tokens"],
                                    positions=batch["positions"], attention_mask=mask).logits
        assert ran == ([] if name == "gemma" else [name] * config.num_layers), name
    real = np.asarray(batch["segment_ids"]) > 0
    for name in FUSED:
        assert scaled_error(outputs[name], outputs["gemma"], real) < REORDERED_FLOAT32


@pytest.mark.slow
def test_dense_masks_and_kv_caches_stay_on_gemmas_code(tiny, monkeypatch):
    """The sampler's paths (a KV cache; the scorer's dense causal mask; model.init) are not
    intercepted, and give gemma's own results."""
    config, params = tiny
    monkeypatch.setattr(attention, "attend", lambda *args: pytest.fail("intercepted"))
    gemma, fused = build(config, "gemma"), build(config, "splash")
    tokens = packed_batch(rows=1)["tokens"][:, :12]
    plain = [m.apply({"params": params}, tokens).logits for m in (gemma, fused)]
    np.testing.assert_array_equal(plain[0], plain[1])

    def prefill(model):
        cache = model.init_cache(batch_size=1, dtype=jnp.float32, cache_length=16)
        causal = jnp.tril(jnp.ones((12, 16), bool))[None]
        return model.apply({"params": params}, tokens, positions=jnp.arange(12)[None],
                           cache=cache, attention_mask=causal).logits

    np.testing.assert_array_equal(prefill(gemma), prefill(fused))


def test_the_memory_plan_counts_no_scores_for_splash():
    """The analytic plan: with splash (auto on a TPU) a step's activations do not grow with
    maxlen at a fixed token count, as compiled (docs/benchmarks/attention.md: 9.2 GiB of temporaries
    for gemma3-270m from maxlen 256 to 8192); gemma's keep growing with the scores."""
    def activations(maxlen, name, accelerator="v6e:1x1"):
        config = TrainConfig.flat(model="gemma3-270m", tokenizer="gemma3", maxlen=maxlen,
                             batch_size=16384 // maxlen, attention=name)
        return plan.estimate(config, accelerator).breakdown["activations"]

    assert activations(8192, "splash") == activations(1024, "splash")
    assert activations(8192, "gemma") > 2 * activations(1024, "gemma")
    assert activations(8192, "auto") == activations(8192, "splash")
    assert activations(8192, "auto", "h200") == activations(8192, "gemma", "h200")
    # On a CPU "auto" is blocked: a causal row's blocks keep 5/8 of gemma's scores at 512.
    cpu = Accelerator("cpu", 1, 24 * GIB, None)
    gemma, blocked, splash = (activations(512, name, cpu) for name in ("gemma", "auto", "splash"))
    assert splash < blocked < gemma
    model = presets.model_config("gemma3-270m", 262_144)
    kept = (model.num_layers + 1) * 32 * 512  # every layer's (no remat) and one working block
    scores = kept * model.num_heads * 512 * 2 * 4  # per token: a row of scores and of probs
    assert gemma - blocked == pytest.approx(scores * 3 / 8, abs=kept)

    # Gemma 4 runs gemma's own attention whatever "auto" picks (no kernel reads it).
    def gemma4(name, accelerator):
        config = TrainConfig.flat(model="gemma4-e2b", tokenizer="gemma4", maxlen=2048,
                                  batch_size=8, attention=name)
        return plan.estimate(config, accelerator).breakdown["activations"]

    for accelerator in ("v6e:1x1", cpu):
        assert gemma4("auto", accelerator) == gemma4("gemma", accelerator)


# --- a whole run -----------------------------------------------------------------------------

@pytest.mark.slow
def test_a_run_trains_evaluates_and_samples_with_a_fused_kernel(tmp_path, cache_dir,
                                                                stories_file):
    """TrainConfig.attention reaches the run's model: the same eval losses as gemma's attention
    (float32), and the sampler (KV cache, gemma's code) works on the fused model."""
    from gemmalab.train.experiment import Experiment
    from tests.helpers import PROMPT
    from tests.helpers.runs import small_config

    runs = {}
    for name in ("gemma", "dot_product"):
        experiment = Experiment.prepare(small_config(
            tmp_path / name, cache_dir, stories_file, attention=name, max_steps=3, eval_every=0,
            compute_dtype="float32"))
        kernel = attention.kernel_of(experiment.model)
        assert (kernel.name if kernel else "gemma") == name
        summary = experiment.train(progress=False)
        runs[name] = summary, experiment.sample(PROMPT, max_new_tokens=8).text
    (gemma, _), (fused, sample) = runs["gemma"], runs["dot_product"]
    # The same params: float32 summed in another order; after 3 steps, the same grown by the
    # updates.
    assert fused["initial_eval_loss"] == pytest.approx(gemma["initial_eval_loss"],
                                                       rel=REORDERED_FLOAT32)
    assert fused["final_eval_loss"] == pytest.approx(gemma["final_eval_loss"], rel=1e-4)
    assert isinstance(sample, str) and sample


# --- the TPU compile: libtpu AOT, no chip needed ---------------------------------------------

needs_libtpu = pytest.mark.skipif(plan.find_libtpu() is None,
                                  reason="libtpu is not installed (`make libtpu`; x86-64 Linux)")


@needs_libtpu
@pytest.mark.slow
@pytest.mark.timeout(1200)  # three libtpu compiles: 480 s measured, 2 workers
def test_splash_compiles_for_tpu_and_needs_less_temporary_memory():
    """The train step with splash, lowered and compiled by libtpu for v6e chips: the Mosaic
    kernel compiles, alone and under shard_map, and the step's temporaries shrink (no
    [B, N, L, L] scores kept: 36 vs 133 MB here). One libtpu subprocess for the three."""
    config = TrainConfig.flat(model="gemma3-tiny", tokenizer_vocab_size=600, batch_size=2,
                         maxlen=1024, compute_dtype="bfloat16")
    # Four chips, rows over data and heads over tensor (shard_map), blocks rematerialised.
    split = config.replace(attention="splash", batch_size=8, maxlen=256,
                                mesh={"data": 2, "tensor": 2}, remat="full")
    gemma, splash, shard_mapped = aot.compile_plans(
        [(config.replace(attention="gemma"), "v6e:1x1"),
         (config.replace(attention="splash"), "v6e:1x1"), (split, "v6e:2x2")])
    assert splash.breakdown["temporaries"] < 0.5 * gemma.breakdown["temporaries"]
    assert shard_mapped.method == "compiled"
