"""Rejection masks: 1 = keep the token, 0 = drop it (always 0 on padding). `[B, T]` float32.

With log ρ_t = log π_train − log π_rollout:

    IcePop token mask      keep t   iff  lo ≤ ρ_t ≤ hi
    geometric seq. mask    keep seq iff  lo ≤ exp(mean_t log ρ_t) ≤ hi
    product seq. mask      keep seq iff  lo ≤ exp(Σ_t log ρ_t) ≤ hi
    outlier veto           keep seq iff  every valid token has lo ≤ ρ_t ≤ hi
    divergence mask        keep iff  lo ≤ agg(k_t) ≤ hi, with the per-token statistics
                               k1 = −log ρ,  k2 = ½ (log ρ)²,  k3 = ρ − 1 − log ρ
                           and agg ∈ {token (no aggregation), seq_sum, seq_mean, seq_max}.

The four ratio masks compare in log space, log lo ≤ log ρ ≤ log hi, on the unclamped log-ratio, so
any bound in [0, ∞] means what it says (a ratio clamped to e^±20 first would make a bound outside
[e^-20, e^20], such as a veto at 1e-10, silently inert). The k-statistics clamp log ρ to ±20 (as verl).

A bound of `None` means "no bound on that side". Bounds are inclusive. Thresholds for k1 are in
k1 units (−log ρ). verl's (≥ 0.7) `rollout_rs_threshold="a_b"` for a `*_k1` option keeps
log a ≤ k1 ≤ log b, i.e. ρ ∈ [1/b, 1/a]: here `divergence_low=log a, divergence_high=log b`
(`k1_bounds_from_verl`), or, for seq_mean_k1, the geometric mask with [1/b, 1/a].
"""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp

from portable_rl.errors import ConfigError
from portable_rl.tis.ratios import (SAFETY_BOUND, as_mask, broadcast_to_tokens, clean_log_ratio,
                                    seq_max, seq_mean, seq_sum)

ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token", "seq_sum", "seq_mean", "seq_max")


def check_bounds(low, high, what: str) -> None:
    """Raise a one-line error for an inverted [low, high]. Only concrete Python/numpy numbers are
    checked, so bounds may also be traced values inside `jax.jit`."""
    concrete = isinstance(low, numbers.Real) and isinstance(high, numbers.Real)
    if concrete and float(low) > float(high):
        raise ConfigError(f"{what}: lower bound {low} > upper bound {high}; swap them")


def _in_bounds(values, low, high):
    keep = jnp.ones(values.shape, bool)
    if low is not None:
        keep = keep & (values >= low)
    if high is not None:
        keep = keep & (values <= high)
    return keep


def _log_bound(bound):
    """log of a ratio bound ≥ 0 (log 0 = −inf): exact on the host for a number, traced otherwise."""
    if isinstance(bound, numbers.Real):
        return math.log(bound) if bound > 0 else -math.inf
    return jnp.log(jnp.asarray(bound, jnp.float32))


def _in_ratio_bounds(log_values, low, high):
    """low ≤ exp(log_values) ≤ high, decided as log low ≤ log_values ≤ log high (no clamp, no overflow)."""
    return _in_bounds(log_values, None if low is None else _log_bound(low),
                      None if high is None else _log_bound(high))


def k1_bounds_from_verl(threshold) -> tuple[float, float]:
    """verl's (≥ 0.7) `rollout_rs_threshold` for a `*_k1` option → (divergence_low, divergence_high).

    "a_b" (a string, as verl writes it) keeps log a ≤ −log ρ ≤ log b, i.e. ρ ∈ [1/b, 1/a], so the k1
    bounds here are (log a, log b). A single number b means a = 1/b (verl's rule): (−log b, log b).
    """
    if isinstance(threshold, str) and "_" in threshold:
        low_text, high_text = threshold.split("_", 1)
        low, high = float(low_text), float(high_text)
    else:
        high = float(threshold)
        low = 1.0 / high if high > 0 else math.nan
    if not (low > 0 and high > 0):
        raise ConfigError(f"verl k1 threshold {threshold!r}: both ratio bounds must be > 0, e.g. '0.999_1.001'")
    check_bounds(low, high, f"verl k1 threshold {threshold!r}")
    return math.log(low), math.log(high)


def _token_mask(keep_bt, response_mask):
    return (keep_bt & as_mask(response_mask)).astype(jnp.float32)


