"""The embedding's gradient in full fine-tuning, two ways of forming it in the chunked loss,
each against what it replaced, in one training step, side by side.

    .venv/bin/python bench/embedding_gradient.py                 # the 270M, full, 8 x 512
    .venv/bin/python bench/embedding_gradient.py --form layout

``--form forward`` (the default): the batch's summed loss has one cotangent for every position,
so the embedding's gradient ``sum_t g[t, v] h[t, d]`` is formed in the loss's forward pass from
each chunk's logits' gradient and scaled in the backward pass, against recomputing every
chunk's logits in the backward pass for it (``EMBEDDING_GRADIENT_IN_FORWARD`` off: what
per-segment losses still do).

``--form layout``: in that backward recompute, the logits laid out ``[V, tokens]`` against
``[tokens, V]`` (autodiff's form, before): from ``[tokens, V]`` the product contracts dimension
0 of both operands, a form XLA's CPU backend runs outside its fast matmul library.

Both steps come from one ``Experiment`` (bench/loss_recompute.py's ``side_by_side``); the
previous form is swapped in while the second is traced. The batch's logits exceed
``LOSS_CHUNK_LOGITS``, so the loss runs in chunks.
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
    """The recompute's logits token-major, as before ``--form layout``'s change (and with the
    embedding's gradient recomputed in the backward pass, where that form lives)."""
    stack = contextlib.ExitStack()
    stack.enter_context(recomputed())
    stack.enter_context(loss_part_replaced("_chunk_embedding_gradient", token_major_gradient))
    return stack


def recomputed() -> contextlib.AbstractContextManager:
    """Every chunk's logits recomputed in the backward pass for the embedding's gradient."""
    return loss_part_replaced("EMBEDDING_GRADIENT_IN_FORWARD", False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maxlen", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--form", choices=["forward", "layout"], default="forward")
    args = parser.parse_args()
    config = bench_config(lora_rank=0, batch_size=args.batch_size, maxlen=args.maxlen)
    if args.form == "forward":
        side_by_side(config, recomputed(), now="formed in the forward pass (now)",
                     was="recomputed in the backward pass (before)", rounds=args.rounds)
    else:
        side_by_side(config, token_major(), now="vocabulary-major recompute",
                     was="token-major recompute (before)", rounds=args.rounds)


if __name__ == "__main__":
    main()
