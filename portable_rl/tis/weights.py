"""Truncated importance-sampling weights (stop-gradient, float32, 0 on padding).

With log ρ_t = log π_train(y_t) − log π_rollout(y_t) and a cap C:

    token TIS           w_t = min(ρ_t, C)                                   ρ_t = exp(log ρ_t)
    sequence TIS        w_t = min(exp(Σ_s log ρ_s), C)          for every token t of the sequence
    geometric sequence  w_t = min(exp(mean_s log ρ_s), C)       for every token t of the sequence
    self-normalised     w_t ← w_t / mean(w)                     (mean over valid tokens, or sequences)

Every log quantity is clamped to ±20 right before its exp. `clip=None` (or inf) means plain,
untruncated IS. The weights change the measure, not the objective, so they carry no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from portable_rl.tis.ratios import (as_mask, broadcast_to_tokens, clean_log_ratio, masked_mean,
                                    safe_exp, seq_mean, seq_sum)


def _cap(weights, clip):
    if clip is None:
        return weights
    return jnp.minimum(weights, clip)


def token_tis_weights(log_ratio, response_mask, clip=2.0) -> jnp.ndarray:
    """min(ρ_t, C) per token. `[B, T]` float32, 0 on padding."""
    log_ratio = clean_log_ratio(log_ratio, response_mask)  # [B, T]
    weights = _cap(safe_exp(log_ratio), clip)
    return jax.lax.stop_gradient(jnp.where(as_mask(response_mask), weights, 0.0))


def sequence_tis_weights(log_ratio, response_mask, clip=2.0) -> jnp.ndarray:
    """min(Π_t ρ_t, C) broadcast to the sequence's tokens. `[B, T]` float32, 0 on padding."""
    log_ratio = clean_log_ratio(log_ratio, response_mask)
    per_seq = _cap(safe_exp(seq_sum(log_ratio, response_mask)), clip)  # [B]
    return jax.lax.stop_gradient(broadcast_to_tokens(per_seq, response_mask))


def geometric_sequence_weights(log_ratio, response_mask, clip=2.0) -> jnp.ndarray:
    """min(exp(mean_t log ρ_t), C) broadcast to the sequence's tokens. `[B, T]` float32."""
    log_ratio = clean_log_ratio(log_ratio, response_mask)
    per_seq = _cap(safe_exp(seq_mean(log_ratio, response_mask)), clip)  # [B]
    return jax.lax.stop_gradient(broadcast_to_tokens(per_seq, response_mask))


def self_normalize(weights, response_mask, per: str = "token") -> jnp.ndarray:
    """Divide by the mean weight so the batch's average weight is 1.

    per="token": mean over valid tokens; per="sequence": mean over sequences with at least one
    valid token (right for sequence-level weights, which are constant within a sequence).
    A mean below 1e-8 (everything rejected) leaves the weights unchanged.
    """
    mask = as_mask(response_mask)
    weights = jnp.where(mask, jnp.asarray(weights, jnp.float32), 0.0)
    if per == "token":
        mean = masked_mean(weights, mask)
    elif per == "sequence":
        mean = masked_mean(seq_mean(weights, mask), mask.any(axis=-1))
    else:
        raise ValueError(f"self_normalize per={per!r}; use 'token' or 'sequence'")
    safe = jnp.where(mean > 1e-8, mean, 1.0)
    return jax.lax.stop_gradient(weights / safe)
