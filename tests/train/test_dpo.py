"""DPO through the real steps: the tiny Gemma 3 as policy and reference, packed pairs, LoRA's
base as the reference, full fine-tuning's reference copy, micro-batches and evaluation."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmalab.config import TrainConfig
from gemmalab.model import lora, mesh, presets, sharding
from gemmalab.train import optimization
from tests.helpers.models import short_tiny, tiny_model
from tests.helpers.numerics import REORDERED_FLOAT32, assert_trees_close_to_scale

VOCAB, SIDE = 64, 7  # each side of a pair: SIDE tokens, the last 3 of them the reply


def _tiny(seed=0):
    return tiny_model(VOCAB, seed)


def _pair_tokens(rng) -> tuple[np.ndarray, np.ndarray]:
    """Two sequences with one prompt: ``[2, SIDE]`` tokens (BOS first), replies that differ."""
    prompt = rng.integers(3, VOCAB, size=SIDE - 3)
    chosen, rejected = rng.integers(3, VOCAB, size=(2, 3))
    rejected[0] = (chosen[0] + 1 - 3) % (VOCAB - 3) + 3
    return np.stack([np.concatenate([[2], prompt[1:], chosen]),
                     np.concatenate([[2], prompt[1:], rejected])]).astype(np.int32)


def _rows(pairs: list[np.ndarray], pairs_per_row: int, maxlen: int) -> dict[str, np.ndarray]:
    """Packed rows as the packer makes them: a pair's two sides as segments 2k+1, 2k+2."""
    num_rows = -(-len(pairs) // pairs_per_row)
    batch = {k: np.zeros((num_rows, maxlen), np.int32) for k in
             ("tokens", "targets", "segment_ids", "positions", "loss_mask")}
    for index, pair in enumerate(pairs):
        row, slot = divmod(index, pairs_per_row)
        for side in range(2):
            start = (2 * slot + side) * (SIDE - 1)
            span = slice(start, start + SIDE - 1)
            batch["tokens"][row, span] = pair[side, :-1]
            batch["targets"][row, span] = pair[side, 1:]
            batch["segment_ids"][row, span] = 2 * slot + side + 1
            batch["positions"][row, span] = np.arange(SIDE - 1)
            batch["loss_mask"][row, start + SIDE - 4:start + SIDE - 1] = 1  # the reply's 3
    return batch


def _settings(model, *, adapters, num_segments, beta=0.1):
    return optimization.Preference(reference_model=model, beta=beta, label_smoothing=0.0,
                                   num_segments=num_segments, adapters=adapters)


def _sequence_logp(model, params, tokens) -> float:
    """Sum of the reply's 3 next-token log-probabilities, from the model's own full logits."""
    logits = model.apply({"params": params}, jnp.asarray(tokens[None, :-1]))
    logits = logits.logits if hasattr(logits, "logits") else logits
    log_probs = jax.nn.log_softmax(logits[0].astype(jnp.float32))
    picked = log_probs[jnp.arange(SIDE - 1), tokens[1:]]
    return float(picked[-3:].sum())


@pytest.mark.slow  # 16-35 s on 2 cores, compiling the DPO losses and steps
def test_the_step_loss_is_dpo_of_the_two_models_sequence_logps():
    """Policy and reference differ; the step's loss and rewards are DPO's formula over each
    pair's reply log-probabilities, computed here from the models' full logits."""
    model, policy = _tiny(seed=0)
    _, reference = _tiny(seed=1)
    rng = np.random.default_rng(0)
    pairs = [_pair_tokens(rng) for _ in range(4)]
    batch = _rows(pairs, pairs_per_row=2, maxlen=32)
    beta = 0.5
    total, sums = optimization.loss_sums(model, policy, batch, jnp.float32, reference, None,
                                         _settings(model, adapters=False, num_segments=4,
                                                   beta=beta))
    margins = []
    for pair in pairs:
        delta = [_sequence_logp(model, policy, side) - _sequence_logp(model, reference, side)
                 for side in pair]
        margins.append(beta * (delta[0] - delta[1]))
    expected = sum(-math.log(1 / (1 + math.exp(-m))) for m in margins)
    assert float(sums["pairs"]) == 4 and float(sums["count"]) == 4
    assert float(sums["useful_tokens"]) == 4 * 2 * 3
    # The step's chunked loss against full logits: float32 summed in another order. The margins
    # are differences of log-probs of ~12: their error is absolute.
    assert float(total) == pytest.approx(expected, rel=REORDERED_FLOAT32)
    assert float(sums["reward_margin"]) == pytest.approx(sum(margins), rel=1e-3, abs=1e-4)
    assert float(sums["reward_accuracy"]) == sum(m > 0 for m in margins)
    # RPO (dpo_rpo_alpha): + alpha x each chosen reply's mean NLL over its 3 tokens.
    rpo_settings = dataclasses.replace(_settings(model, adapters=False, num_segments=4,
                                                 beta=beta), rpo_alpha=0.5)
    rpo_total, rpo_sums = optimization.loss_sums(model, policy, batch, jnp.float32, reference,
                                                 None, rpo_settings)
    chosen_nll = sum(-_sequence_logp(model, policy, pair[0]) / 3 for pair in pairs)
    assert float(rpo_sums["dpo_loss"]) == pytest.approx(expected, rel=REORDERED_FLOAT32)
    assert float(rpo_total) == pytest.approx(expected + 0.5 * chosen_nll, rel=REORDERED_FLOAT32)
    assert rpo_settings == optimization.Preference.of(
        TrainConfig.flat(objective="dpo", dpo_beta=beta, dpo_rpo_alpha=0.5).dpo, model, 4,
        adapters=False)


@pytest.mark.slow  # 16-35 s on 2 cores, compiling the DPO losses and steps
def test_packed_and_one_pair_per_row_give_the_same_step():
    model, policy = _tiny(seed=0)
    _, reference = _tiny(seed=1)
    rng = np.random.default_rng(1)
    pairs = [_pair_tokens(rng) for _ in range(4)]
    settings = _settings(model, adapters=False, num_segments=4)

    def value_and_grad(batch):
        return jax.value_and_grad(lambda p: optimization.loss_sums(
            model, p, batch, jnp.float32, reference, None, settings)[0])(policy)

    packed, packed_grad = value_and_grad(_rows(pairs, pairs_per_row=2, maxlen=32))
    alone, alone_grad = value_and_grad(_rows(pairs, pairs_per_row=1, maxlen=16))
    # Other rows, other programs: float32 summed in another order, at each gradient's scale.
    assert float(packed) == pytest.approx(float(alone), rel=REORDERED_FLOAT32)
    assert_trees_close_to_scale(packed_grad, alone_grad, REORDERED_FLOAT32)


@pytest.mark.slow  # 16-35 s on 2 cores, compiling the DPO losses and steps
def test_lora_reference_is_the_base_with_adapters_off():
    """Fresh adapters change nothing (B = 0): policy = reference, loss log 2, no reward; yet the
    adapters get a gradient, and the frozen base none (it is not an argument of the grad)."""
    base_model, base = _tiny()
    model = lora.wrap(base_model, rank=4, alpha=None, modules="all", dtype=jnp.float32)
    adapters = lora.init_adapters(base_model.config, rank=4, modules="all", dtype="float32",
                                  seed=3)
    rng = np.random.default_rng(2)
    batch = _rows([_pair_tokens(rng) for _ in range(2)], pairs_per_row=2, maxlen=32)
    settings = _settings(base_model, adapters=True, num_segments=4)
    (total, sums), grads = jax.value_and_grad(
        lambda a: optimization.loss_sums(model, a, batch, jnp.float32, base, None, settings),
        has_aux=True)(adapters)
    assert float(total) == pytest.approx(2 * math.log(2), rel=1e-6)
    assert float(sums["reward_margin"]) == 0.0 and float(sums["log_ratio"]) == 0.0
    assert sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads)) > 0


