"""XLA CPU's bf16 matmul rate by the form of the dot: which layouts of a step's matmuls run fast.

XLA's CPU backend hands a dot to YNNPACK only in some forms (``xla/backends/cpu/ynn_support.cc``:
bf16 x bf16 -> f32, the lhs contracting its last dimension, neither operand column-major);
other forms run elsewhere, several times slower. This times, in one process, the square
reference (what ``cpu_mfu`` is measured against) and the forms the 270M step has: the logits
``[T, D] x [V, D]^T``, their input gradient ``[T, V] x [V, D]``, the embedding's gradient
(full fine-tuning) in the form autodiff emits and in forms that avoid it, and the model's
projections forward and backward. Run by hand on a quiet host:

    .venv/bin/python bench/cpu_dot_forms.py [--vocab 65536] [--repeats 4]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def rate(fn: Callable, *args: jax.Array, flops: float, repeats: int) -> tuple[float, float]:
    """Best seconds of ``repeats`` calls after a compile-and-warm-up call, and GFLOP/s."""
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - started)
    best = min(times)
    return best, flops / best / 1e9


def forms(vocab: int, tokens: int = 1024, dim: int = 640, size: int = 2048
          ) -> list[tuple[str, Callable, tuple, float]]:
    """``(name, function, operands, FLOPs)`` of each form timed."""
    keys = jax.random.split(jax.random.key(0), 6)
    bf16, f32 = jnp.bfloat16, jnp.float32
    n = size
    a, b = (jax.random.normal(k, (n, n), bf16) for k in keys[:2])
    x = jax.random.normal(keys[2], (tokens, dim), bf16)
    embedding = jax.random.normal(keys[3], (vocab, dim), bf16)
    gradient = jax.random.normal(keys[4], (tokens, vocab), bf16)
    square, logits = 2.0 * n**3, 2.0 * tokens * vocab * dim

    def barrier_transposed(t: jax.Array) -> jax.Array:  # XLA folds it into the dot's layout
        return jax.lax.optimization_barrier(jnp.transpose(t))

    def materialized_transposed(t: jax.Array) -> jax.Array:
        """``t^T`` written out row-major: flattened behind the barrier, no layout can fold it."""
        flat = jax.lax.optimization_barrier(jnp.transpose(t).reshape(-1))
        return flat.reshape(t.shape[::-1])

    table = [
        ("square a.b (cpu_mfu's reference)", jnp.dot, (a, b), square),
        ("square a.b -> f32", lambda a, b: jnp.dot(a, b, preferred_element_type=f32), (a, b),
         square),
        ("square a.b^T (a transpose feeding the dot)", lambda a, b: a @ b.T, (a, b), square),
        ("square einsum mk,nk->mn", lambda a, b: jnp.einsum("mk,nk->mn", a, b), (a, b), square),
        ("square einsum km,kn->mn (lhs contracts dim 0)",
         lambda a, b: jnp.einsum("km,kn->mn", a, b), (a, b), square),
        ("square f32 a.b", jnp.dot, (a.astype(f32), b.astype(f32)), square),
        ("logits x.E^T", lambda x, e: x @ e.T, (x, embedding), logits),
        ("logits einsum td,vd->tv -> f32 (the loss's form)",
         lambda x, e: jnp.einsum("td,vd->tv", x, e, preferred_element_type=f32), (x, embedding),
         logits),
        ("logits x.E^T with E^T stored: td,dv->tv -> f32",
         lambda x, et: jnp.einsum("td,dv->tv", x, et, preferred_element_type=f32),
         (x, jnp.transpose(embedding)), logits),
        ("logits vocabulary-major: vd,td->vt -> f32",
         lambda x, e: jnp.einsum("vd,td->vt", e, x, preferred_element_type=f32), (x, embedding),
         logits),
        ("input gradient g.E", lambda g, e: g @ e, (gradient, embedding), logits),
        ("embedding gradient tv,td->vd -> f32 (autodiff's form)",
         lambda g, x: jnp.einsum("tv,td->vd", g, x, preferred_element_type=f32), (gradient, x),
         logits),
        ("embedding gradient g^T copied first, vt,td->vd",
         lambda g, x: jnp.einsum("vt,td->vd", barrier_transposed(g), x,
                                 preferred_element_type=f32), (gradient, x), logits),
        ("embedding gradient transposed: x^T copied, dt,tv->dv",
         lambda g, x: jnp.einsum("dt,tv->dv", barrier_transposed(x), g,
                                 preferred_element_type=f32), (gradient, x), logits),
        ("embedding gradient transposed: x^T materialized, dt,tv->dv",
         lambda g, x: jnp.einsum("dt,tv->dv", materialized_transposed(x), g,
                                 preferred_element_type=f32), (gradient, x), logits),
    ]
    for inner, outer in ((dim, size), (size, dim)):
        w = jax.random.normal(keys[5], (inner, outer), bf16)
        y = jax.random.normal(keys[5], (tokens, outer), bf16)
        flops = 2.0 * tokens * inner * outer
        x_in = jax.random.normal(keys[2], (tokens, inner), bf16)
        table += [
            (f"projection x[{tokens},{inner}].w[{inner},{outer}]", jnp.dot, (x_in, w), flops),
            (f"its input gradient as autodiff emits it (dy.w^T, {outer} contracted)",
             lambda x, w, y: jax.vjp(lambda x: x @ w, x)[1](y)[0], (x_in, w, y), flops),
            (f"the same written dy @ w.T ({outer} contracted)", lambda y, w: y @ w.T, (y, w),
             flops),
            # Full fine-tuning's weight gradient contracts the tokens, dimension 0 of both.
            (f"its weight gradient td,tf->df (w[{inner},{outer}], {tokens} contracted)",
             lambda x, y: jnp.einsum("td,tf->df", x, y), (x_in, y), flops),
            (f"the same, x^T materialized: dt,tf->df (w[{inner},{outer}])",
             lambda x, y: jnp.einsum("dt,tf->df", materialized_transposed(x), y), (x_in, y),
             flops),
        ]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=65536,
                        help="vocabulary of the logits forms (Gemma's 262144 / 4 by default)")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    print(f"| dot form (bf16 operands, vocab {args.vocab}) | ms (best) | GFLOP/s |")
    print("|---|---|---|")
    for name, fn, operands, flops in forms(args.vocab):
        seconds, gflops = rate(fn, *operands, flops=flops, repeats=args.repeats)
        print(f"| {name} | {seconds * 1e3:.1f} | {gflops:.0f} |", flush=True)


if __name__ == "__main__":
    main()
