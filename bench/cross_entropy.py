"""The loss's forward form, before and after, side by side in one process: the logits matmul of
Gemma 3's 262k vocabulary plus the NLL, forward and backward, in alternating rounds.

    .venv/bin/python bench/cross_entropy.py                  # 270M's head, batch 8 x 128, bf16

``fp32 copy`` is the previous forward: the logits widened once, and that fp32 copy read by the
max, the sum of exponentials and the picked logit (XLA wrote it out whole: [tokens, V] fp32).
``in place`` is ``cross_entropy.token_nll`` now: the max and the picked logit read the logits in
their own dtype, only the sum of exponentials widens them. Both share the backward. Prints the
loss and gradient sums of both (they must agree) and each form's best and median time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from gemmalab.model import cross_entropy


def fp32_copy_forward(logits: jax.Array, targets: jax.Array
                      ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    wide = logits.astype(jnp.float32)
    logsumexp = jax.nn.logsumexp(wide, axis=-1)
    picked = jnp.take_along_axis(wide, targets[..., None], axis=-1)[..., 0]
    return logsumexp - picked, (logits, targets, logsumexp)


fp32_copy_nll = jax.custom_vjp(lambda logits, targets: fp32_copy_forward(logits, targets)[0])
fp32_copy_nll.defvjp(fp32_copy_forward, cross_entropy._token_nll_backward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--dim", type=int, default=640)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--maxlen", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((args.rows, args.maxlen, args.dim)), dtype)
    embedding = jnp.asarray(rng.standard_normal((args.vocab, args.dim)) * 0.03, dtype)
    targets = jnp.asarray(rng.integers(0, args.vocab, (args.rows, args.maxlen)), jnp.int32)

    def loss_and_grad(nll):
        def loss(h):
            return jnp.sum(nll(jnp.einsum("...d,vd->...v", h, embedding), targets))
        return jax.jit(jax.value_and_grad(loss))

    forms = {"fp32 copy": loss_and_grad(fp32_copy_nll),
             "in place": loss_and_grad(cross_entropy.token_nll)}
    for name, form in forms.items():
        value, grad = form(hidden)
        print(f"{name:10s} loss {float(value):.6e}  |grad| sum "
              f"{float(jnp.abs(grad.astype(jnp.float32)).sum()):.6e}")
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.rounds):
        for name, form in forms.items():
            started = time.perf_counter()
            jax.block_until_ready(form(hidden))
            times[name].append(time.perf_counter() - started)
    print(f"{args.rows} x {args.maxlen} rows, vocabulary {args.vocab:,}, {args.dtype}, "
          f"{args.rounds} alternating rounds")
    report(times)


def report(times: dict[str, list[float]]) -> None:
    """Each form's best and median seconds, one line a form (also bench/loss_recompute.py)."""
    width = max(map(len, times))
    for name, seconds in times.items():
        print(f"{name:{width}s}  best {min(seconds):.3f} s  median "
              f"{statistics.median(seconds):.3f} s")


if __name__ == "__main__":
    main()
