"""Direct preference optimisation (DPO, Rafailov et al. 2023) on packed preference pairs.

A pair is a prompt with a chosen and a rejected response. In a packed row each pair takes two
consecutive segments: segment ``2k + 1`` is prompt + chosen, ``2k + 2`` prompt + rejected (ids
start at 1; 0 is padding), so a pair never straddles two rows. The loss falls on the responses'
tokens only (the rows' ``loss_mask``). A sequence's log-probability is the sum of its
loss-bearing tokens' log-probabilities: ``cross_entropy.chunked_segment_nll`` gives it per
segment from the chunked loss, never from whole ``[B, L, V]`` logits.

The loss of a pair, with ``delta = (policy - reference)[chosen] - (policy - reference)[rejected]``
in sequence log-probabilities, is TRL's (``loss_type="sigmoid"``) and gemma's
``gm.losses.DpoLoss``'s:
``-(1 - s) log sigmoid(beta delta) - s log sigmoid(-beta delta)`` (``s``: label smoothing).

With ``rpo_alpha`` > 0 each pair's loss adds ``rpo_alpha`` times the policy's per-token NLL of the
chosen reply (RPO, Pang et al. 2024; TRL's ``rpo_alpha``). DPO alone may widen a pair's gap by
lowering both replies, the chosen one too, and with it what they share (a reply's ending): this
term holds the chosen reply's likelihood up.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class PairSums(NamedTuple):
    """Sums over a batch's complete pairs (divide by ``pairs`` for means), all fp32 scalars."""

    loss: jax.Array  # the objective: DPO's, plus RPO's term when rpo_alpha > 0
    dpo_loss: jax.Array
    chosen_nll: jax.Array  # the policy's per-token NLL of each chosen reply (RPO's term)
    pairs: jax.Array  # how many pairs had both responses in the batch
    reward_accuracy: jax.Array  # pairs whose chosen reward beat the rejected one's
    reward_margin: jax.Array  # chosen reward - rejected reward
    chosen_reward: jax.Array  # beta * (policy - reference) log-probability of the chosen
    rejected_reward: jax.Array
    chosen_logp: jax.Array  # the policy's sequence log-probabilities
    rejected_logp: jax.Array
    log_ratio: jax.Array  # policy - reference log-probability, summed over both responses' tokens
    response_tokens: jax.Array  # loss-bearing tokens of both responses (log_ratio's denominator)
    chosen_tokens: jax.Array  # the chosen responses' (their per-token perplexity's denominator)


def as_pairs(segment_values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[B, S]`` per-segment values (column ``k``: segment ``k + 1``) -> the chosen and the
    rejected responses' ``[B, S // 2]`` values, pair by pair."""
    rows, segments = segment_values.shape
    pairs = segment_values[:, : segments - segments % 2].reshape(rows, segments // 2, 2)
    return pairs[..., 0], pairs[..., 1]


def dpo_sums(policy_logps: jax.Array, reference_logps: jax.Array, token_counts: jax.Array, *,
             beta: float, label_smoothing: float = 0.0, rpo_alpha: float = 0.0) -> PairSums:
    """The DPO loss and its diagnostics summed over every complete pair of the batch.

    ``policy_logps``, ``reference_logps``: ``[B, S]`` sequence log-probabilities per segment
    (minus ``chunked_segment_nll``'s sums; the reference's without gradient), ``token_counts``:
    their loss-bearing tokens. A pair counts when both responses have loss-bearing tokens;
    the others (padding, a segment id past the row's pairs) add nothing.
    """
    reference_logps = jax.lax.stop_gradient(reference_logps)
    policy_chosen, policy_rejected = as_pairs(policy_logps)
    reference_chosen, reference_rejected = as_pairs(reference_logps)
    chosen_tokens, rejected_tokens = as_pairs(token_counts)
    complete = ((chosen_tokens > 0) & (rejected_tokens > 0)).astype(jnp.float32)
    chosen_reward = beta * (policy_chosen - reference_chosen)
    rejected_reward = beta * (policy_rejected - reference_rejected)
    margin = chosen_reward - rejected_reward
    losses = -((1.0 - label_smoothing) * jax.nn.log_sigmoid(margin)
               + label_smoothing * jax.nn.log_sigmoid(-margin))
    chosen_nll = -policy_chosen / jnp.maximum(chosen_tokens, 1)

    def total(values: jax.Array) -> jax.Array:
        return jnp.sum(values * complete)

    objective = losses + rpo_alpha * chosen_nll if rpo_alpha else losses
    return PairSums(
        loss=total(objective), dpo_loss=total(losses), chosen_nll=total(chosen_nll),
        pairs=jnp.sum(complete),
        reward_accuracy=total((margin > 0).astype(jnp.float32)), reward_margin=total(margin),
        chosen_reward=total(chosen_reward), rejected_reward=total(rejected_reward),
        chosen_logp=total(policy_chosen), rejected_logp=total(policy_rejected),
        log_ratio=total((policy_chosen - reference_chosen) + (policy_rejected
                                                                - reference_rejected)),
        response_tokens=total(chosen_tokens + rejected_tokens), chosen_tokens=total(chosen_tokens))


def pair_means(sums: PairSums) -> dict[str, jax.Array]:
    """The per-pair means a run logs (``dpo_loss``, ``chosen_nll``, ``reward_accuracy``, ...),
    and the per-token log-ratio of policy to reference on the responses (``kl_estimate``: an
    estimate of KL(policy || reference) from the dataset's responses, not from samples of the
    policy)."""
    pairs = jnp.maximum(sums.pairs, 1.0)
    return {"dpo_loss": sums.dpo_loss / pairs, "chosen_nll": sums.chosen_nll / pairs,
            "reward_accuracy": sums.reward_accuracy / pairs,
            "reward_margin": sums.reward_margin / pairs,
            "chosen_reward": sums.chosen_reward / pairs,
            "rejected_reward": sums.rejected_reward / pairs,
            "chosen_logp": sums.chosen_logp / pairs, "rejected_logp": sums.rejected_logp / pairs,
            "kl_estimate": sums.log_ratio / jnp.maximum(sums.response_tokens, 1.0),
            "pairs": sums.pairs}
