"""The memory planner: accelerators, the analytic plan against real shards, the roofline time
against the tutorial's published run, the refusal in Experiment.prepare, and the exact plan
compiled by libtpu for a TPU topology."""

import dataclasses
import json
import re
from collections import namedtuple

import jax
import jax.numpy as jnp
import pytest

from gemmalab import accelerators, plan
from gemmalab.config import EMBEDDED_PREFERENCES, TrainConfig
from gemmalab.data import documents, packing, token_cache
from gemmalab.errors import ConfigError
from gemmalab.model import lora, mesh, presets, quantization, sharding
from gemmalab.plan import exact
from gemmalab.train import aot, optimization
from gemmalab.train.experiment import Experiment

GIB = plan.GIB


@pytest.mark.parametrize(("spec", "chips", "memory_gib", "platform"), [
    ("v6e:2x4", 8, 32, "tpu"), ("v6e", 1, 32, "tpu"), ("V5P:2x2x2", 8, 95, "tpu"),
    ("v5e:4x4", 16, 16, "tpu"), ("h200", 1, 140.4, "gpu"), ("h100:8", 8, 79.6, "gpu"),
])
def test_accelerators(spec, chips, memory_gib, platform):
    accelerator = plan.parse_accelerator(spec)
    assert accelerator.chips == chips and accelerator.platform == platform
    assert accelerator.memory_bytes == pytest.approx(memory_gib * GIB, rel=1e-6)
    assert accelerator.peak_flops > 1e14
    assert accelerator.hbm_bytes_per_s == plan.CHIPS[accelerator.kind].hbm_gb_s * 1e9 > 8e11


@pytest.mark.parametrize(("spec", "fragment"), [
    ("v7x:2x2", "unknown accelerator 'v7x:2x2'"), ("v6e:2x2x2", "is not a v6e topology"),
    ("v5p:4x4", "is not a v5p topology"), ("h200:two", "a GPU count must be a positive integer"),
])
def test_bad_accelerators_are_one_line_errors(spec, fragment):
    with pytest.raises(ConfigError, match="^accelerator: ") as error:
        plan.parse_accelerator(spec)
    assert fragment in str(error.value) and "Fix: " in str(error.value)


def _tiny(**overrides):
    values = dict(model="gemma3-tiny", tokenizer_vocab_size=600, batch_size=16, maxlen=64,
                  compute_dtype="float32")
    return TrainConfig.flat(**{**values, **overrides})


