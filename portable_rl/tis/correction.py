"""`apply_rollout_correction`: the one call the training loop makes.

    log ρ_t   = log π_train(y_t) − log π_rollout(y_t)                       (fp32, 0 on padding)
    keep_t    = response_mask_t · Π_(active masks) mask_t                    (0/1)
    weight_t  = keep_t · w_t(mode, C)  [/ mean over kept of w, if self_normalize]   (stop-gradient)

The loss then uses `weight_t` as the per-token correction and `keep_t` as its response mask (so
aggregation denominators exclude rejected tokens). With mode="none" and no mask the weights are
1 on every valid token. Jit it with the config static: `jax.jit(apply_rollout_correction,
static_argnums=0)` (the config is a frozen, hashable dataclass).

Metrics: everything from `mismatch_metrics` (computed on the original response mask) plus

    weight_mean/_std/_min/_max   statistics of the final weights over kept tokens
    weight_ess                   mean(w)² / mean(w²) over kept tokens
    clipped_frac                 fraction of kept tokens whose uncapped weight exceeded C
    token_masked_frac            fraction of valid tokens rejected
    seq_masked_frac              fraction of sequences with at least one valid token rejected
    seq_dropped_frac             fraction of sequences with every valid token rejected
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from portable_rl.tis.config import RolloutCorrectionConfig
from portable_rl.tis.masks import (divergence_mask, geometric_sequence_mask, icepop_token_mask,
                                   outlier_veto_mask, parse_divergence, product_sequence_mask)
from portable_rl.tis.metrics import mismatch_metrics
from portable_rl.tis.ratios import (as_mask, log_ratio, masked_max, masked_mean, masked_min,
                                    masked_std, safe_exp, seq_mean, seq_sum)
from portable_rl.tis.weights import (geometric_sequence_weights, self_normalize,
                                     sequence_tis_weights, token_tis_weights)


def _keep_mask(config: RolloutCorrectionConfig, lr, mask):
    keep = mask.astype(jnp.float32)  # [B, T]
    if config.mask_enabled("token_mask"):
        keep = keep * icepop_token_mask(lr, mask, config.token_mask_low, config.token_mask_high)
    if config.mask_enabled("geo_mask"):
        keep = keep * geometric_sequence_mask(lr, mask, config.geo_mask_low, config.geo_mask_high)
    if config.mask_enabled("product_mask"):
        keep = keep * product_sequence_mask(lr, mask, config.product_mask_low, config.product_mask_high)
    if config.mask_enabled("veto"):
        keep = keep * outlier_veto_mask(lr, mask, config.veto_low, config.veto_high)
    if config.divergence is not None:
        estimator, aggregation = parse_divergence(config.divergence)
        keep = keep * divergence_mask(lr, mask, estimator, aggregation,
                                      config.divergence_low, config.divergence_high)
    return keep


def _raw_weights(config: RolloutCorrectionConfig, lr, mask):
    """(capped weights [B, T], uncapped weights [B, T]) for the configured mode."""
    if config.mode == "none":
        ones = mask.astype(jnp.float32)
        return ones, ones
    if config.mode == "token":
        return token_tis_weights(lr, mask, config.clip), safe_exp(lr)
    if config.mode == "sequence":
        uncapped = safe_exp(seq_sum(lr, mask))[:, None] * jnp.ones_like(lr)
        return sequence_tis_weights(lr, mask, config.clip), uncapped
    if config.mode == "geometric":
        uncapped = safe_exp(seq_mean(lr, mask))[:, None] * jnp.ones_like(lr)
        return geometric_sequence_weights(lr, mask, config.clip), uncapped
    raise ValueError(f"unknown rollout-correction mode {config.mode!r}")


def apply_rollout_correction(config: RolloutCorrectionConfig, train_logprobs, rollout_logprobs,
                             response_mask):
    """→ (weights [B, T] f32, keep_mask [B, T] f32 0/1, metrics dict of f32 scalars)."""
    if not isinstance(config, RolloutCorrectionConfig):
        raise TypeError(f"config must be a RolloutCorrectionConfig, got {type(config).__name__}")
    train_logprobs = jnp.asarray(train_logprobs)
    if train_logprobs.shape != jnp.shape(rollout_logprobs) or train_logprobs.shape != jnp.shape(response_mask):
        raise ValueError(f"shape mismatch: train {train_logprobs.shape}, rollout {jnp.shape(rollout_logprobs)}, "
                         f"mask {jnp.shape(response_mask)}; all must be [batch, seq]")
    mask = as_mask(response_mask)  # [B, T] bool
    lr = log_ratio(train_logprobs, rollout_logprobs, mask)  # [B, T] f32

    keep = _keep_mask(config, lr, mask)
    capped, uncapped = _raw_weights(config, lr, mask)
    weights = capped * keep
    if config.self_normalize:
        per = "token" if config.mode in ("none", "token") else "sequence"
        weights = self_normalize(weights, keep, per=per)

    clip = math.inf if config.clip is None or config.mode == "none" else config.clip
    metrics = mismatch_metrics(train_logprobs, rollout_logprobs, mask,
                               clip=math.inf if config.clip is None else config.clip)
    kept = keep > 0
    mean_w = masked_mean(weights, kept)
    rejected = mask & ~kept
    has_tokens = mask.any(axis=-1)
    metrics.update({
        "weight_mean": mean_w,
        "weight_std": masked_std(weights, kept),
        "weight_min": masked_min(weights, kept),
        "weight_max": masked_max(weights, kept),
        "weight_ess": jnp.square(mean_w) / jnp.maximum(masked_mean(jnp.square(weights), kept), 1e-30),
        "clipped_frac": masked_mean((uncapped > clip).astype(jnp.float32), kept),
        "token_masked_frac": masked_mean(rejected.astype(jnp.float32), mask),
        "seq_masked_frac": masked_mean(rejected.any(axis=-1).astype(jnp.float32), has_tokens),
        "seq_dropped_frac": masked_mean((~kept.any(axis=-1)).astype(jnp.float32), has_tokens),
    })
    return weights, keep, metrics
