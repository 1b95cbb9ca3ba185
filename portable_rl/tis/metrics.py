"""Train/rollout mismatch diagnostics: one dict of float32 scalars, valid tokens only.

Notation: a_t = log π_train(y_t), b_t = log π_rollout(y_t), log ρ_t = a_t − b_t (clamped to ±20 before
any exp), ρ_t = exp(log ρ_t), p = exp(logprob). "mean_t" is over a sequence's valid tokens, "mean_seq"
over sequences with at least one valid token, plain "mean" over all valid tokens of the batch.

    kl                       mean(b − a)                      k1 estimate of KL(π_rollout ‖ π_train)
    k3_kl                    mean(ρ − 1 − log ρ)              k3 estimate of the same KL (≥ 0)
    training_log_ppl         mean_seq(−mean_t a)              training_ppl = mean_seq exp(−mean_t a)
    rollout_log_ppl          mean_seq(−mean_t b)              rollout_ppl  = mean_seq exp(−mean_t b)
    log_ppl_diff             mean_seq(d), d = mean_t b − mean_t a   (= log of the per-sequence ppl ratio)
    log_ppl_abs_diff         mean_seq |d|;  log_ppl_diff_max / _min = max / min over sequences of d
    ppl_ratio                mean_seq exp(d)                  (training ppl / rollout ppl per sequence)
    chi2_token               mean(ρ²) − 1
    chi2_seq                 mean_seq(exp(2 Σ_t log ρ_t)) − 1
    ess                      mean(ρ)² / mean(ρ²)              normalised effective sample size in (0, 1], raw ρ
    ess_clamped              the same on ρ clamped to [1/C, C]  verl ≤ 0.7.1's rollout_is_eff_sample_size
                                                              (token level); C = clip (None: = ess)
    rho_mean/_std/_min/_max  statistics of ρ_t
    rho_frac_above_clip      fraction with ρ_t > C;   rho_frac_below_inv_clip: fraction with ρ_t < 1/C
                             (both decided in log space on the unclamped log ρ, so any C counts right)
    prob_abs_diff_mean/_max  mean / max of |p_train − p_rollout|
    prob_pearson             Pearson correlation of p_train and p_rollout (1 if both are identical
                             constants, 0 if only one has zero variance)
    valid_tokens             number of valid tokens

On-policy inputs (a = b) give kl = k3_kl = chi2_* = log_ppl_diff* = prob_abs_diff_* = 0, ess =
ppl_ratio = 1. Names follow verl's `rollout_corr/*` metrics; prefix them when logging.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from portable_rl.errors import ConfigError
from portable_rl.tis.ratios import (SAFETY_BOUND, as_mask, masked_max, masked_mean, masked_min,
                                    masked_std, safe_exp, seq_mean, seq_sum)


def _pearson(x, y, mask):
    mx, my = masked_mean(x, mask), masked_mean(y, mask)
    dx, dy = jnp.where(mask, x - mx, 0.0), jnp.where(mask, y - my, 0.0)
    cov = masked_mean(dx * dy, mask)
    denom = jnp.sqrt(masked_mean(dx * dx, mask) * masked_mean(dy * dy, mask))
    identical = jnp.all(jnp.where(mask, x == y, True))
    return jnp.where(denom > 0, cov / jnp.where(denom > 0, denom, 1.0), jnp.where(identical, 1.0, 0.0))


def mismatch_metrics(train_logprobs, rollout_logprobs, response_mask, *, clip: float | None = 2.0) -> dict:
    """Diagnostics of π_train vs π_rollout on `[B, T]` logprobs; see the module docstring for keys."""
    if clip is not None and not clip > 0:
        raise ConfigError(f"mismatch_metrics clip must be > 0 (or None for no cap), got {clip}")
    mask = as_mask(response_mask)  # [B, T]
    has_tokens = mask.any(axis=-1)  # [B]
    a = jnp.where(mask, jnp.asarray(train_logprobs, jnp.float32), 0.0)
    b = jnp.where(mask, jnp.asarray(rollout_logprobs, jnp.float32), 0.0)
    log_rho = jnp.clip(a - b, -SAFETY_BOUND, SAFETY_BOUND)  # [B, T]
    rho = jnp.exp(log_rho)
    log_clip = math.log(clip) if clip is not None and clip < math.inf else math.inf
    rho_clamped = jnp.clip(rho, math.exp(-log_clip), math.exp(log_clip)) if log_clip < math.inf else rho

    train_log_ppl = -seq_mean(a, mask)  # [B]
    rollout_log_ppl = -seq_mean(b, mask)
    log_ppl_diff = train_log_ppl - rollout_log_ppl  # = mean_t b − mean_t a
    seq_log_rho = jnp.clip(seq_sum(log_rho, mask), -SAFETY_BOUND, SAFETY_BOUND)  # [B]
    mean_rho = masked_mean(rho, mask)
    mean_rho_sq = masked_mean(jnp.square(rho), mask)
    p_train, p_rollout = jnp.exp(a), jnp.exp(b)
    abs_dp = jnp.abs(p_train - p_rollout)
    return {
        "kl": masked_mean(b - a, mask),
        "k3_kl": masked_mean(rho - 1.0 - log_rho, mask),
        "training_ppl": masked_mean(safe_exp(train_log_ppl), has_tokens),
        "training_log_ppl": masked_mean(train_log_ppl, has_tokens),
        "rollout_ppl": masked_mean(safe_exp(rollout_log_ppl), has_tokens),
        "rollout_log_ppl": masked_mean(rollout_log_ppl, has_tokens),
        "log_ppl_diff": masked_mean(log_ppl_diff, has_tokens),
        "log_ppl_abs_diff": masked_mean(jnp.abs(log_ppl_diff), has_tokens),
        "log_ppl_diff_max": masked_max(log_ppl_diff, has_tokens),
        "log_ppl_diff_min": masked_min(log_ppl_diff, has_tokens),
        "ppl_ratio": masked_mean(safe_exp(log_ppl_diff), has_tokens),
        "chi2_token": mean_rho_sq - 1.0,
        "chi2_seq": masked_mean(jnp.exp(2.0 * seq_log_rho), has_tokens) - 1.0,
        "ess": jnp.square(mean_rho) / jnp.maximum(mean_rho_sq, 1e-30),
        "ess_clamped": jnp.square(masked_mean(rho_clamped, mask))
                       / jnp.maximum(masked_mean(jnp.square(rho_clamped), mask), 1e-30),
        "rho_mean": mean_rho,
        "rho_std": masked_std(rho, mask),
        "rho_min": masked_min(rho, mask),
        "rho_max": masked_max(rho, mask),
        "rho_frac_above_clip": masked_mean((a - b > log_clip).astype(jnp.float32), mask),
        "rho_frac_below_inv_clip": masked_mean((a - b < -log_clip).astype(jnp.float32), mask),
        "prob_abs_diff_mean": masked_mean(abs_dp, mask),
        "prob_abs_diff_max": masked_max(abs_dp, mask),
        "prob_pearson": _pearson(p_train, p_rollout, mask),
        "valid_tokens": mask.sum().astype(jnp.float32),
    }