@pytest.mark.parametrize("shape", [{"data": 8}, {"fsdp": 8}, {"data": 2, "fsdp": 2, "tensor": 2}])
@pytest.mark.slow
def test_weights_and_optimizer_bytes_are_those_of_the_real_shards(shape):
    """The plan cuts the real parameter shapes with the real rules: its per-device params and
    optimizer bytes are what init_state places on each of 8 CPU devices."""
    config = _tiny(mesh=shape)
    estimate = plan.estimate(config, plan.attached_accelerator())
    model = presets.build_model(presets.model_config("gemma3-tiny", 600), param_dtype=jnp.float32)
    params = presets.init_params(model, seed=0, sample_length=8)
    optimizer = optimization.make_optimizer(optimization.learning_rate_schedule(
        1e-3, 10, warmup_ratio=0.0, min_lr_ratio=1.0), weight_decay=0.0, b1=0.9, b2=0.95,
        max_grad_norm=1.0)
    state, _ = optimization.init_state(params, optimizer, mesh.make_mesh(shape))
    assert estimate.mesh == {**{"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}, **shape}
    assert estimate.breakdown["params"] == sharding.shard_bytes(state.params)
    # AdamW's moments, plus its step counters (a few bytes).
    assert sharding.shard_bytes(state.opt_state) - estimate.breakdown["optimizer"] in range(0, 64)
    assert estimate.num_params == presets.parameter_count(params)


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_a_qlora_plan_holds_the_quantized_base_the_run_holds(fmt):
    """QLoRA: the base's bytes per device are those of the tree a run quantizes into its shards
    (values at their bits, scales in the compute dtype), plus the adapters."""
    shape = {"data": 2, "fsdp": 2, "tensor": 2}
    config = _tiny(mesh=shape, lora_rank=4, compute_dtype="bfloat16", base_quantization=fmt)
    estimate = plan.estimate(config, plan.attached_accelerator())
    model_config = presets.model_config("gemma3-tiny", 600)
    device_mesh = mesh.make_mesh(shape)
    base = presets.init_params(presets.build_model(model_config, param_dtype=jnp.bfloat16),
                               seed=0, sample_length=8)
    base = quantization.quantize_base(jax.device_put(base, sharding.param_sharding(
        base, device_mesh)), fmt, jnp.bfloat16, device_mesh)
    adapters = lora.abstract_adapters(model_config, rank=4, modules="all", dtype="float32")
    assert estimate.breakdown["params"] == sharding.shard_bytes(base) + 4 * sum(
        x.size for x in jax.tree.leaves(adapters))
    assert estimate.breakdown["dequantized"] > 0
    plain = plan.estimate(config.replace(base_quantization="none"), plan.attached_accelerator())
    assert estimate.breakdown["params"] < plain.breakdown["params"]


def test_gemma3_27b_qlora_fits_one_v6e_chip_where_lora_does_not():
    """The headline: nf4's base is ~4.56 bits a projection weight (a bfloat16 scale per 32), the
    embedding bfloat16: 27B's LoRA r16 at 8 x 1024 with remat fits a v6e chip's 30.4 GiB."""
    config = TrainConfig.flat(model="gemma3-27b", tokenizer="gemma3", lora_rank=16,
                              batch_size=8, maxlen=1024, remat="full", base_quantization="nf4")
    qlora = plan.estimate(config, "v6e:1x1")
    lora_plan = plan.estimate(config.replace(base_quantization="none"), "v6e:1x1")
    assert qlora.fits and not lora_plan.fits
    model_config = presets.model_config("gemma3-27b", 262_144)
    embedding = model_config.num_embed * model_config.embed_dim
    projections = qlora.num_params - qlora.trainable_params - embedding - sum(
        x.size for x in jax.tree.leaves(plan.abstract_params(model_config, "bfloat16"))
        if x.ndim == 1)
    expected = 2 * embedding + projections * (0.5 + 2 / 32) + 4 * qlora.trainable_params
    assert qlora.breakdown["params"] == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("shape", [{"data": 8}, {"fsdp": 8}])
@pytest.mark.slow
def test_a_lora_plan_holds_the_frozen_base_once_and_trains_only_adapters(shape):
    """LoRA: the base weights in the compute dtype, cut by the rules, plus replicated adapters
    and their moments: the bytes a LoRA run's state and frozen base take on each device."""
    config = _tiny(mesh=shape, lora_rank=4, compute_dtype="bfloat16")
    estimate = plan.estimate(config, plan.attached_accelerator())
    model_config = presets.model_config("gemma3-tiny", 600)
    device_mesh = mesh.make_mesh(shape)
    base = presets.init_params(presets.build_model(model_config, param_dtype=jnp.bfloat16),
                               seed=0, sample_length=8)
    base = jax.device_put(base, sharding.param_sharding(base, device_mesh))
    adapters = lora.init_adapters(model_config, rank=4, modules="all", dtype="float32", seed=0)
    optimizer = optimization.make_optimizer(optimization.learning_rate_schedule(
        1e-3, 10, warmup_ratio=0.0, min_lr_ratio=1.0), weight_decay=0.0, b1=0.9, b2=0.95,
        max_grad_norm=1.0)
    state, _ = optimization.init_state(adapters, optimizer, device_mesh)
    assert estimate.breakdown["params"] == (sharding.shard_bytes(base)
                                            + sharding.shard_bytes(state.params))
    assert sharding.shard_bytes(state.opt_state) - estimate.breakdown["optimizer"] in range(0, 64)
    # Gradients (compute dtype) of the adapters alone.
    assert estimate.breakdown["gradients"] == 2 * presets.parameter_count(adapters)
    full = plan.estimate(config.replace(lora_rank=0), plan.attached_accelerator())
    # No gradient for frozen weights: about 4 FLOPs per weight and token instead of 6.
    assert estimate.flops_per_step / full.flops_per_step == pytest.approx(4 / 6, abs=0.06)


def test_memory_moves_the_way_each_knob_says():
    accelerator = plan.parse_accelerator("v6e:2x4")
    base = _tiny(model="gemma3-1b", tokenizer="gemma3", batch_size=32, maxlen=512,
                 compute_dtype="bfloat16")
    parts = {name: plan.estimate(base.replace(**change), accelerator).breakdown
             for name, change in {
                 "data": {}, "fsdp": {"mesh": {"fsdp": -1}}, "dots": {"remat": "dots"},
                 "full": {"remat": "full"}, "accum": {"grad_accum_steps": 4}}.items()}
    assert parts["fsdp"]["params"] == pytest.approx(parts["data"]["params"] / 8, rel=0.01)
    assert parts["fsdp"]["optimizer"] == 2 * parts["fsdp"]["params"]
    assert parts["data"]["activations"] > parts["dots"]["activations"] > parts["full"][
        "activations"]
    assert parts["accum"]["activations"] < parts["data"]["activations"] / 3
    # The float32 accumulator beside the bfloat16 gradients.
    assert parts["accum"]["gradients"] == parts["data"]["gradients"] + parts["data"]["params"]


def test_flops_per_step_follow_six_n_t():
    config = _tiny(model="gemma3-270m", tokenizer="gemma3", batch_size=8, maxlen=128)
    estimate = plan.estimate(config, "v6e")
    six_nt = 6 * estimate.num_params * 8 * 128
    assert six_nt < estimate.flops_per_step < 1.2 * six_nt  # plus attention's share
    assert estimate.step_seconds_at_peak == pytest.approx(
        estimate.flops_per_step / 918e12, rel=1e-9)


def test_a_plan_is_written_as_json_with_the_contract_keys():
    document = json.loads(json.dumps(plan.estimate(_tiny(), "v6e:2x2").to_dict()))
    assert document["fits"] is True and document["accelerator"] == "v6e:2x2"
    assert document["per_device_gib"] == pytest.approx(
        sum(document["breakdown_bytes"].values()) / GIB, abs=1e-3)
    assert document["device_hbm_gib"] == 32 and document["mesh"] == {"data": 4, "fsdp": 1,
                                                                     "expert": 1, "tensor": 1}


# --- the time plan: a roofline, against the tutorial's published run -------------------------

# The tutorial's run: Gemma3-270M fully fine-tuned, AdamW, 96,000 stories one a row in batches of
# 128 x 256 (750 steps) on one v6e chip, in 294.7 s (~83k padded tokens/s, ~15% MFU).
TUTORIAL = TrainConfig.flat(model="gemma3-270m", tokenizer="gemma3", batch_size=128, maxlen=256,
                       datacount=96_000, lora_rank=0)
TUTORIAL_SECONDS = 294.7


def test_the_roofline_of_the_tutorials_run_is_a_floor_under_its_measured_time():
    memory_plan = plan.estimate(TUTORIAL, "v6e", price_per_chip_hour=2.7)
    roof = memory_plan.roofline
    assert roof.run_steps == 750 and roof.chips == 1
    # An upper bound on speed is never slower than a real run, and not absurdly faster.
    assert TUTORIAL_SECONDS * 0.05 < roof.run_seconds < TUTORIAL_SECONDS
    assert roof.tokens_per_s > 96_000 * 256 / TUTORIAL_SECONDS
    # The compute term alone is the model FLOPs at the peak: the published ~15% MFU.
    assert roof.compute_seconds == pytest.approx(memory_plan.flops_per_step / 918e12, rel=1e-12)
    assert 750 * roof.compute_seconds / TUTORIAL_SECONDS == pytest.approx(0.15, abs=0.01)
    # Memory-bound: at embed width 640 the 262k-vocabulary logits (written and read in the
    # compute dtype) and the loss's per-chunk reads of the embedding outweigh the FLOPs on a
    # v6e (918 TFLOP/s over 1,640 GB/s: 560 FLOPs a byte) ...
    assert roof.bound == "memory" and roof.step_seconds == roof.memory_seconds
    assert max(memory_plan.traffic, key=memory_plan.traffic.get) == "logits"
    assert roof.memory_seconds == pytest.approx(memory_plan.bytes_per_device / 1640e9, rel=1e-12)
    # ... but not on an H200 (989 TFLOP/s over 4,800 GB/s: 206 FLOPs a byte).
    assert plan.estimate(TUTORIAL, "h200").roofline.bound == "compute"
    assert roof.cost == roof.run_seconds / 3600 * 1 * 2.7


def test_a_tiny_batch_is_memory_bound_and_a_long_wide_one_compute_bound():
    tiny = plan.estimate(TUTORIAL.replace(batch_size=1, maxlen=16), "v6e")
    assert tiny.roofline.bound == "memory"
    assert max(tiny.traffic, key=tiny.traffic.get) == "optimizer"  # AdamW's pass over 268M
    wide = plan.estimate(TrainConfig.flat(model="gemma3-4b", tokenizer="gemma3", batch_size=8,
                                     maxlen=2048), "v6e")
    assert wide.roofline.bound == "compute"
    assert wide.roofline.step_seconds == wide.step_seconds_at_peak


def test_the_run_length_and_cost_follow_the_config_and_the_chips():
    accelerator = plan.parse_accelerator("v6e:2x4")
    two_epochs = plan.estimate(TUTORIAL.replace(num_epochs=2), accelerator,
                               price_per_chip_hour=1.5).roofline
    assert two_epochs.run_steps == 1500 and two_epochs.chips == 8
    assert two_epochs.run_seconds == 1500 * two_epochs.step_seconds
    assert two_epochs.cost == two_epochs.run_seconds / 3600 * 8 * 1.5
    assert two_epochs.tokens_per_s == 128 * 256 / two_epochs.step_seconds
    # max_steps replaces the epochs; the last partial batch is a step.
    assert plan.run_steps(TUTORIAL.replace(max_steps=40, num_epochs=3).trainer, None) == 40
    assert plan.run_steps(TUTORIAL.trainer, 1000) == 8
    # Micro-batches split the same rows: the same tokens a step.
    accumulated = plan.estimate(TUTORIAL.replace(grad_accum_steps=4), "v6e")
    assert accumulated.roofline.tokens_per_step == 128 * 256
    unknown = plan.estimate(TUTORIAL.replace(datacount=None), "v6e",
                            price_per_chip_hour=2.7)
    document = json.loads(json.dumps(unknown.to_dict()))["roofline"]
    assert document["run_steps"] is None and document["run_seconds"] is None
    assert document["cost"] is None and document["step_seconds"] > 0
    assert "upper bound on speed" in document["note"] and "run length unknown" in document["note"]
    assert "run length unknown" in unknown.roofline_line()


def test_the_plan_json_carries_the_roofline():
    memory_plan = plan.estimate(TUTORIAL, "v6e", price_per_chip_hour=2.7)
    document = json.loads(json.dumps(memory_plan.to_dict()))
    roof = document["roofline"]
    assert roof["bound"] == "memory" and roof["run_steps"] == 750
    assert roof["bytes_source"] == "analytic lower bound"
    assert roof["note"].startswith("an upper bound on speed (a floor on time)")
    assert roof["step_seconds"] == max(roof["compute_seconds"], roof["memory_seconds"])
    assert roof["cost"] == pytest.approx(roof["run_seconds"] / 3600 * 2.7, rel=1e-12)
    assert document["bytes_per_device"] == sum(memory_plan.traffic.values())
    assert set(document["traffic_gib"]) == {"weights", "gradients", "optimizer", "activations",
                                            "logits"}
    line = memory_plan.roofline_line()
    assert line.startswith("roofline (upper bound on speed): step >= ") and "750 steps" in line


def test_cpus_have_no_roofline():
    memory_plan = plan.estimate(_tiny(), plan.attached_accelerator())
    assert memory_plan.roofline is None and memory_plan.bytes_per_device > 0
    document = memory_plan.to_dict()["roofline"]
    assert document["step_seconds"] is None and "no roofline" in document["note"]


def test_the_plan_counts_the_loss_chunk_of_its_platform():
    """A CPU's loss holds half an accelerator's logits a chunk (``cross_entropy.chunk_logits``):
    the 270M's 8 x 128 batch (1,024 tokens of 262,144 logits) in two chunks of 512 tokens there,
    in one on a v6e; the plan's logits part counts 6 bytes a logit of one chunk."""
    from gemmalab.model import cross_entropy
    from gemmalab.plan import roofline

    config = TrainConfig.flat(model="gemma3-270m", tokenizer="gemma3", batch_size=8, maxlen=128,
                              lora_rank=8, mesh={"data": 1})
    vocab = 262_144
    assert cross_entropy.chunk_logits("cpu") * 2 == cross_entropy.chunk_logits("tpu")
    cpu = accelerators.Accelerator("cpu", 1, 24 << 30, None)
    on_cpu = plan.estimate(config, cpu).breakdown["logits"]
    on_tpu = plan.estimate(config, "v6e").breakdown["logits"]
    assert (on_cpu, on_tpu) == (6 * 512 * vocab, 6 * 1024 * vocab)
    assert [roofline.loss_chunks(config.trainer, 128, vocab, platform)
            for platform in ("cpu", "tpu", "gpu")] == [2, 1, 1]


@pytest.mark.parametrize(("price", "fragment"), [
    (-1, "-1 is negative"), ("2.7", "'2.7' is not a number"), (float("nan"), "nan is not"),
    (True, "True is not a number"), (float("inf"), "inf is not a number"),
])
def test_bad_prices_are_one_line_errors(price, fragment):
    with pytest.raises(ConfigError, match="^price_per_chip_hour: ") as error:
        plan.estimate(_tiny(), "v6e", price_per_chip_hour=price)
    assert fragment in str(error.value) and "Fix: " in str(error.value)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="^price_per_chip_hour: "):  # before any compiling
        aot.compile_plan(_tiny(), "v6e", price_per_chip_hour=price)


# --- DPO: the reference model's forward pass, and full fine-tuning's reference copy ---------


def _sft_and_dpo(accelerator, **overrides):
    config = TrainConfig.flat(**{**dict(model="gemma3-1b", tokenizer="gemma3", batch_size=32,
                                   maxlen=512, compute_dtype="bfloat16"), **overrides})
    dpo = config.replace(objective="dpo", data_path=EMBEDDED_PREFERENCES)
    return plan.estimate(config, accelerator), plan.estimate(dpo, accelerator)


def test_dpo_segments_a_row_are_bounded_by_the_shortest_pair():
    assert [plan.preference_segments_bound(n) for n in (8, 18, 64, 512, 2048)] == [
        2, 2, 6, 56, 226]


@pytest.mark.parametrize("shape", [None, {"fsdp": -1}])
def test_full_fine_tuning_dpo_holds_a_compute_dtype_reference_copy_cut_like_the_params(shape):
    accelerator = plan.parse_accelerator("v6e:2x4")
    sft, dpo = _sft_and_dpo(accelerator, mesh=shape)
    # The starting weights in bfloat16, sharded like the float32 master params: half their bytes.
    assert 2 * dpo.breakdown["reference"] == sft.breakdown["params"] == dpo.breakdown["params"]
    if shape:  # fsdp: an eighth of the model's bfloat16 bytes on each device
        assert dpo.breakdown["reference"] == pytest.approx(2 * sft.num_params / 8, rel=0.01)
    same = ("params", "optimizer", "gradients", "logits", "batch", "code")
    assert {k: dpo.breakdown[k] for k in same} == {k: sft.breakdown[k] for k in same}
    assert dpo.num_params == sft.num_params and dpo.trainable_params == sft.trainable_params
    # The reference's forward pass keeps nothing for a backward pass: its final hidden states
    # and the segments' float32 one-hot of the per-segment losses, a token each.
    tokens = 32 // 8 * 512
    assert dpo.breakdown["activations"] - sft.breakdown["activations"] == tokens * (
        1152 * 2 + plan.preference_segments_bound(512) * 4)
    # Under fsdp its weights are gathered for its forward pass: the embedding and two blocks
    # (bfloat16); without fsdp nothing is gathered.
    copies = dpo.breakdown["weight_copies"] - sft.breakdown["weight_copies"]
    if shape:
        layer = presets.parameter_count(plan.abstract_params(
            presets.model_config("gemma3-1b", plan.GEMMA3_VOCAB), "float32")["layer_0"])
        assert copies == pytest.approx(2 * (plan.GEMMA3_VOCAB * 1152 + 2 * layer), rel=0.01)
    else:
        assert copies == 0
    assert dpo.per_device_bytes - sft.per_device_bytes == (
        dpo.breakdown["reference"] + copies + dpo.breakdown["activations"]
        - sft.breakdown["activations"])
    document = json.loads(json.dumps(dpo.to_dict()))
    assert document["objective"] == "dpo" and sft.to_dict()["objective"] == "sft"
    assert document["breakdown_bytes"]["reference"] == dpo.breakdown["reference"]
    assert "reference" not in sft.breakdown
    assert "(DPO)" in dpo.summary_line() and "(" not in sft.summary_line().split(" on ")[0]


@pytest.mark.parametrize("shape", [None, {"fsdp": -1}])
def test_lora_dpo_adds_no_weights_its_reference_is_the_frozen_base(shape):
    sft, dpo = _sft_and_dpo(plan.parse_accelerator("v6e:2x4"), mesh=shape, lora_rank=8)
    assert "reference" not in dpo.breakdown
    for part in ("params", "optimizer", "gradients", "weight_copies", "logits", "batch"):
        assert dpo.breakdown[part] == sft.breakdown[part], part
    assert 0 < dpo.per_device_bytes - sft.per_device_bytes == (
        dpo.breakdown["activations"] - sft.breakdown["activations"])


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_dpo_adds_a_forward_pass_of_flops_and_of_hbm_traffic(lora_rank):
    """The reference's forward pass: 2 FLOPs per base weight and token (SFT's 6, LoRA's 4, each
    adapter weight's 6 unchanged) and attention's forward products, 4 of the 12 training's."""
    accelerator = plan.parse_accelerator("v6e:2x4")
    sft, dpo = _sft_and_dpo(accelerator, lora_rank=lora_rank)
    model_config = presets.model_config("gemma3-1b", plan.GEMMA3_VOCAB)
    adapters = sft.trainable_params if lora_rank else 0
    base = sft.num_params - adapters
    tokens = 32 * 512
    attention_forward = 4 * 26 * 4 * 256 * 512  # layers x heads x head_dim x positions
    assert (model_config.num_layers, model_config.num_heads, model_config.head_dim) == (26, 4,
                                                                                         256)
    assert dpo.flops_per_step - sft.flops_per_step == tokens * (2 * base + attention_forward)
    if lora_rank:  # 6/4, less the adapters' (6 either way) and attention's (16/12) shares
        assert dpo.flops_per_step / sft.flops_per_step == pytest.approx(6 / 4, abs=0.015)
    else:  # 8/6 exactly: attention's 16 per 12 is the same ratio
        assert dpo.flops_per_step / sft.flops_per_step == pytest.approx(8 / 6, rel=1e-12)
    # The plan's figure is model_flops of the DPO step (what a run's MFU is measured against).
    assert dpo.flops_per_step == plan.model_flops(
        model_config, base, batch_size=32, maxlen=512, lora=bool(lora_rank), dpo=True,
        adapters=adapters)
    # HBM: the policy's traffic unchanged, the reference's forward pass beside it; at least its
    # bfloat16 weights read once (each device holds all of them: data parallelism).
    assert {k: v for k, v in dpo.traffic.items() if k != "reference"} == sft.traffic
    assert dpo.traffic["reference"] > 2 * base
    assert dpo.bytes_per_device == sft.bytes_per_device + dpo.traffic["reference"]
    # The roofline grows by both.
    assert dpo.roofline.compute_seconds / sft.roofline.compute_seconds == pytest.approx(
        dpo.flops_per_step / sft.flops_per_step, rel=1e-12)
    assert dpo.roofline.memory_seconds / sft.roofline.memory_seconds == pytest.approx(
        dpo.bytes_per_device / sft.bytes_per_device, rel=1e-12)
    assert dpo.roofline.step_seconds > sft.roofline.step_seconds
    assert "reference" in json.loads(json.dumps(dpo.to_dict()))["traffic_gib"]


# --- the refusal --------------------------------------------------------------------------


@pytest.fixture
def four_gib_devices(monkeypatch):
    """8 CPU devices sharing a 32 GiB host: 4 GiB each, whatever this machine has."""
    monkeypatch.setattr(accelerators, "host_memory_bytes", lambda: 8 * 4 * GIB)


def test_the_fix_offered_is_the_first_layout_that_fits(four_gib_devices):
    accelerator = plan.attached_accelerator()
    assert accelerator.memory_bytes == 4 * GIB and accelerator.chips == 8
    config = TrainConfig.flat(model="gemma3-1b", tokenizer="gemma3", batch_size=8, maxlen=64)
    change, fitted = plan.suggest_fit(config, accelerator)
    assert change["mesh"] == {"fsdp": -1} and fitted.fits and not plan.estimate(
        config, accelerator).fits
    words = ", ".join(f"{k}={v!r}" for k, v in change.items())
    with pytest.raises(ConfigError) as error:
        plan.require_fits(config, accelerator)
    message = str(error.value)
    assert message.startswith("mesh: gemma3-1b needs ~") and "\n" not in message
    assert f"Fix: use {words} (~{fitted.per_device_bytes / GIB:.1f} GiB)" in message
    assert "check_memory=False" in message


def test_nothing_fits_names_how_many_chips_would():
    config = TrainConfig.flat(model="gemma3-27b", tokenizer="gemma3", batch_size=8, maxlen=64)
    accelerator = plan.parse_accelerator("v6e:2x4")
    with pytest.raises(ConfigError, match=r"^mesh: .* nothing fits on 8 device\(s\): use about "
                                          r"(\d+) chips of this kind") as error:
        plan.require_fits(config, accelerator)
    chips = int(re.search(r"about (\d+) chips", str(error.value)).group(1))
    assert chips == plan.chips_needed(config, accelerator) and chips > 8

    def frugal_fits(n):
        frugal = config.replace(mesh={"fsdp": -1}, remat="full", batch_size=n)
        return plan.estimate(frugal, dataclasses.replace(accelerator, chips=n)).fits

    assert frugal_fits(chips) and not frugal_fits(chips // 2)


def test_training_refuses_before_tokenizing_or_loading_weights(four_gib_devices, monkeypatch,
                                                               tmp_path):
    def forbidden(*args, **kwargs):
        raise AssertionError("expensive work started")

    monkeypatch.setattr(token_cache, "load_or_build_token_cache", forbidden)
    monkeypatch.setattr(documents, "resolve_corpus", forbidden)
    monkeypatch.setattr(presets, "build_model", forbidden)
    # A 4B run's checkpoints need ~58 GiB; the disk check is not what this test is about, so
    # it must not depend on the free space of the machine running it.
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(total=2**50, used=0, free=2**50))
    config = TrainConfig.flat(model="gemma3-4b", tokenizer="gemma3", batch_size=8, maxlen=64,
                         output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="^mesh: gemma3-4b needs ~"):
        Experiment.prepare(config)
    # The override goes on to the data (and so meets the forbidden corpus).
    with pytest.raises(AssertionError, match="expensive work started"):
        Experiment.prepare(config.replace(check_memory=False))


# --- the exact plan: libtpu compiles the step for a TPU topology on this CPU machine -------

needs_libtpu = pytest.mark.skipif(plan.find_libtpu() is None,
                                  reason="libtpu is not installed (`make libtpu`; x86-64 Linux)")


# Every exact plan of this module, compiled in one libtpu subprocess (its start-up and imports
# paid once). The replicated 2x2 plan serves the sharding and the roofline tests alike.
# The tiny preset's last two layers (a sliding-window one and the global one): libtpu compiles
# a third of the six layers' program, and what these tests compare holds at any depth.
COMPILED_TARGETS = {
    "replicated": (_tiny(batch_size=16, maxlen=128, compute_dtype="bfloat16", max_steps=100,
                         num_layers=2), "v6e:2x2"),
    "fsdp": (_tiny(batch_size=16, maxlen=128, compute_dtype="bfloat16", max_steps=100,
                   mesh={"fsdp": -1}, num_layers=2), "v6e:2x2"),
    # Gemma's 262k vocabulary: 8 x 256 rows make the loss run in 2 chunks on one chip.
    "vocab_one_chip": (TrainConfig.flat(model="gemma3-tiny", tokenizer="gemma3", batch_size=8,
                                   maxlen=256, compute_dtype="bfloat16", num_layers=2),
                       "v6e:1x1"),
    "vocab_four_chips": (TrainConfig.flat(model="gemma3-tiny", tokenizer="gemma3", batch_size=8,
                                     maxlen=256, compute_dtype="bfloat16", num_layers=2),
                         "v6e:2x2"),
}


@pytest.fixture(scope="module")
def compiled():
    # The replicated target twice: identical targets compile once.
    names = [*COMPILED_TARGETS, "replicated"]
    plans = aot.compile_plans([COMPILED_TARGETS[name] for name in names],
                              price_per_chip_hour=1.0)
    assert plans[-1] == plans[0]
    return dict(zip(names, plans, strict=True))


@needs_libtpu
@pytest.mark.slow
def test_the_compiled_plan_sees_the_sharding_and_agrees_on_flops(compiled):
    replicated, split = compiled["replicated"], compiled["fsdp"]
    for plan_ in (replicated, split):
        assert plan_.method == "compiled" and plan_.fits
        assert set(plan_.breakdown) == {"arguments", "outputs_not_aliased", "temporaries",
                                        "code"}
        analytic = plan_.analytic.breakdown
        # Arguments are the state and the batch: at least the exact shard bytes (TPU layouts
        # pad small dimensions), within the padding of the tiny preset's 32-wide heads.
        state = analytic["params"] + analytic["optimizer"] + analytic["batch"]
        assert state <= plan_.breakdown["arguments"] < 4 * state
        assert plan_.flops_per_step == pytest.approx(plan_.analytic.flops_per_step, rel=0.25)
    assert split.breakdown["arguments"] < 0.5 * replicated.breakdown["arguments"]


@needs_libtpu
@pytest.mark.slow
def test_the_compiled_plan_carries_xla_bytes_accessed_into_its_roofline(compiled):
    plan_ = compiled["replicated"]
    assert set(plan_.traffic) == {"xla_bytes_accessed"} and plan_.bytes_per_device > 0
    roof = plan_.roofline
    assert roof.bytes_source == "XLA cost analysis (bytes accessed)"
    assert roof.memory_seconds == pytest.approx(plan_.bytes_per_device / 1640e9, rel=1e-12)
    assert roof.compute_seconds == pytest.approx(plan_.flops_per_step / 4 / 918e12, rel=1e-12)
    assert roof.run_steps == 100 and roof.cost == roof.run_seconds / 3600 * 4 * 1.0
    document = json.loads(json.dumps(plan_.to_dict()))
    assert document["roofline"]["bytes_source"].startswith("XLA")
    assert document["analytic"]["roofline"]["bytes_source"] == "analytic lower bound"
    # The analytic count is a lower bound: XLA's counts every operation's operands and results.
    assert plan_.analytic.bytes_per_device <= plan_.bytes_per_device


def test_the_exact_plan_needs_a_tpu_target_and_libtpu(monkeypatch):
    with pytest.raises(ConfigError, match="^exact: the exact plan compiles for TPUs, not h200"):
        aot.compile_plan(_tiny(), "h200")
    monkeypatch.setattr(exact, "find_libtpu", lambda: None)
    with pytest.raises(ConfigError, match=r"^exact: libtpu .* Fix: run `make libtpu`"):
        aot.compile_plan(_tiny(), "v6e")


@pytest.mark.slow
def test_the_ahead_of_time_dpo_step_takes_the_planned_reference(monkeypatch):
    """``aot.compile_step``'s DPO step, compiled for this machine's 8 CPU devices in place of a
    TPU topology (no libtpu needed): its arguments are the plan's state, batch and reference
    copy (full fine-tuning, fsdp), or the state and the frozen base alone (LoRA), exactly, but
    for the step counters; XLA counts about 8/6 the SFT step's FLOPs for full fine-tuning."""
    from jax.experimental import topologies

    monkeypatch.setattr(topologies, "get_topology_desc",
                        lambda **kwargs: namedtuple("topology", "devices")(jax.devices()))
    accelerator = plan.parse_accelerator("v6e:2x4")
    for overrides in ({"mesh": {"fsdp": -1}}, {"lora_rank": 4}):
        config = _tiny(batch_size=8, maxlen=32, compute_dtype="bfloat16", objective="dpo",
                       data_path=EMBEDDED_PREFERENCES, **overrides)
        estimate = plan.estimate(config, accelerator).breakdown
        compiled = aot.compile_step(config, accelerator)
        held = estimate["params"] + estimate.get("reference", 0) + estimate["optimizer"]
        assert compiled["breakdown"]["arguments"] - held - estimate["batch"] in range(0, 64)
        assert ("reference" in estimate) == (not config.lora.rank)
        if not config.lora.rank:
            sft = aot.compile_step(config.replace(objective="sft", data_path=""),
                                   accelerator)
            assert compiled["flops"] / sft["flops"] == pytest.approx(8 / 6, rel=0.1)


def test_the_planned_batch_counts_every_batch_field():

    assert len(packing.FIELDS) == plan.BATCH_FIELD_COUNT


@needs_libtpu
@pytest.mark.slow
def test_on_tpu_each_chip_computes_only_its_rows_share_of_the_loss(compiled):
    """Gemma's 262k vocabulary makes the loss run in chunks. Compiled by libtpu for four v6e
    chips (data=4), a chip's temporaries are a fraction of one chip doing the whole batch:
    the chunks keep the rows where the batch sharding put them (when chunks were runs of the
    flattened tokens, XLA gathered each to every chip: 1,887 vs 1,895 MiB here, 16 rows)."""
    one_chip = compiled["vocab_one_chip"].breakdown["temporaries"]
    four_chips = compiled["vocab_four_chips"].breakdown["temporaries"]
    assert four_chips < 0.5 * one_chip  # 428 vs 1,792 MiB when written


# --- Gemma 4 ------------------------------------------------------------------------------------

def test_gemma4_flops_count_the_weights_a_token_multiplies():
    """A mixture's idle experts and E2B's per-layer embedding table (a lookup) cost no FLOPs; the
    global layers attend with their wider keys."""
    moe = presets.model_config("gemma4-26b-a4b", plan.GEMMA3_VOCAB)
    total = 25_233_141_790  # gemma4-26b-a4b's text weights, as traced
    experts = moe.num_layers * moe.num_experts * 3 * moe.expert_dim * moe.embed_dim
    active = total - experts + experts * moe.top_k_experts // moe.num_experts
    assert plan.matmul_params(moe, total) == active
    assert 3.7e9 < active < 3.9e9  # "A4B": about four billion active
    e2b = presets.model_config("gemma4-e2b", plan.GEMMA3_VOCAB)
    table = e2b.num_embed * e2b.num_layers * e2b.per_layer_input_dim
    assert plan.matmul_params(e2b, 10**10) == 10**10 - table
    widths = plan.layer_head_dims(e2b)
    assert widths.count(512) == e2b.num_layers // 5 and widths.count(256) == e2b.num_layers * 4 // 5
    dense = presets.model_config("gemma3-1b", plan.GEMMA3_VOCAB)
    assert plan.matmul_params(dense, 10**9) == 10**9
    assert plan.layer_head_dims(dense) == [dense.head_dim] * dense.num_layers
    flops = plan.model_flops(moe, total, batch_size=1, maxlen=1)
    assert flops == 6 * active + 12 * moe.num_heads * sum(plan.layer_head_dims(moe))


def test_an_expert_axis_splits_the_experts_weights_in_the_plan():
    config = TrainConfig.flat(model="gemma4-26b-a4b", tokenizer="gemma4", batch_size=8, maxlen=512)
    accelerator = plan.parse_accelerator("v6e:2x4")
    replicated = plan.estimate(config, accelerator)
    split = plan.estimate(config.replace(mesh={"expert": -1}), accelerator)
    assert split.mesh["expert"] == 8
    moe = presets.model_config("gemma4-26b-a4b", plan.GEMMA3_VOCAB)
    experts = moe.num_layers * moe.num_experts * 3 * moe.expert_dim * moe.embed_dim
    saved = replicated.breakdown["params"] - split.breakdown["params"]
    assert saved == experts * 7 // 8 * 4  # float32 master weights, 7 of 8 shares gone
    assert split.per_device_bytes < replicated.per_device_bytes / 3
    assert {"expert": -1} in plan.spread_meshes("gemma4-26b-a4b")
    assert plan.spread_meshes("gemma4-31b") == [{"fsdp": -1}]
    with pytest.raises(ConfigError, match="^mesh: an expert axis of 8 splits nothing"):
        plan.estimate(config.replace(model="gemma4-31b", mesh={"expert": -1}), accelerator)


def test_a_mixtures_expert_adapters_are_held_split_and_run_top_k():
    """LoRA on the 26B-A4B: each expert's adapters live with their expert (split over the expert
    axis: an eighth a chip on expert 8) and a token runs only its top 8 experts' adapters."""
    import jax

    config = TrainConfig.flat(model="gemma4-26b-a4b", tokenizer="gemma4", batch_size=8,
                              maxlen=512, lora_rank=16, mesh={"expert": -1})
    split = plan.estimate(config, plan.parse_accelerator("v6e:2x4"))
    moe = presets.model_config("gemma4-26b-a4b", plan.GEMMA3_VOCAB)
    tree = plan.adapter_params(moe, config.lora, "float32")
    experts = sum(leaf.size for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
                  if sharding.rule_name(path, leaf.ndim) == "lora_experts")
    total = sum(leaf.size for leaf in jax.tree.leaves(tree))
    assert experts == 16 * 7_744 * 128 * 30  # rank x (a and b of one expert) x experts x layers
    assert split.breakdown["optimizer"] == 2 * 4 * (total - experts + experts // 8)
    assert plan.active_adapters(moe, tree) == total - experts + experts * 8 // 128


def test_the_plan_holds_an_expert_axis_exchange_buffers_and_a_capacity_shrinks_them():
    """Under ``expert 8`` each device computes room for every copy its axis could send it
    (dropless: 8 times its own routed copies) and holds the blocks exchanged; a capacity
    factor c holds c times its own instead (``gemmalab.model.experts``)."""
    from gemmalab.plan.shapes import expert_activations

    moe = presets.model_config("gemma4-26b-a4b", plan.GEMMA3_VOCAB)
    d, h, k = moe.embed_dim, moe.expert_dim, moe.top_k_experts
    assert expert_activations(moe, {"expert": 1, "tensor": 1}) == k * (2 * d + 3 * h)
    assert expert_activations(moe, {"expert": 1, "tensor": 2}) == k * (2 * d + 3 * h // 2)
    assert expert_activations(moe, {"expert": 8, "tensor": 1}) == 8 * k * (5 * d + 3 * h)
    assert expert_activations(moe, {"expert": 8, "tensor": 1}, 1.5) == 12 * (5 * d + 3 * h)
    assert expert_activations(moe, {"expert": 2, "tensor": 1}, 4.0) == 2 * k * (5 * d + 3 * h)
    dense = presets.model_config("gemma4-31b", plan.GEMMA3_VOCAB)
    assert expert_activations(dense, {"expert": 1, "tensor": 1}) == 0

    config = TrainConfig.flat(model="gemma4-26b-a4b", tokenizer="gemma4", batch_size=8,
                              maxlen=1024, lora_rank=16, remat="full", mesh={"expert": 8})
    accelerator = plan.parse_accelerator("v6e:2x4")
    dropless = plan.estimate(config, accelerator)
    bounded = plan.estimate(config.replace(expert_capacity_factor=2.0), accelerator)
    assert bounded.breakdown["params"] == dropless.breakdown["params"]
    # A block's working set, twice (the block recomputed and its backward), for 1,024 tokens a
    # device in bfloat16: the routed rows 8 times a device's own against 2 times.
    sizes = {"expert": 8, "tensor": 1}
    saved = 1024 * 2 * 2 * (expert_activations(moe, sizes) - expert_activations(moe, sizes, 2.0))
    assert dropless.breakdown["activations"] - bounded.breakdown["activations"] == saved


def test_the_command_line_plans_what_the_training_notebook_would_run(capsys):
    """``python -m gemmalab.plan`` with no run options: the notebook's default (the demo recipe,
    LoRA r8 on the embedded 270M at 8 x 128); a named model keeps its own defaults and reads
    its family's vocabulary, not a corpus tokenizer's."""
    from gemmalab.plan.__main__ import main

    main([])
    default = json.loads(capsys.readouterr().out)
    assert (default["model"], default["batch_size"], default["maxlen"]) == ("gemma3-270m", 8, 128)
    assert default["trainable_params"] < default["num_params"] / 100  # adapters only
    main(["--model", "gemma3-1b", "--accelerator", "h200:8", "--mesh", '{"fsdp": -1}'])
    named = json.loads(capsys.readouterr().out)
    assert (named["model"], named["batch_size"], named["maxlen"]) == ("gemma3-1b", 64, 256)
    assert named["trainable_params"] == named["num_params"] > 999e6  # full, 262k-row embedding
    main(["--recipe", "tiny", "--batch-size", "16"])
    tiny = json.loads(capsys.readouterr().out)
    assert (tiny["model"], tiny["batch_size"]) == ("gemma3-tiny", 16)