def _seq_mask(keep_b, response_mask):
    return broadcast_to_tokens(keep_b.astype(jnp.float32), response_mask)


def icepop_token_mask(log_ratio, response_mask, low=0.5, high=5.0) -> jnp.ndarray:
    """Keep tokens with low ≤ ρ_t ≤ high (IcePop). `[B, T]` float32."""
    check_bounds(low, high, "icepop_token_mask")
    log_ratio = clean_log_ratio(log_ratio, response_mask)
    return _token_mask(_in_ratio_bounds(log_ratio, low, high), response_mask)


def geometric_sequence_mask(log_ratio, response_mask, low=None, high=None) -> jnp.ndarray:
    """Keep whole sequences with low ≤ exp(mean_t log ρ_t) ≤ high. `[B, T]` float32."""
    check_bounds(low, high, "geometric_sequence_mask")
    log_ratio = clean_log_ratio(log_ratio, response_mask)
    log_geo = seq_mean(log_ratio, response_mask)  # [B]
    return _seq_mask(_in_ratio_bounds(log_geo, low, high), response_mask)


def product_sequence_mask(log_ratio, response_mask, low=None, high=None) -> jnp.ndarray:
    """Keep whole sequences with low ≤ Π_t ρ_t ≤ high. `[B, T]` float32."""
    check_bounds(low, high, "product_sequence_mask")
    log_ratio = clean_log_ratio(log_ratio, response_mask)
    log_prod = seq_sum(log_ratio, response_mask)  # [B]
    return _seq_mask(_in_ratio_bounds(log_prod, low, high), response_mask)


def outlier_veto_mask(log_ratio, response_mask, low=None, high=None) -> jnp.ndarray:
    """Drop a whole sequence if any valid token has ρ_t outside [low, high]. `[B, T]` float32."""
    check_bounds(low, high, "outlier_veto_mask")
    mask = as_mask(response_mask)
    log_ratio = clean_log_ratio(log_ratio, mask)
    token_ok = _in_ratio_bounds(log_ratio, low, high) | ~mask  # padding never vetoes
    return _seq_mask(token_ok.all(axis=-1), mask)


def divergence_statistic(log_ratio, estimator: str) -> jnp.ndarray:
    """Per-token k1 / k2 / k3 of a (clean) log-ratio, clamped to ±20 first. Same shape."""
    lr = jnp.clip(jnp.asarray(log_ratio, jnp.float32), -SAFETY_BOUND, SAFETY_BOUND)
    if estimator == "k1":
        return -lr
    if estimator == "k2":
        return 0.5 * jnp.square(lr)
    if estimator == "k3":
        return jnp.exp(lr) - 1.0 - lr
    raise ConfigError(f"unknown divergence estimator {estimator!r}; use one of {ESTIMATORS}")


def divergence_mask(log_ratio, response_mask, estimator: str = "k3", aggregation: str = "seq_mean",
                    low=None, high=None) -> jnp.ndarray:
    """Keep where low ≤ agg_t k(log ρ_t) ≤ high (verl ≥ 0.7's `rollout_rs=<aggregation>_<estimator>`).

    aggregation="token" masks single tokens; the seq_* aggregations keep or drop whole sequences.
    """
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"unknown divergence aggregation {aggregation!r}; use one of {AGGREGATIONS}")
    check_bounds(low, high, f"divergence_mask({aggregation}_{estimator})")
    log_ratio = clean_log_ratio(log_ratio, response_mask)
    stat = divergence_statistic(log_ratio, estimator)  # [B, T]
    if aggregation == "token":
        return _token_mask(_in_bounds(stat, low, high), response_mask)
    reduce = {"seq_sum": seq_sum, "seq_mean": seq_mean, "seq_max": seq_max}[aggregation]
    return _seq_mask(_in_bounds(reduce(stat, response_mask), low, high), response_mask)


def parse_divergence(name: str) -> tuple[str, str]:
    """'seq_mean_k3' → ('k3', 'seq_mean'); a clear error for anything else."""
    aggregation, _, estimator = name.rpartition("_")
    if aggregation not in AGGREGATIONS or estimator not in ESTIMATORS:
        options = [f"{a}_{e}" for a in AGGREGATIONS for e in ESTIMATORS]
        raise ConfigError(f"unknown divergence mask {name!r}; use one of {options}")
    return estimator, aggregation
