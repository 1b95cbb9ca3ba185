"""Log importance ratios and the masked reductions every other `tis` module builds on.

    log ρ_t = log π_train(y_t) − log π_rollout(y_t)          (per response token)
    ρ_t     = exp(clip(log ρ_t, −20, 20))                     (clamp before every exp)

Conventions shared by the whole package:
- Inputs are `[B, T]` arrays (any float dtype; bf16 is upcast) and a 0/1 `response_mask` `[B, T]`.
- All arithmetic is float32.
- Padding never influences anything: padded entries are replaced by 0 *before* any arithmetic
  (`jnp.where`, not a multiply, so NaN/inf in padding cannot leak), and every output is 0 there.
- A sequence with no valid token is treated as having a log-ratio sum / mean of 0.
"""

from __future__ import annotations

import jax.numpy as jnp

# exp(20) ≈ 4.9e8: large enough to never bind in practice, small enough that ρ² stays finite in fp32.
SAFETY_BOUND = 20.0


def as_mask(response_mask) -> jnp.ndarray:
    """0/1 (any dtype, or bool) → bool `[B, T]`."""
    return jnp.asarray(response_mask) > 0


def log_ratio(train_logprobs, rollout_logprobs, response_mask) -> jnp.ndarray:
    """log π_train − log π_rollout in float32, exactly 0 on padding. `[B, T]`."""
    train = jnp.asarray(train_logprobs, jnp.float32)
    rollout = jnp.asarray(rollout_logprobs, jnp.float32)
    return jnp.where(as_mask(response_mask), train - rollout, 0.0)


def clean_log_ratio(log_ratio_bt, response_mask) -> jnp.ndarray:
    """A user-supplied log-ratio as float32 with padding set to 0 (NaN-safe). `[B, T]`."""
    return jnp.where(as_mask(response_mask), jnp.asarray(log_ratio_bt, jnp.float32), 0.0)


def safe_exp(x) -> jnp.ndarray:
    """exp(clip(x, ±SAFETY_BOUND)) — the only way this package exponentiates a log-ratio."""
    return jnp.exp(jnp.clip(x, -SAFETY_BOUND, SAFETY_BOUND))


def token_counts(response_mask) -> jnp.ndarray:
    """Valid tokens per sequence, float32 `[B]`."""
    return as_mask(response_mask).sum(axis=-1).astype(jnp.float32)


def seq_sum(values_bt, response_mask) -> jnp.ndarray:
    """Σ_t over valid tokens, `[B]`."""
    return jnp.where(as_mask(response_mask), values_bt, 0.0).sum(axis=-1)


def seq_mean(values_bt, response_mask) -> jnp.ndarray:
    """Mean over valid tokens of each sequence (0 for an empty sequence), `[B]`."""
    return seq_sum(values_bt, response_mask) / jnp.maximum(token_counts(response_mask), 1.0)


def seq_max(values_bt, response_mask) -> jnp.ndarray:
    """Max over valid tokens of each sequence (0 for an empty sequence), `[B]`."""
    mask = as_mask(response_mask)
    best = jnp.where(mask, values_bt, -jnp.inf).max(axis=-1)
    return jnp.where(mask.any(axis=-1), best, 0.0)


def masked_mean(values, mask) -> jnp.ndarray:
    """Mean over entries where mask is set (0 when none is), scalar. Works for `[B]` or `[B, T]`."""
    mask = as_mask(mask)
    total = jnp.where(mask, values, 0.0).sum()
    return total / jnp.maximum(mask.sum().astype(jnp.float32), 1.0)


def masked_std(values, mask) -> jnp.ndarray:
    """Population standard deviation over masked entries (0 when fewer than one), scalar."""
    mask = as_mask(mask)
    mean = masked_mean(values, mask)
    return jnp.sqrt(masked_mean(jnp.square(jnp.where(mask, values - mean, 0.0)), mask))


def masked_max(values, mask) -> jnp.ndarray:
    """Max over masked entries (0 when none), scalar."""
    mask = as_mask(mask)
    return jnp.where(mask.any(), jnp.where(mask, values, -jnp.inf).max(), 0.0)


def masked_min(values, mask) -> jnp.ndarray:
    """Min over masked entries (0 when none), scalar."""
    mask = as_mask(mask)
    return jnp.where(mask.any(), jnp.where(mask, values, jnp.inf).min(), 0.0)


def broadcast_to_tokens(per_seq_b, response_mask) -> jnp.ndarray:
    """A per-sequence value `[B]` on every valid token, 0 on padding. `[B, T]`."""
    mask = as_mask(response_mask)
    return jnp.where(mask, per_seq_b[:, None], 0.0)
