"""Train-step throughput and MFU of real Gemma 3 sizes on whatever devices are attached.

    .venv/bin/python bench/accelerator.py                      # TPU/GPU: 270M and 1B
    .venv/bin/python bench/accelerator.py --models gemma3-tiny --maxlens 128 --steps 2  # CPU

For each model x (full fine-tuning, LoRA) x maxlen: random weights (no download), random
tokens in packed-style rows (two documents a row), the project's own train step
(``gemmalab.train.optimization``: fp32 master weights, bf16 compute, AdamW, clipping) over every
attached device data-parallel, ``--tokens`` per step. Reports step time, tokens/s, model TFLOP/s
(``plan.model_flops``: 6 per weight per token plus attention; 4 per frozen weight with LoRA),
MFU against the devices' dense bf16 peak (None on CPUs) and peak device memory. A configuration
that does not fit is reported as such and the rest still run.

For comparison, the tutorial's published run: Gemma3-270M, 96,000 stories x 256 tokens in
294.7 s on one v6e chip, ~83k padded tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmalab import plan
from gemmalab.config import TrainConfig
from gemmalab.model import lora, mesh, presets, sharding
from gemmalab.train import optimization


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    maxlen: int
    lora_rank: int
    batch_size: int


def synthetic_batch(case: Case, vocab: int, device_mesh: Any, seed: int = 0) -> dict:
    """Rows of two documents each (segment ids 1 and 2, positions restarting), every target
    loss-bearing."""
    rng = np.random.default_rng(seed)
    shape = (case.batch_size, case.maxlen)
    half = case.maxlen // 2
    segments = np.where(np.arange(case.maxlen) < half, 1, 2).astype(np.int32)
    positions = np.where(np.arange(case.maxlen) < half, np.arange(case.maxlen),
                         np.arange(case.maxlen) - half).astype(np.int32)
    return mesh.global_batch({
        "tokens": rng.integers(3, vocab, shape).astype(np.int32),
        "targets": rng.integers(3, vocab, shape).astype(np.int32),
        "segment_ids": np.tile(segments, (case.batch_size, 1)),
        "positions": np.tile(positions, (case.batch_size, 1)),
        "loss_mask": np.ones(shape, np.int32),
    }, device_mesh)


def measure(case: Case, *, steps: int, vocab: int) -> dict[str, Any]:
    config = TrainConfig.flat(model=case.model, maxlen=case.maxlen, batch_size=case.batch_size,
                         lora_rank=case.lora_rank, tokenizer_vocab_size=vocab,
                         tokenizer="local" if case.model == "gemma3-tiny" else "gemma3")
    device_mesh = mesh.make_mesh()
    model_config = presets.model_config(case.model, plan.vocab_size_hint(config.model))
    base_model = presets.build_model(model_config, param_dtype=jnp.float32,
                                     attention=config.model.attention, mesh=device_mesh)
    schedule = optimization.learning_rate_schedule(1e-5, 1000, warmup_ratio=0.0, min_lr_ratio=1.0)
    optimizer = optimization.make_optimizer(schedule, weight_decay=0.01, b1=0.9, b2=0.95,
                                            max_grad_norm=1.0)
    expected = plan.abstract_params(model_config, "float32")
    weights = presets.init_params(base_model, seed=0, sample_length=case.maxlen,
                                  shardings=sharding.param_sharding(expected, device_mesh))
    model, frozen, frozen_shardings = base_model, None, None
    if case.lora_rank:
        model = lora.wrap(base_model, rank=case.lora_rank, alpha=None, modules="all",
                          dtype=jnp.float32)
        frozen = jax.tree.map(lambda p: p.astype(jnp.bfloat16), weights)
        frozen_shardings = sharding.param_sharding(frozen, device_mesh)
        weights = lora.init_adapters(model_config, rank=case.lora_rank, modules="all",
                                     dtype="float32", seed=1)
    num_params = presets.parameter_count(frozen if frozen is not None else weights)
    adapters = presets.parameter_count(weights) if case.lora_rank else 0
    state, shardings = optimization.init_state(weights, optimizer, device_mesh)
    step = optimization.make_train_step(model, optimizer, schedule, jnp.bfloat16, device_mesh,
                                        shardings, frozen_shardings=frozen_shardings)
    batch = synthetic_batch(case, model_config.num_embed, device_mesh)
    started = time.perf_counter()
    compiled = step.lower(state, batch, frozen).compile()
    compile_s = time.perf_counter() - started
    state, metrics = compiled(state, batch, frozen)  # the first run pays one-time set-up
    jax.block_until_ready(metrics)
    started = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch, frozen)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - started) / steps
    flops = plan.model_flops(model_config, num_params, batch_size=case.batch_size,
                             maxlen=case.maxlen, lora=config.lora.enabled, adapters=adapters)
    devices = plan.attached_accelerator()
    peak = devices.peak_flops * devices.chips if devices.peak_flops else None
    peak_bytes = plan.peak_device_bytes()
    return {"model": case.model, "lora_rank": case.lora_rank, "maxlen": case.maxlen,
            "batch": case.batch_size, "step_s": seconds,
            "tokens_per_s": case.batch_size * case.maxlen / seconds,
            "model_tflops_per_s": flops / seconds / 1e12,
            "mfu": flops / seconds / peak if peak else None,
            "peak_memory_gib": peak_bytes / 2**30 if peak_bytes else None,
            "compile_s": compile_s}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    on_cpu = jax.default_backend() == "cpu"
    parser.add_argument("--models", default="gemma3-tiny" if on_cpu else "gemma3-270m,gemma3-1b")
    parser.add_argument("--maxlens", default="256" if on_cpu else "256,1024,2048")
    parser.add_argument("--lora-ranks", default="0,16", help="0: full fine-tuning")
    parser.add_argument("--tokens", type=int, default=8192 if on_cpu else 65536,
                        help="tokens per step (batch = tokens / maxlen)")
    parser.add_argument("--steps", type=int, default=3 if on_cpu else 10)
    parser.add_argument("--vocab", type=int, default=2048, help="the tiny preset's vocabulary")
    args = parser.parse_args(argv)

    devices = jax.device_count()
    print(f"{devices} x {jax.devices()[0].device_kind}", flush=True)
    rows = []
    for name in args.models.split(","):
        for rank in (int(r) for r in args.lora_ranks.split(",")):
            for maxlen in (int(n) for n in args.maxlens.split(",")):
                batch = max(devices, args.tokens // maxlen // devices * devices)
                case = Case(name, maxlen, rank, batch)
                try:
                    rows.append(measure(case, steps=args.steps, vocab=args.vocab))
                except Exception as error:  # noqa: BLE001 - e.g. out of memory: report, go on
                    rows.append({**dataclasses.asdict(case), "error": str(error).splitlines()[0]})
                print(rows[-1], flush=True)

    import pandas as pd

    print(pd.DataFrame(rows).to_markdown(index=False, floatfmt=",.3f"))
    return rows


if __name__ == "__main__":
    main()
