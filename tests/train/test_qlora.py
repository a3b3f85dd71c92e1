"""QLoRA runs: the quantized base is DPO's reference with the adapters off, is rebuilt
identically on a resume (the same losses bit for bit), and exports dequantized and merged."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmalab.config import TrainConfig
from gemmalab.model import lora, quantization
from gemmalab.train import checkpoints, optimization
from gemmalab.train.params import FROZEN_DIGEST, weights_digest
from gemmalab.weights import orbax_params
from tests.helpers.models import tiny_model
from tests.helpers.runs import _losses, crashed_run
from tests.train.test_dpo import _pair_tokens, _rows, _settings


def test_the_dpo_reference_is_the_quantized_base_with_the_adapters_off():
    """Fresh adapters (b = 0): policy and reference are both the nf4 base, loss log 2, no
    reward; the adapters get a gradient through the dequantized matmuls."""
    base_model, base = tiny_model(64)
    frozen = quantization.quantize_base(base, "nf4", jnp.float32)
    model = lora.wrap(base_model, rank=4, alpha=None, modules="all", dtype=jnp.float32)
    adapters = lora.init_adapters(base_model.config, rank=4, modules="all", dtype="float32",
                                  seed=3)
    batch = _rows([_pair_tokens(np.random.default_rng(2)) for _ in range(2)], pairs_per_row=2,
                  maxlen=32)
    settings = _settings(base_model, adapters=True, num_segments=4)
    (total, sums), grads = jax.value_and_grad(
        lambda a: optimization.loss_sums(model, a, batch, jnp.float32, frozen, None, settings),
        has_aux=True)(adapters)
    assert float(total) == pytest.approx(2 * math.log(2), rel=1e-6)
    assert float(sums["reward_margin"]) == 0.0
    assert sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads)) > 0


def _config(tmp_path, cache_dir, stories_file, name, **overrides):
    values = dict(model="gemma3-tiny", data_path=str(stories_file), cache_dir=str(cache_dir),
                  output_dir=str(tmp_path / name), batch_size=8, maxlen=64, max_steps=10,
                  eval_every=5, checkpoint_every=4, tokenizer_vocab_size=600,
                  tokenize_workers=1, seed=5, compute_dtype="float32", lora_rank=4,
                  lora_alpha=8.0, learning_rate=1e-2, num_layers=2, base_quantization="nf4")
    return TrainConfig.flat(**{**values, **overrides})


@pytest.mark.slow
def test_a_killed_qlora_run_resumes_exactly_and_exports_the_merged_dequantized_model(
        tmp_path, cache_dir, stories_file):
    """Killed before step 7 (checkpoint at 4) and started again: the base quantized again from
    its source is the same bits (the recorded digest agrees), and the losses and adapters
    equal the run never stopped. Its saved params are the dequantized base with the adapters
    merged; it learned; its base took a quarter of LoRA's bytes or less."""
    from gemmalab.train.experiment import Experiment

    whole = Experiment.prepare(_config(tmp_path, cache_dir, stories_file, "whole"))
    assert any(quantization.is_quantized(leaf) for leaf in jax.tree.leaves(
        whole.weights.frozen, is_leaf=quantization.is_quantized))
    summary = whole.train(progress=False)
    whole.save()

    crashed = _config(tmp_path, cache_dir, stories_file, "crashed")
    crashed_run(crashed, 7)
    again = Experiment.prepare(crashed)
    assert again.weights.start_step == 4
    recorded = checkpoints.stored_config(str(tmp_path / "crashed"))[FROZEN_DIGEST]
    assert recorded == weights_digest(again.weights.frozen)
    for a, b in zip(jax.tree.leaves(again.weights.frozen), jax.tree.leaves(whole.weights.frozen),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again.train(progress=False)
    steps, losses = _losses(tmp_path / "crashed")
    whole_steps, whole_losses = _losses(tmp_path / "whole")
    assert steps == whole_steps == list(range(1, 11))
    np.testing.assert_array_equal(losses, whole_losses)

    saved = orbax_params.load_params(f"{tmp_path / 'whole'}/params")
    merged = lora.merge(quantization.dequantized(whole.weights.frozen), whole.weights.state.params,
                        lora.scale(4, 8.0), dtype=jnp.float32)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(merged), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.2

    plain = Experiment.prepare(_config(tmp_path, cache_dir, stories_file, "plain", max_steps=1,
                                       base_quantization="none"))
    quantized_bytes = whole.weights.bytes_per_device()["params_bytes_per_device"]
    # The projections at 4 bits and a float32 scale per 32; the embedding stays float32.
    projections = sum(leaf.qvalue.size for leaf in jax.tree.leaves(
        whole.weights.frozen, is_leaf=quantization.is_quantized)
        if quantization.is_quantized(leaf))
    saved_bytes = plain.weights.bytes_per_device()["params_bytes_per_device"] - quantized_bytes
    assert saved_bytes == pytest.approx(projections * (4 - 0.5 - 4 / 32), rel=0.01)