@pytest.mark.slow  # 16-35 s on 2 cores, compiling the DPO losses and steps
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_train_step_accumulates_pairs_over_micro_batches_and_learns(lora_rank):
    """grad_accum_steps=2 takes the same step as one pass (the loss a mean over all pairs);
    repeated steps raise the pairs' reward margin (full fine-tuning: against a reference
    copy; LoRA: against the frozen base)."""
    base_model, base = _tiny()
    device_mesh = mesh.make_mesh()
    if lora_rank:
        model = lora.wrap(base_model, rank=lora_rank, alpha=None, modules="all",
                          dtype=jnp.float32)
        params = lora.init_adapters(base_model.config, rank=lora_rank, modules="all",
                                    dtype="float32", seed=3)
    else:
        model, params = base_model, base
    held_shardings = sharding.param_sharding(base, device_mesh)
    # Buffers of its own (the state's are donated), as a run's reference copy is read apart.
    held = jax.device_put(jax.tree.map(np.asarray, base), held_shardings)
    schedule = optimization.learning_rate_schedule(1e-2, 10, warmup_ratio=0.0, min_lr_ratio=1.0)
    optimizer = optimization.make_optimizer(schedule, weight_decay=0.0, b1=0.9, b2=0.95,
                                            max_grad_norm=1.0)
    rng = np.random.default_rng(4)
    # 8 rows of 2 pairs: the 8 virtual devices take one row each.
    batch = mesh.global_batch(_rows([_pair_tokens(rng) for _ in range(16)], pairs_per_row=2,
                                    maxlen=32), device_mesh)
    settings = _settings(base_model, adapters=bool(lora_rank), num_segments=4)
    results = {}
    for accumulate in (1, 2):
        state, shardings = optimization.init_state(jax.tree.map(np.asarray, params), optimizer,
                                                   device_mesh)  # fresh buffers: donated
        step = optimization.make_train_step(model, optimizer, schedule, jnp.float32, device_mesh,
                                            shardings, grad_accum_steps=accumulate,
                                            frozen_shardings=held_shardings,
                                            preference_settings=settings)
        history = []
        for _ in range(4):
            state, metrics = step(state, batch, held)
            history.append({k: float(v) for k, v in metrics.items()})
        results[accumulate] = history
    one, two = results[1], results[2]
    assert one[0]["loss"] == pytest.approx(math.log(2), rel=1e-5)  # policy = reference at first
    assert one[0]["pairs"] == 16 and one[0]["useful_tokens"] == 16 * 2 * 3
    for a, b in zip(one, two, strict=True):  # micro-batches: float32 summed in another order
        assert b["loss"] == pytest.approx(a["loss"], rel=REORDERED_FLOAT32)
        # A norm over the whole gradient, after updates that grow its reordering (observed 5e-6).
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    assert one[-1]["reward_margin"] > 0.05 and one[-1]["loss"] < math.log(2) - 0.02
    assert one[-1]["reward_accuracy"] > 0.5 and one[-1]["kl_estimate"] != 0.0


