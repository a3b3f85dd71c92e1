"""Train-step throughput of a preset, side by side across compute dtypes, in one process.

    .venv/bin/python bench/step_throughput.py --model gemma3-tiny --vocab 2048 --batch 64

Reports tokens/s (padded), step time and peak host memory for each dtype, and their ratio.
Random tokens, every position loss-bearing: this measures the step, not the data pipeline.
"""

from __future__ import annotations

import argparse
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

from gemmalab.model import mesh, presets
from gemmalab.train import optimization


def measure(model, params, device_mesh, batch, compute_dtype, steps: int) -> float:
    schedule = optimization.learning_rate_schedule(1e-3, 1000, warmup_ratio=0.0, min_lr_ratio=1.0)
    optimizer = optimization.make_optimizer(schedule, weight_decay=0.0, b1=0.9, b2=0.95,
                                            max_grad_norm=1.0)
    # The step donates its state: give each measurement its own copy of the weights.
    state, shardings = optimization.init_state(jax.tree.map(jnp.copy, params), optimizer,
                                               device_mesh)
    step = optimization.make_train_step(model, optimizer, schedule, compute_dtype, device_mesh,
                                        shardings)
    state, metrics = step(state, batch, None)  # compile (no frozen base: full fine-tuning)
    jax.block_until_ready(metrics)
    started = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch, None)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-tiny")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--maxlen", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    config = presets.model_config(args.model, args.vocab)
    model = presets.build_model(config, param_dtype=jnp.float32)
    params = presets.init_params(model, seed=0, sample_length=args.maxlen)
    device_mesh = mesh.make_mesh()
    rng = np.random.default_rng(0)
    shape = (args.batch, args.maxlen)
    batch = mesh.global_batch({
        "tokens": rng.integers(3, args.vocab, shape).astype(np.int32),
        "targets": rng.integers(3, args.vocab, shape).astype(np.int32),
        "segment_ids": np.ones(shape, np.int32),
        "loss_mask": np.ones(shape, np.int32),
        "positions": np.tile(np.arange(args.maxlen, dtype=np.int32), (args.batch, 1)),
    }, device_mesh)
    print(f"{args.model} ({presets.parameter_count(params):,} params), batch {args.batch} x "
          f"{args.maxlen}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    results = {}
    for name in ("float32", "bfloat16"):
        seconds = measure(model, params, device_mesh, batch, jnp.dtype(name), args.steps)
        results[name] = seconds
        print(f"  compute {name:8s}: {seconds:.3f} s/step, "
              f"{args.batch * args.maxlen / seconds:,.0f} tokens/s")
    print(f"  bfloat16 / float32 throughput: {results['float32'] / results['bfloat16']:.2f}x")
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"  peak host memory: {peak_gb:.2f} GB")


if __name__ == "__main__":
    main()
