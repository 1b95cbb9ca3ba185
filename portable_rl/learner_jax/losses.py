"""Clip-higher PPO policy loss (DAPO / GRPO) with rollout correction and five aggregation modes.

Per token t of a response, with advantage A (per sequence or per token) and
r_t = exp(log π_θ(y_t) − log π_old(y_t))  (log difference clamped to ±20 before the exp):

    l1_t = −A · r_t
    l2_t = −A · clip(r_t, 1 − ε_low, 1 + ε_high)             DAPO "clip-higher": ε_low=0.2, ε_high=0.28
    l_t  = max(l1_t, l2_t)                                   the pessimistic PPO surrogate
    dual clip (c > 1, only where A < 0):  l_t = min(l_t, −A · c)      (Ye et al. 2020, c = 3)
    correction:  l_t ← w_t · l_t                             w_t = stop_gradient TIS weight

Two ways to use rollout logprobs (π_rollout, from the engine):
    mode="decoupled": π_old is the learner's recomputation of the behaviour policy; the rollout
        mismatch is corrected by `correction_weights` (e.g. from `tis.apply_rollout_correction`).
    mode="bypass":    π_old := π_rollout, so the PPO ratio itself is π_θ / π_rollout (no recompute).
        `correction_weights` still multiply if given (usually None; rejection goes in the mask).

Aggregation of l_t over the response mask m (B sequences, T positions):
    token-mean               Σ_bt m l / Σ_bt m                                   (DAPO)
    seq-mean-token-sum       mean_b Σ_t m l           (over sequences with ≥ 1 token)
    seq-mean-token-mean      mean_b (Σ_t m l / Σ_t m) (over sequences with ≥ 1 token)   (GRPO)
    seq-mean-token-sum-norm  Σ_bt m l / (B · L)       L = norm_constant, default T; keep L fixed
                             across steps (e.g. the max response length)
                             (Dr. GRPO; SkyRL's definition, and verl ≥ 0.7's with global_batch_size = B)
    token-sum-norm           Σ_bt m l / L             verl ≤ 0.6.1's seq-mean-token-sum-norm (no B)

Rejected tokens (a `keep_mask` from the correction) belong in `response_mask`: pass
`response_mask * keep_mask` so they also leave the denominators.

Every aggregation is a weighted token sum, loss = Σ_t w_t l_t, with weights fixed by the mask alone
(`loss_token_weights`, host numpy, N sequences of len_s tokens, N_tok tokens in all):

    token-mean               w = 1 / N_tok
    seq-mean-token-sum       w = 1 / N_seq                N_seq = sequences with ≥ 1 token
    seq-mean-token-mean      w = 1 / (N_seq · len_s)
    seq-mean-token-sum-norm  w = 1 / (N · L)              N = all sequences (a constant), L = norm_constant
    token-sum-norm           w = 1 / L

So a mini-batch split into micro-batches gets the exact mini-batch loss and gradient by summing the
micro-batches' Σ w l with weights computed once from the whole mini-batch (`policy_loss(...,
token_weights=w)`, rl/learner.py); `aggregate_loss` is the reference they equal (tests/test_losses.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from portable_rl.errors import ConfigError
from portable_rl.tis.ratios import SAFETY_BOUND as _LOG_RATIO_BOUND
from portable_rl.tis.ratios import masked_max, masked_mean as _masked_mean

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                "token-sum-norm")
POLICY_LOSS_MODES = ("decoupled", "bypass")  # validated once, by rl.LossConfig


def aggregate_loss(loss_bt, response_mask, aggregation: str = "token-mean", norm_constant=None):
    """Reduce a per-token loss `[B, T]` to a scalar with one of `AGGREGATIONS` (see module doc)."""
    mask = jnp.asarray(response_mask) > 0  # [B, T]
    loss_bt = jnp.where(mask, jnp.asarray(loss_bt, jnp.float32), 0.0)
    tokens_per_seq = mask.sum(axis=-1).astype(jnp.float32)  # [B]
    has_tokens = tokens_per_seq > 0
    if aggregation == "token-mean":
        return loss_bt.sum() / jnp.maximum(tokens_per_seq.sum(), 1.0)
    if aggregation == "seq-mean-token-sum":
        return _masked_mean(loss_bt.sum(axis=-1), has_tokens)
    if aggregation == "seq-mean-token-mean":
        return _masked_mean(loss_bt.sum(axis=-1) / jnp.maximum(tokens_per_seq, 1.0), has_tokens)
    norm = loss_bt.shape[-1] if norm_constant is None else norm_constant
    if aggregation == "seq-mean-token-sum-norm":
        return loss_bt.sum() / (loss_bt.shape[0] * norm)
    if aggregation == "token-sum-norm":
        return loss_bt.sum() / norm
    raise ConfigError(f"unknown loss aggregation {aggregation!r}; use one of {AGGREGATIONS}")


def loss_token_weights(response_mask, aggregation: str = "token-mean", norm_constant=None, *,
                       sequence_ids=None, num_sequences=None) -> np.ndarray:
    """Weights w `[B, T]` float32 (0 off the mask) with Σ w·l = `aggregate_loss(l, response_mask, ...)` (numpy).

    `sequence_ids` `[B, T]` int (which sequence each token belongs to, e.g. a packed layout's global
    ids; < 0 = none): None means each row is one sequence. `num_sequences` is N of
    seq-mean-token-sum-norm (default: the number of rows, as `aggregate_loss`); `norm_constant` its L
    (default T).
    """
    mask = np.asarray(response_mask) > 0                                   # [B, T]
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"unknown loss aggregation {aggregation!r}; use one of {AGGREGATIONS}")
    if sequence_ids is None:
        sequence_ids = np.broadcast_to(np.arange(mask.shape[0])[:, None], mask.shape)
    ids = np.where(mask, np.asarray(sequence_ids), -1)                     # [B, T]
    tokens_per_seq = np.bincount(ids[mask], minlength=ids.max(initial=-1) + 1)  # [S]
    n_tok, n_seq = tokens_per_seq.sum(), np.count_nonzero(tokens_per_seq)
    if aggregation == "token-mean":
        w = np.full(mask.shape, 1.0 / max(n_tok, 1))
    elif aggregation == "seq-mean-token-sum":
        w = np.full(mask.shape, 1.0 / max(n_seq, 1))
    elif aggregation == "seq-mean-token-mean":
        w = 1.0 / (max(n_seq, 1) * np.maximum(tokens_per_seq, 1)[np.maximum(ids, 0)])
    else:
        norm = mask.shape[-1] if norm_constant is None else norm_constant
        n = 1 if aggregation == "token-sum-norm" else mask.shape[0] if num_sequences is None else num_sequences
        w = np.full(mask.shape, 1.0 / (n * norm))
    return np.where(mask, w, 0.0).astype(np.float32)


def _token_advantages(advantages, shape):
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 1 and adv.shape[0] == shape[0]:
        return jnp.broadcast_to(adv[:, None], shape)  # per-sequence → every token
    if adv.shape == tuple(shape):
        return adv
    raise ValueError(f"advantages must be [batch] or [batch, seq] = {tuple(shape)}, got {adv.shape}")


def policy_loss(new_logprobs, old_logprobs, advantages, response_mask, *, rollout_logprobs=None,
                correction_weights=None, clip_eps_low: float = 0.2, clip_eps_high: float = 0.28,
                dual_clip_c=None, aggregation: str = "token-mean", norm_constant=None,
                mode: str = "decoupled", token_weights=None):
    """PPO-clip surrogate → (scalar loss, metrics dict of scalars).

    Shapes: logprobs and `response_mask` `[B, T]`; `advantages` `[B]` (one per sequence, broadcast
    to its tokens) or `[B, T]`; `correction_weights` `[B, T]` or None. `old_logprobs` is ignored in
    bypass mode (may be None). Gradients flow only through `new_logprobs`.
    `token_weights` `[B, T]` (`loss_token_weights` of a whole mini-batch): loss = Σ w·l, replacing
    `aggregation` (a micro-batch's share of the mini-batch loss); None: `aggregate_loss`.

    Metrics: clip_frac (tokens where the clipped branch is taken), clip_frac_low / clip_frac_high
    (r below 1−ε_low with A < 0 / above 1+ε_high with A > 0), dual_clip_frac, approx_kl
    (mean(log π_old − log π_θ), k1), approx_kl_k3 (mean(r − 1 − log r)), ratio_mean, ratio_max,
    correction_weight_mean; all over valid tokens.
    `mode` (POLICY_LOSS_MODES), `aggregation`, the clip range and `dual_clip_c` are `rl.LossConfig`'s,
    validated there.
    """
    if mode == "bypass":
        if rollout_logprobs is None:
            raise ValueError("mode='bypass' uses rollout_logprobs as the old policy; pass rollout_logprobs")
        old_logprobs = rollout_logprobs
    elif old_logprobs is None:
        raise ValueError("mode='decoupled' needs old_logprobs (the learner's recomputed logprobs)")

    mask = jnp.asarray(response_mask) > 0  # [B, T]
    new = jnp.asarray(new_logprobs, jnp.float32)
    old = jax.lax.stop_gradient(jnp.asarray(old_logprobs, jnp.float32))
    adv = jax.lax.stop_gradient(_token_advantages(advantages, new.shape))  # [B, T]
    # Padding may hold anything (even NaN/-inf); zero it before any arithmetic.
    log_ratio = jnp.where(mask, jnp.clip(new - old, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND), 0.0)
    adv = jnp.where(mask, adv, 0.0)
    ratio = jnp.exp(log_ratio)  # [B, T]

    loss1 = -adv * ratio
    loss2 = -adv * jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss_bt = jnp.maximum(loss1, loss2)
    clipped = (loss2 > loss1) & mask
    dual = jnp.zeros_like(mask)
    if dual_clip_c is not None:
        loss3 = -adv * dual_clip_c
        dual = (adv < 0) & (loss3 < loss_bt) & mask
        loss_bt = jnp.where(adv < 0, jnp.minimum(loss_bt, loss3), loss_bt)

    weight = jnp.ones_like(loss_bt)
    if correction_weights is not None:
        weight = jax.lax.stop_gradient(jnp.asarray(correction_weights, jnp.float32))
        if weight.shape != loss_bt.shape:
            raise ValueError(f"correction_weights must be [batch, seq] = {loss_bt.shape}, got {weight.shape}")
        weight = jnp.where(mask, weight, 0.0)
        loss_bt = loss_bt * weight
    if token_weights is None:
        loss = aggregate_loss(loss_bt, mask, aggregation, norm_constant)
    else:
        token_weights = jnp.asarray(token_weights, jnp.float32)
        if token_weights.shape != loss_bt.shape:
            raise ValueError(f"token_weights must be [batch, seq] = {loss_bt.shape}, got {token_weights.shape}")
        loss = jnp.where(mask, token_weights * loss_bt, 0.0).sum()

    f32 = jnp.float32
    metrics = {
        "clip_frac": _masked_mean(clipped.astype(f32), mask),
        "clip_frac_low": _masked_mean(((ratio < 1.0 - clip_eps_low) & (adv < 0)).astype(f32), mask),
        "clip_frac_high": _masked_mean(((ratio > 1.0 + clip_eps_high) & (adv > 0)).astype(f32), mask),
        "dual_clip_frac": _masked_mean(dual.astype(f32), mask),
        "approx_kl": jax.lax.stop_gradient(_masked_mean(-log_ratio, mask)),
        "approx_kl_k3": jax.lax.stop_gradient(_masked_mean(ratio - 1.0 - log_ratio, mask)),
        "ratio_mean": jax.lax.stop_gradient(_masked_mean(ratio, mask)),
        "ratio_max": jax.lax.stop_gradient(masked_max(ratio, mask)),
        "correction_weight_mean": _masked_mean(weight, mask),
    }
    return loss, metrics
