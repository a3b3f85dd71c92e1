"""The embedding's gradient in full fine-tuning, from vocabulary-major logits against the
token-major form it had, in one training step, side by side.

    .venv/bin/python bench/embedding_gradient.py       # the embedded 270M, full, 8 x 512

The chunked loss recomputes each chunk's logits in its backward pass for the embedding's own
gradient ``sum_t g[t, v] h[t, d]``. Laid out ``[tokens, V]`` (autodiff's form, and the one
before), that product contracts dimension 0 of both operands, a form XLA's CPU backend runs
outside its fast matmul library; recomputed ``[V, tokens]`` it contracts the last dimension of
its left operand. Both steps come from one ``Experiment`` (bench/loss_recompute.py's
``side_by_side``); ``token_major`` swaps the chunk's gradient for the previous form while the
second is traced. The batch's logits exceed ``LOSS_CHUNK_LOGITS``, so the loss runs in chunks.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import jax.numpy as jnp

from gemmalab.model import cross_entropy

sys.path.insert(0, os.path.dirname(__file__))
from loss_recompute import bench_config, loss_part_replaced, side_by_side  # noqa: E402  (beside this file)


def token_major_gradient(embedding, update, ids, softcap, h, weight, targets, mask, logsumexp):
    """The previous form: the chunk's logits and gradient ``[rows, span, V]``, the product in
    float32 contracting the chunk's positions (dimension 0 of both operands)."""
    del logsumexp  # recomputed, as it was
    _, gradient, _ = cross_entropy._unit_logit_gradient(h, embedding, update, ids, softcap,
                                                         targets, mask)
    return jnp.einsum("rlv,rl,rld->vd", gradient.astype(jnp.float32), weight,
                      h.astype(jnp.float32)).astype(embedding.dtype)


def token_major() -> contextlib.AbstractContextManager:
    return loss_part_replaced("_chunk_embedding_gradient", token_major_gradient)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maxlen", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = bench_config(lora_rank=0, batch_size=args.batch_size, maxlen=args.maxlen)
    side_by_side(config, token_major(), now="vocabulary-major (now)",
                 was="token-major (before)", rounds=args.rounds)


if __name__ == "__main__":
    main()
