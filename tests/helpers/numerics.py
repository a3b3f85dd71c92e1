"""Tolerances for comparing two programs that compute the same numbers by different routes.

Never a constant that passed on one CPU: XLA picks other kernels on another CPU kind (AVX-512,
AVX2, SSE4.2, AMX) and sums in another order. Each tolerance here is relative to the *scale* of
what is compared, and its name says why it is what it is.

Why the scale and not each entry: an entry that is a sum of many terms (a gradient, a logit)
carries a rounding error of the size of its terms, however small the sum comes out. A gradient
entry of 5e-3 beside entries of 2.6 differs by ~1e-6 between remat and no remat on an Intel
Xeon: 3e-4 of itself, but 6e-7 of its tensor's largest entry.
"""

import jax
import numpy as np

# The same float32 arithmetic summed in another order (remat, a mesh, a chunked loss, another
# CPU kernel): a few hundred float32 epsilons (1.2e-7) of the compared tensor's largest entry.
# Seen: 9e-6 (a scalar gradient summed over every token, through 8 layers; remat on AMD); 4.4e-5
# (gemma4-tiny-moe's adapter gradients, data x expert mesh against one device; AMD, AVX2).
REORDERED_FLOAT32 = 1e-4
# Values that went through bfloat16 on one side only, or in another order on both (8 bits of
# mantissa: one rounding is 2^-9 = 2e-3 of the value).
REORDERED_BFLOAT16 = 2e-2


def assert_close_to_scale(actual, expected, rel: float, err_msg: str = "") -> None:
    """``|actual - expected| <= rel * max|expected|`` everywhere (and ``rel`` of each entry
    besides): for arrays whose entries are sums of terms the size of the array's largest."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = float(np.abs(expected).max(initial=0.0))
    np.testing.assert_allclose(actual, expected, rtol=rel, atol=rel * scale, err_msg=err_msg)


def assert_trees_close_to_scale(actual, expected, rel: float) -> None:
    """``assert_close_to_scale`` leaf by leaf (each leaf its own scale), naming the failing
    leaf's path."""
    leaves = jax.tree_util.tree_leaves_with_path(expected)
    others = jax.tree.leaves(actual)
    assert len(others) == len(leaves), (len(others), len(leaves))
    for (path, want), got in zip(leaves, others, strict=True):
        assert_close_to_scale(got, want, rel, err_msg=jax.tree_util.keystr(path))
