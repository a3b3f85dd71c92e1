"""The chunked loss's gradient formed in its forward pass, against autodiff through checkpointed
chunks (the logits recomputed in the backward pass), in one training step, side by side.

    .venv/bin/python bench/loss_recompute.py            # the embedded 270M, LoRA r8, 8 x 512

Both steps are compiled in one process from the same ``Experiment``; ``recompute`` swaps the
loss's chunk loop for the previous form while it is traced. They first run once each from
copies of the same state on the same batch (their losses and gradient norms must agree), then
alternate ``--rounds`` timed steps. The batch's logits exceed ``LOSS_CHUNK_LOGITS`` (8 x 512
x 262k = 4x the bound), so the loss runs in chunks, as on every accelerator-sized batch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from gemmalab.config import TrainConfig
from gemmalab.data import packing
from gemmalab.model import cross_entropy, mesh
from gemmalab.train import optimization
from gemmalab.train.experiment import Experiment

sys.path.insert(0, os.path.dirname(__file__))
from cross_entropy import report  # noqa: E402  (bench/cross_entropy.py, beside this file)


def recomputed_chunks(hidden, embedding, update, fields, ids, softcap, num_segments):
    """The previous chunk loop: autodiff through ``jax.checkpoint``-ed chunks."""
    def one(args):
        h, (t, m, *segments) = args[0], args[1:]
        logits = cross_entropy._chunk_logits(h, embedding, update, ids, softcap)
        return cross_entropy._reduce(cross_entropy.token_nll(logits, t), m, segments,
                                     num_segments)

    totals, counts = jax.lax.map(jax.checkpoint(one), (hidden, *fields))
    return jnp.sum(totals, axis=0), jnp.sum(counts, axis=0)


@contextlib.contextmanager
def loss_part_replaced(name: str, previous: Callable[..., Any]) -> Iterator[None]:
    """``cross_entropy.<name>`` is ``previous`` inside: a step traced there has the old form."""
    now = getattr(cross_entropy, name)
    setattr(cross_entropy, name, previous)
    try:
        yield
    finally:
        setattr(cross_entropy, name, now)


def recompute() -> contextlib.AbstractContextManager:
    return loss_part_replaced("_fused_chunks", recomputed_chunks)


def side_by_side(config: TrainConfig, before: contextlib.AbstractContextManager, *,
                 now: str, was: str, rounds: int) -> None:
    """One ``Experiment``'s training step as it is (``now``) and traced inside ``before``
    (``was``), compiled in one process: one step each from copies of the same state on the
    same batch (losses and gradient norms to compare), then ``rounds`` alternating timed steps.
    Also bench/embedding_gradient.py's."""
    with tempfile.TemporaryDirectory() as output_dir:
        config = config.replace(output_dir=output_dir)
        experiment = Experiment.prepare(config)
        weights = experiment.weights
        steps = {now: experiment.compile()}
        rows = jax.ShapeDtypeStruct((config.trainer.batch_size, config.data.maxlen), jnp.int32,
                                    sharding=mesh.batch_sharding(experiment.mesh))
        with before:
            step = optimization.make_train_step(
                experiment.model, experiment.optimizer, experiment.schedule,
                experiment.compute_dtype, experiment.mesh, weights.state_shardings,
                frozen_shardings=weights.frozen_shardings)
            steps[was] = step.lower(
                weights.state, {name: rows for name in packing.FIELDS}, weights.frozen).compile()
        batch = experiment.next_batch()
        width = max(map(len, steps))
        for name, compiled in steps.items():
            memory = compiled.memory_analysis()
            _, metrics = compiled(jax.tree.map(jnp.copy, weights.state), batch, weights.frozen)
            print(f"{name:{width}s} loss {float(metrics['loss']):.6f}  grad_norm "
                  f"{float(metrics['grad_norm']):.6f}  temporaries "
                  f"{memory.temp_size_in_bytes / 2**30:.2f} GiB")
        state, times = weights.state, {name: [] for name in steps}
        for _ in range(rounds):
            for name, compiled in steps.items():
                started = time.perf_counter()
                state, metrics = compiled(state, batch, weights.frozen)
                jax.block_until_ready(metrics)
                times[name].append(time.perf_counter() - started)
    training = f"LoRA r{config.lora.rank}" if config.lora.rank else "full fine-tuning"
    print(
        f"{config.trainer.batch_size} x {config.data.maxlen}, {training}, "
        f"{rounds} alternating rounds"
    )
    report(times)


def bench_config(**overrides: object) -> TrainConfig:
    """The embedded 270M on its stories, a run long enough never to end while timed."""
    return TrainConfig.flat(**{"checkpoint": "embedded:gemma3-270m", "embedded_stories": 2000,
                          "max_steps": 100, "eval_every": 0, "checkpoint_every": 0,
                          "max_eval_stories": 8, **overrides})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maxlen", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = bench_config(lora_rank=args.lora_rank, batch_size=args.batch_size,
                          maxlen=args.maxlen)
    side_by_side(config, recompute(), now="fused (now)", was="recompute (before)",
                 rounds=args.rounds)


if __name__ == "__main__":
    main()
