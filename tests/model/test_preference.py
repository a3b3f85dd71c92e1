"""DPO on packed pairs: the per-segment chunked NLL and the loss against direct formulas and
gemma's own ``DpoLoss``."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmalab.model import cross_entropy, preference
from tests.helpers.numerics import REORDERED_FLOAT32, assert_close_to_scale

VOCAB, DIM, SEGMENT = 32, 8, 6  # tokens per prompt + response sequence
PROMPT = 2  # the first tokens of each sequence are its prompt: no loss there


def packed_pairs(pairs: int, seed: int = 0):
    """One row holding ``pairs`` pairs (segments 1, 2 = pair 0's chosen, rejected, ...), with
    policy and reference hidden states, a tied embedding, targets and the response mask."""
    rng = np.random.default_rng(seed)
    length = 2 * pairs * SEGMENT
    segment_ids = np.repeat(np.arange(1, 2 * pairs + 1), SEGMENT)[None]
    mask = np.tile(np.arange(SEGMENT) >= PROMPT, 2 * pairs)[None]
    return {"policy": jnp.asarray(rng.normal(size=(1, length, DIM)), jnp.float32),
            "reference": jnp.asarray(rng.normal(size=(1, length, DIM)), jnp.float32),
            "embedding": jnp.asarray(rng.normal(size=(VOCAB, DIM)), jnp.float32),
            "targets": jnp.asarray(rng.integers(0, VOCAB, (1, length)), jnp.int32),
            "mask": jnp.asarray(mask), "segment_ids": jnp.asarray(segment_ids, jnp.int32)}


def segment_logps(hidden, data, *, num_segments, max_logits=1 << 20):
    nll, counts = cross_entropy.chunked_segment_nll(
        hidden, data["embedding"], data["targets"], data["mask"], data["segment_ids"],
        num_segments=num_segments, max_logits=max_logits)
    return -nll, counts


@pytest.mark.parametrize("max_logits", [1 << 20, 5 * VOCAB])  # one chunk; chunks of 5 positions
def test_segment_nll_sums_each_segments_response_tokens(max_logits):
    data = packed_pairs(2)
    logps, counts = segment_logps(data["policy"], data, num_segments=5, max_logits=max_logits)
    logits = np.asarray(data["policy"][0] @ data["embedding"].T, np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = log_probs[np.arange(logits.shape[0]), np.asarray(data["targets"][0])]
    picked = picked * np.asarray(data["mask"][0])
    expected = picked.reshape(4, SEGMENT).sum(-1)
    # float32 against float64: sums of one sign, so rtol is relative to their scale.
    np.testing.assert_allclose(np.asarray(logps[0, :4]), expected, rtol=1e-5)
    assert float(logps[0, 4]) == 0.0  # a column past the row's segments stays empty
    assert np.asarray(counts[0]).tolist() == [SEGMENT - PROMPT] * 4 + [0]
    # The segments' sums add up to the batch's loss, chunked the same way.
    total, count = cross_entropy.chunked_cross_entropy(
        data["policy"], data["embedding"], data["targets"], data["mask"], max_logits=max_logits)
    assert float(total) == pytest.approx(-float(logps.sum()), rel=REORDERED_FLOAT32)
    assert float(count) == float(counts.sum())


def test_segment_nll_gradient_matches_the_unchunked_one():
    data = packed_pairs(2)
    weights = jnp.arange(1.0, 5.0)

    def weighted(hidden, max_logits):
        return jnp.sum(segment_logps(hidden, data, num_segments=4, max_logits=max_logits)[0][0]
                       * weights)

    whole = jax.grad(weighted)(data["policy"], 1 << 20)
    chunked = jax.grad(weighted)(data["policy"], 5 * VOCAB)
    assert_close_to_scale(chunked, whole, REORDERED_FLOAT32)


def direct_dpo(policy, reference, beta, smoothing):
    """The DPO formula per pair, written out in float64."""
    delta = (policy[0] - reference[0]) - (policy[1] - reference[1])

    def log_sigmoid(x):
        return -math.log1p(math.exp(-x))
    return -((1 - smoothing) * log_sigmoid(beta * delta) + smoothing * log_sigmoid(-beta * delta))


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_dpo_sums_equal_the_formula_and_skip_incomplete_pairs(smoothing):
    rng = np.random.default_rng(3)
    policy, reference = rng.normal(size=(2, 3, 6)) * 5
    counts = np.full((3, 6), 4.0)
    counts[1, 5] = 0.0  # row 1's third pair has no rejected response: it does not count
    beta = 0.5
    sums = preference.dpo_sums(jnp.asarray(policy), jnp.asarray(reference), jnp.asarray(counts),
                               beta=beta, label_smoothing=smoothing)
    losses, margins, wins = [], [], 0
    for row in range(3):
        for pair in range(3):
            if row == 1 and pair == 2:
                continue
            chosen, rejected = 2 * pair, 2 * pair + 1
            pol = (policy[row, chosen], policy[row, rejected])
            ref = (reference[row, chosen], reference[row, rejected])
            losses.append(direct_dpo(pol, ref, beta, smoothing))
            margin = beta * ((pol[0] - ref[0]) - (pol[1] - ref[1]))
            margins.append(margin)
            wins += margin > 0
    assert float(sums.pairs) == 8
    # float32 of the float64 formula, elementwise and a sum of 8: a few roundings. The margins
    # are differences of values ~5-15: their error is absolute.
    assert float(sums.loss) == pytest.approx(sum(losses), rel=1e-5)
    assert float(sums.reward_margin) == pytest.approx(sum(margins), rel=1e-5, abs=1e-4)
    assert float(sums.reward_accuracy) == wins
    means = preference.pair_means(sums)
    assert float(means["dpo_loss"]) == pytest.approx(sum(losses) / 8, rel=1e-5)
    assert float(sums.response_tokens) == 8 * 8
    assert float(means["kl_estimate"]) == pytest.approx(
        float(sums.log_ratio) / (8 * 8), rel=1e-6)


def test_rpo_adds_the_chosen_replies_per_token_nll_and_leaves_dpos_part_alone():
    """``rpo_alpha``: each complete pair's loss gains alpha x its chosen reply's mean NLL per
    token (RPO); ``dpo_loss`` stays DPO's, and the term's gradient lifts the chosen replies
    only, each by alpha / its tokens."""
    rng = np.random.default_rng(4)
    policy, reference = (rng.normal(size=(2, 2, 4)) * 5 - 20).astype(np.float32)
    counts = rng.integers(1, 9, size=(2, 4)).astype(np.float32)
    counts[1, 3] = 0.0  # row 1's second pair is incomplete: no term for it either
    alpha, beta = 0.7, 0.2

    def sums_of(p, rpo_alpha):
        return preference.dpo_sums(p, jnp.asarray(reference), jnp.asarray(counts), beta=beta,
                                   rpo_alpha=rpo_alpha)

    plain, rpo = sums_of(jnp.asarray(policy), 0.0), sums_of(jnp.asarray(policy), alpha)
    complete = [(0, 0), (0, 1), (1, 0)]
    nll = sum(-policy[row, 2 * pair] / counts[row, 2 * pair] for row, pair in complete)
    # A few float32 roundings of the formula; the term's gradient is DPO's cancelled: exact but
    # for a rounding of DPO's own (~1e-8).
    assert float(rpo.dpo_loss) == pytest.approx(float(plain.loss), rel=1e-6)
    assert float(rpo.chosen_nll) == pytest.approx(nll, rel=1e-5)
    assert float(rpo.loss) == pytest.approx(float(plain.loss) + alpha * nll, rel=1e-5)
    assert float(preference.pair_means(rpo)["chosen_nll"]) == pytest.approx(nll / 3, rel=1e-5)
    term = jax.grad(lambda p: sums_of(p, alpha).loss - sums_of(p, 0.0).loss)(
        jnp.asarray(policy))
    expected = np.zeros_like(policy)
    for row, pair in complete:
        expected[row, 2 * pair] = -alpha / counts[row, 2 * pair]
    np.testing.assert_allclose(np.asarray(term), expected, rtol=1e-5, atol=1e-7)


def test_dpo_equals_gemmas_dpo_loss_on_full_logits():
    from gemma import gm

    pairs = 3
    data = packed_pairs(pairs, seed=5)
    beta, smoothing = 0.1, 0.1
    policy, counts = segment_logps(data["policy"], data, num_segments=2 * pairs,
                                   max_logits=7 * VOCAB)
    reference, _ = segment_logps(data["reference"], data, num_segments=2 * pairs)
    sums = preference.dpo_sums(policy, reference, counts, beta=beta, label_smoothing=smoothing)

    def by_pair(x):  # [1, 2 * pairs * SEGMENT, ...] -> [pairs, 2, SEGMENT, ...]
        return x.reshape(pairs, 2, SEGMENT, *x.shape[2:])

    theirs = gm.losses.DpoLoss(tau=beta, label_smoothing=smoothing, tokens="t",
                               sequence_mask="m", policy_logits="p", anchor_logits="a")
    values = theirs.get_values(
        tokens=by_pair(data["targets"]), sequence_mask=by_pair(data["mask"]),
        policy_logits=by_pair(data["policy"] @ data["embedding"].T),
        anchor_logits=by_pair(data["reference"] @ data["embedding"].T))
    assert float(sums.pairs) == pairs
    # Chunked against gemma's full logits: float32 summed in another order.
    assert float(sums.loss) / pairs == pytest.approx(float(jnp.mean(values)),
                                                     rel=REORDERED_FLOAT32)


def test_the_gradient_vanishes_as_beta_goes_to_zero():
    data = packed_pairs(2, seed=7)
    reference, _ = segment_logps(data["reference"], data, num_segments=4)

    def loss(hidden, beta):
        policy, counts = segment_logps(hidden, data, num_segments=4)
        return preference.dpo_sums(policy, reference, counts, beta=beta).loss

    def grad_norm(beta):
        return float(jnp.linalg.norm(jax.grad(loss)(data["policy"], beta)))

    assert grad_norm(0.1) > 1e-3
    # Near beta = 0 the pair's weight sigmoid(-beta delta) is 1/2: the gradient is linear in beta.
    assert grad_norm(1e-4) == pytest.approx(grad_norm(1e-3) / 10, rel=0.01)
    assert grad_norm(1e-9) < 1e-8
    # The reference gets no gradient: it is the frozen base's.
    assert float(jnp.abs(jax.grad(lambda r: preference.dpo_sums(
        segment_logps(data["policy"], data, num_segments=4)[0], r,
        segment_logps(data["policy"], data, num_segments=4)[1], beta=0.1).loss)(reference)
        ).sum()) == 0.0


def test_packed_and_unpacked_pairs_give_the_same_loss():
    """Two pairs in one row, or each pair in its own padded row: the same loss."""
    data = packed_pairs(2, seed=9)
    policy, counts = segment_logps(data["policy"], data, num_segments=4)
    reference, _ = segment_logps(data["reference"], data, num_segments=4)
    packed = preference.dpo_sums(policy, reference, counts, beta=0.1)
    half = 2 * SEGMENT
    padding = 3

    def one_pair_per_row(x, fill=0):
        rows = [x[:, :half], x[:, half:]]
        widths = ((0, 0), (0, padding)) + ((0, 0),) * (x.ndim - 2)
        return jnp.concatenate([jnp.pad(r, widths, constant_values=fill) for r in rows])

    unpacked = {key: one_pair_per_row(value) for key, value in data.items() if key != "embedding"}
    unpacked["segment_ids"] = unpacked["segment_ids"].at[1].set(
        jnp.where(unpacked["segment_ids"][1] > 0, unpacked["segment_ids"][1] - 2, 0))
    unpacked["embedding"] = data["embedding"]
    policy, counts = segment_logps(unpacked["policy"], unpacked, num_segments=2)
    reference, _ = segment_logps(unpacked["reference"], unpacked, num_segments=2)
    alone = preference.dpo_sums(policy, reference, counts, beta=0.1)
    assert float(alone.pairs) == float(packed.pairs) == 2
    assert float(alone.loss) == pytest.approx(float(packed.loss), rel=REORDERED_FLOAT32)