@pytest.mark.slow
def test_full_fine_tuning_dpo_on_a_3d_mesh_with_remat_trains_like_one_device():
    """The policy and its reference copy split over data x fsdp x tensor by the same rules,
    blocks recomputed in the backward pass: one device's losses and rewards (float32)."""
    _, base = _tiny()
    rng = np.random.default_rng(6)
    pairs = [_pair_tokens(rng) for _ in range(16)]

    def train(shape, devices, remat):
        model = presets.build_model(short_tiny(VOCAB), param_dtype=jnp.float32,
                                    remat=remat)
        device_mesh = mesh.make_mesh(shape, devices)
        held_shardings = sharding.param_sharding(base, device_mesh)
        held = jax.device_put(jax.tree.map(np.asarray, base), held_shardings)
        schedule = optimization.learning_rate_schedule(1e-2, 10, warmup_ratio=0.0,
                                                       min_lr_ratio=1.0)
        optimizer = optimization.make_optimizer(schedule, weight_decay=0.0, b1=0.9, b2=0.95,
                                                max_grad_norm=1.0)
        state, shardings = optimization.init_state(jax.tree.map(np.asarray, base), optimizer,
                                                   device_mesh)
        step = optimization.make_train_step(model, optimizer, schedule, jnp.float32,
                                            device_mesh, shardings,
                                            frozen_shardings=held_shardings,
                                            preference_settings=_settings(
                                                model, adapters=False, num_segments=4))
        batch = mesh.global_batch(_rows(pairs, pairs_per_row=2, maxlen=32), device_mesh)
        history = []
        for _ in range(4):
            state, metrics = step(state, batch, held)
            history.append({k: float(metrics[k]) for k in
                            ("loss", "reward_margin", "reward_accuracy", "kl_estimate")})
        return history, held

    one, _ = train({"data": 1}, jax.devices()[:1], "none")
    split, held = train({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices(), "full")
    for a, b in zip(one, split, strict=True):
        # float32 sums in another order, grown over the steps (8e-5 at step 4 here); the
        # margins and KL are differences of summed log-probs, so their error is absolute.
        assert b["loss"] == pytest.approx(a["loss"], rel=5e-4)
        for name in ("reward_margin", "kl_estimate"):
            assert b[name] == pytest.approx(a[name], abs=2e-3), name
        assert abs(b["reward_accuracy"] - a["reward_accuracy"]) <= 1 / 16  # a pair at 0 may flip
    assert split[-1]["loss"] < math.log(2) - 0.02
    q = held["layer_0"]["attn"]["q_einsum"]["w"]  # the reference copy is split, not replicated
    assert q.addressable_shards[0].data.shape == (2, 64, 32)


@pytest.mark.slow  # 6-25 s on 2 cores: the DPO eval step's compile (alone: 25 s)
def test_evaluate_reports_the_pairs_means_and_the_chosen_replies_perplexity():
    model, policy = _tiny(seed=0)
    _, reference = _tiny(seed=1)
    device_mesh = mesh.make_mesh()
    rng = np.random.default_rng(5)
    pairs = [_pair_tokens(rng) for _ in range(16)]
    settings = _settings(model, adapters=False, num_segments=4)
    shardings = sharding.param_sharding(policy, device_mesh)
    step = optimization.make_eval_step(model, jnp.float32, device_mesh, shardings, shardings,
                                       settings)
    batches = [_rows(pairs[:8], 1, 16), _rows(pairs[8:], 1, 16)]
    held_out = optimization.evaluate(step, jax.device_put(policy, shardings), batches,
                                     device_mesh, jax.device_put(reference, shardings))
    chosen = [_sequence_logp(model, policy, pair[0]) for pair in pairs]
    assert held_out["eval_pairs"] == 16
    # The mesh's chunked eval step against full logits: float32 summed in another order.
    assert held_out["eval_chosen_logp"] == pytest.approx(np.mean(chosen), rel=REORDERED_FLOAT32)
    assert held_out["eval_perplexity"] == pytest.approx(math.exp(-np.sum(chosen) / (16 * 3)),
                                                        rel=REORDERED_FLOAT32)
    margins = [0.1 * ((_sequence_logp(model, policy, p[0]) - _sequence_logp(model, reference,
                                                                             p[0]))
                      - (_sequence_logp(model, policy, p[1]) - _sequence_logp(model, reference,
                                                                              p[1])))
               for p in pairs]
    assert held_out["eval_reward_accuracy"] == pytest.approx(np.mean(np.asarray(margins) > 0))
    assert held_out["eval_loss"] == pytest.approx(
        np.mean([math.log1p(math.exp(-m)) for m in margins]), rel=REORDERED_FLOAT32)


@pytest.mark.slow
def test_a_killed_dpo_run_resumes_exactly_with_its_reference_read_again(tmp_path, cache_dir):
    """Full fine-tuning DPO on the embedded preference set, killed before step 5 (checkpoint
    at 3) and started again: the same per-step losses and rewards as the run never stopped,
    bit for bit; the reference (never checkpointed) is the starting weights again."""
    from gemmalab.train.experiment import Experiment
    from tests.helpers.runs import crashed_run

    def config(name):
        return TrainConfig.flat(model="gemma3-tiny", objective="dpo", embedded_stories=60,
                           tokenizer_vocab_size=2048,
                           cache_dir=str(cache_dir), output_dir=str(tmp_path / name),
                           batch_size=8, maxlen=512, max_steps=7, eval_every=0,
                           checkpoint_every=3, tokenize_workers=1, seed=2,
                           compute_dtype="float32", learning_rate=1e-3, num_layers=2)

    whole = Experiment.prepare(config("whole"))
    start = jax.tree.map(np.asarray, whole.weights.state.params)
    whole.train(progress=False)
    first = crashed_run(config("crashed"), 5)
    assert first.checkpoints.steps() == [3]
    again = Experiment.prepare(config("crashed"))
    assert again.weights.start_step == 3
    for a, b in zip(jax.tree.leaves(again.weights.frozen), jax.tree.leaves(start),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    again.train(progress=False)
    for a, b in zip(again.history, whole.history, strict=True):
        assert a["step"] == b["step"]
        for name in ("loss", "reward_margin", "reward_accuracy", "kl_estimate", "grad_norm"):
            assert a[name] == b[name], (a["step"], name)
    assert whole.history[-1]["pairs"] > 0 and whole.summary["objective"] == "dpo"
    assert 0.0 <= whole.summary["final_eval_reward_accuracy"] <= 1.0
