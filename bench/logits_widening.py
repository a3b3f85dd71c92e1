"""The loss's gradient widening the logits apart from the log-sum-exp (now), against sharing
one float32 copy with it (before), in one training step, side by side.

    .venv/bin/python bench/logits_widening.py                  # the embedded 270M, LoRA r8, 8 x 128
    .venv/bin/python bench/logits_widening.py --maxlen 512     # the chunked loss (4 chunks)

The forward's sum of exponentials and the gradient's softmax both read the logits widened to
float32. Written the same way, XLA merged the two conversions into one, a float32 copy of the
whole ``[tokens, V]`` logits written out for both readers; apart, the sum's own conversion is
fused into it (XLA's CPU backend hands that reduction to YNNPACK with the conversion inside)
and the gradient's into its elementwise loop. ``cross_entropy._logit_gradient`` keeps them
apart with an optimization barrier. Both steps are compiled in one process from one
``Experiment`` (bench/loss_recompute.py's ``side_by_side``): one step each from copies of the
same state on the same batch (losses and gradient norms must agree), then alternating rounds.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from loss_recompute import bench_config, loss_part_replaced, side_by_side  # noqa: E402


def shared_widening(logits: jax.Array, logsumexp: jax.Array, targets: jax.Array,
                    weight: jax.Array, softcap: float | None, *, axis: int) -> jax.Array:
    """The previous ``_logit_gradient``: its float32 logits the same expression as the
    log-sum-exp's, so that XLA merged them."""
    logits32 = logits.astype(jnp.float32)
    gradient = (jnp.exp(logits32 - jnp.expand_dims(logsumexp, axis))
                - jax.nn.one_hot(targets, logits.shape[axis], dtype=jnp.float32, axis=axis))
    gradient = gradient * jnp.expand_dims(weight, axis)
    if softcap is not None:
        gradient = gradient * (1.0 - jnp.square(logits32 / softcap))
    return gradient.astype(logits.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maxlen", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    config = bench_config(lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank or None,
                          batch_size=args.batch_size, maxlen=args.maxlen)
    side_by_side(config, loss_part_replaced("_logit_gradient", shared_widening),
                 now="apart (now)", was="shared (before)", rounds=args.rounds)


if __name__ == "__main__":
    main()
