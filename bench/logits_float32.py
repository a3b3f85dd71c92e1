"""The loss's logits written in float32 (now) against bfloat16 (before), in one training step,
side by side.

    .venv/bin/python bench/logits_float32.py                  # the embedded 270M, LoRA r8, 8 x 128
    .venv/bin/python bench/logits_float32.py --maxlen 512     # the chunked loss (4 chunks)
    .venv/bin/python bench/logits_float32.py --loss-only      # the loss alone, [1024, 262k]

XLA's CPU backend hands the logits' product to YNNPACK, which accumulates in float32; asked for
bfloat16 it rounds as it writes, and that costs more than writing twice the bytes. Before, the
logits were bfloat16, and when they fitted one chunk plain autodiff ran through them (their
float32 gradient would have made the input gradient a mixed-dtype, non-YNNPACK matmul); now
every chunk, one or many, goes through the fused loss and its gradient is cast to the compute
dtype before that matmul. Both steps are compiled in one process from one ``Experiment``
(bench/loss_recompute.py's ``side_by_side``): one step each from copies of the same state on the
same batch (losses and gradient norms must agree within bfloat16 rounding), then alternating
rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmalab.model import cross_entropy

sys.path.insert(0, os.path.dirname(__file__))
from loss_recompute import bench_config, loss_part_replaced, side_by_side  # noqa: E402


def bf16_chunk_logits(h: jax.Array, embedding: jax.Array, update: jax.Array | None,
                      ids: jax.Array | None, softcap: float | None) -> jax.Array:
    """The previous ``_chunk_logits``: the product in the compute dtype."""
    logits = jnp.einsum("...d,vd->...v", h, embedding)
    if update is not None:
        logits = logits.at[..., ids].add(jnp.einsum("...d,kd->...k", h, update))
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    return logits


def kept_one_chunk(hidden: jax.Array, embedding: jax.Array, targets: jax.Array, mask: jax.Array,
                   segment_ids: jax.Array | None, num_segments: int, *, softcap: float | None,
                   max_logits: int, mesh: Any, row_updates: Any) -> tuple[jax.Array, jax.Array]:
    """The previous ``_chunked_nll`` where all logits fit one chunk: kept whole, plain autodiff
    through ``token_nll`` (sequence sums, DPO's, are not part of this bench)."""
    rows, length, _ = hidden.shape
    if segment_ids is not None or max(1, max_logits // embedding.shape[0] // rows) < length:
        return now_chunked_nll(hidden, embedding, targets, mask, segment_ids, num_segments,
                               softcap=softcap, max_logits=max_logits, mesh=mesh,
                               row_updates=row_updates)
    ids, update = row_updates if row_updates is not None else (None, None)
    logits = bf16_chunk_logits(hidden, embedding, update, ids, softcap)
    return cross_entropy.masked_cross_entropy(logits, targets, mask)


now_chunked_nll = cross_entropy._chunked_nll


@contextlib.contextmanager
def bf16_logits() -> Iterator[None]:
    with loss_part_replaced("_chunk_logits", bf16_chunk_logits), \
            loss_part_replaced("_chunked_nll", kept_one_chunk):
        yield


def loss_only(rounds: int, tokens: int = 1024, dim: int = 640, vocab: int = 262_144) -> None:
    """The 270M's loss alone (forward and the hidden states' gradient, a frozen head), both
    forms in one process, alternating: time and compiled temporaries."""
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (8, tokens // 8, dim), jnp.float32).astype(jnp.bfloat16)
    head = (jax.random.normal(keys[1], (vocab, dim)) * 0.05).astype(jnp.bfloat16)
    targets = jax.random.randint(keys[2], (8, tokens // 8), 0, vocab)
    mask = jnp.ones((8, tokens // 8), bool)

    def loss(h: jax.Array) -> jax.Array:
        total, count = cross_entropy.chunked_cross_entropy(
            h, head, targets, mask, max_logits=cross_entropy.LOSS_CHUNK_LOGITS)
        return total / count

    forms = {}
    for name, context in (("float32 (now)", contextlib.nullcontext()),
                          ("bfloat16 (before)", bf16_logits())):
        with context:
            forms[name] = jax.jit(jax.value_and_grad(loss)).lower(hidden).compile()
    times: dict[str, list[float]] = {name: [] for name in forms}
    for name, compiled in forms.items():
        value, _ = jax.block_until_ready(compiled(hidden))
        print(f"{name:18s} loss {float(value):.6f}  temporaries "
              f"{compiled.memory_analysis().temp_size_in_bytes / 2**30:.2f} GiB")
    for _ in range(rounds):
        for name, compiled in forms.items():
            started = time.perf_counter()
            jax.block_until_ready(compiled(hidden))
            times[name].append(time.perf_counter() - started)
    for name, seconds in times.items():
        print(f"{name:18s} median {np.median(seconds):.3f} s  best {min(seconds):.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maxlen", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--loss-only", action="store_true")
    args = parser.parse_args()
    if args.loss_only:
        loss_only(args.rounds)
        return
    config = bench_config(lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank or None,
                          batch_size=args.batch_size, maxlen=args.maxlen)
    side_by_side(config, bf16_logits(), now="float32 (now)", was="bfloat16 (before)",
                 rounds=args.rounds)


if __name__ == "__main__":
    main()
