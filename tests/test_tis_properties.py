"""Property tests (hypothesis) for portable_rl.tis: padding invariance, on-policy identity,
C → ∞ limit, jit == eager, bf16 inputs → fp32 answer within bf16 rounding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_rl.tis import (PRESETS, RolloutCorrectionConfig, apply_rollout_correction,
                             divergence_mask, geometric_sequence_mask, geometric_sequence_weights,
                             icepop_token_mask, mismatch_metrics, outlier_veto_mask,
                             product_sequence_mask, sequence_tis_weights, token_tis_weights)

SETTINGS = settings(max_examples=25, deadline=None)

# (seed, noise scale). Shapes are fixed so jit/op caches are reused across examples; what varies is
# the values, the mismatch size and every row's length (1..T).
B, T = 4, 6
CASES = st.tuples(st.integers(0, 2**31 - 1), st.floats(0.0, 1.5))

# Every per-token function as (name, fn(log_ratio, mask)).
FUNCS = [
    ("token_tis", lambda lr, m: token_tis_weights(lr, m, 2.0)),
    ("sequence_tis", lambda lr, m: sequence_tis_weights(lr, m, 2.0)),
    ("geometric", lambda lr, m: geometric_sequence_weights(lr, m, 2.0)),
    ("icepop", lambda lr, m: icepop_token_mask(lr, m, 0.5, 2.0)),
    ("geo_mask", lambda lr, m: geometric_sequence_mask(lr, m, 0.8, 1.25)),
    ("product_mask", lambda lr, m: product_sequence_mask(lr, m, 0.5, 2.0)),
    ("veto", lambda lr, m: outlier_veto_mask(lr, m, 0.2, 5.0)),
    ("k3_seq_mean", lambda lr, m: divergence_mask(lr, m, "k3", "seq_mean", high=0.1)),
    ("k1_seq_sum", lambda lr, m: divergence_mask(lr, m, "k1", "seq_sum", low=-0.5, high=0.5)),
    ("k2_seq_max", lambda lr, m: divergence_mask(lr, m, "k2", "seq_max", high=0.2)),
    ("k2_token", lambda lr, m: divergence_mask(lr, m, "k2", "token", high=0.2)),
]


def make_batch(case):
    """Right-padded logprobs with a mismatch of scale `noise`; every row has >= 1 valid token."""
    seed, noise = case
    b, t = B, T
    rng = np.random.default_rng(seed)
    rollout = np.log(rng.uniform(0.02, 1.0, (b, t))).astype(np.float32)
    train = (rollout + noise * rng.standard_normal((b, t))).astype(np.float32)
    lengths = rng.integers(1, t + 1, b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    return train, rollout, mask, rng


def pad_junk_and_widen(x, mask, rng, extra=3):
    """Fill padding with junk (NaN/±inf/large) and append `extra` more padded columns."""
    junk = rng.choice(np.array([np.nan, np.inf, -np.inf, 1e6, -7.0], np.float32), x.shape)
    x = np.where(mask > 0, x, junk).astype(np.float32)
    tail = rng.choice(np.array([np.nan, -np.inf, 3.0], np.float32), (x.shape[0], extra))
    return np.concatenate([x, tail], axis=1), np.concatenate([mask, np.zeros((x.shape[0], extra), np.float32)], 1)


def as_floats(metrics):
    return {k: float(v) for k, v in metrics.items()}


@SETTINGS
@given(CASES)
def test_padding_never_influences_any_output(case):
    train, rollout, mask, rng = make_batch(case)
    lr = train - rollout
    lr_pad, mask_pad = pad_junk_and_widen(lr, mask, rng)
    t = lr.shape[1]
    for name, fn in FUNCS:
        base, padded = np.asarray(fn(lr, mask)), np.asarray(fn(lr_pad, mask_pad))
        np.testing.assert_array_equal(padded[:, :t], base, err_msg=name)
        assert np.all(padded[:, t:] == 0) and np.all(padded[mask_pad == 0] == 0), name

    train_pad, _ = pad_junk_and_widen(train, mask, rng)
    rollout_pad, _ = pad_junk_and_widen(rollout, mask, rng)
    base_m, padded_m = as_floats(mismatch_metrics(train, rollout, mask)), as_floats(
        mismatch_metrics(train_pad, rollout_pad, mask_pad))
    for key in base_m:
        assert math.isclose(base_m[key], padded_m[key], rel_tol=1e-5, abs_tol=1e-6), key
    config = RolloutCorrectionConfig.preset("icepop", self_normalize=True)
    w, k, m = apply_rollout_correction(config, train, rollout, mask)
    wp, kp, mp = apply_rollout_correction(config, train_pad, rollout_pad, mask_pad)
    np.testing.assert_allclose(np.asarray(wp)[:, :t], w, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(kp)[:, :t], k)
    assert all(np.isfinite(float(v)) for v in mp.values())


@SETTINGS
@given(CASES)
def test_on_policy_gives_unit_weights_and_zero_divergence(case):
    _, rollout, mask, _ = make_batch(case)
    zero = np.zeros_like(rollout)
    for name, fn in FUNCS:  # every weight is 1 and every mask keeps every valid token
        np.testing.assert_array_equal(np.asarray(fn(zero, mask)), mask, err_msg=name)
    m = as_floats(mismatch_metrics(rollout, rollout, mask))
    for key in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "log_ppl_abs_diff",
                "log_ppl_diff_max", "log_ppl_diff_min", "prob_abs_diff_mean", "prob_abs_diff_max",
                "rho_frac_above_clip", "rho_frac_below_inv_clip", "rho_std"):
        assert m[key] == 0.0, key
    for key in ("ess", "ppl_ratio", "rho_mean", "rho_min", "rho_max", "prob_pearson"):
        assert m[key] == 1.0, key
    assert m["training_ppl"] == m["rollout_ppl"]
    for name in PRESETS:
        w, keep, cm = apply_rollout_correction(RolloutCorrectionConfig.preset(name), rollout, rollout, mask)
        np.testing.assert_array_equal(np.asarray(w), mask, err_msg=name)
        np.testing.assert_array_equal(np.asarray(keep), mask, err_msg=name)
        assert float(cm["token_masked_frac"]) == 0.0 and float(cm["weight_ess"]) == 1.0


@SETTINGS
@given(CASES)
def test_infinite_cap_recovers_plain_importance_sampling(case):
    train, rollout, mask, _ = make_batch(case)
    lr = (train - rollout).astype(np.float64)
    rho = np.exp(lr) * mask
    for clip in (None, np.inf, 1e30):
        np.testing.assert_allclose(np.asarray(token_tis_weights(lr, mask, clip)), rho, rtol=1e-5)
        seq = np.exp((lr * mask).sum(-1, keepdims=True)) * mask
        np.testing.assert_allclose(np.asarray(sequence_tis_weights(lr, mask, clip)), seq, rtol=1e-4)
        geo = np.exp((lr * mask).sum(-1, keepdims=True) / mask.sum(-1, keepdims=True)) * mask
        np.testing.assert_allclose(np.asarray(geometric_sequence_weights(lr, mask, clip)), geo, rtol=1e-5)
    # and a finite cap is exactly min(plain IS, C)
    np.testing.assert_allclose(np.asarray(token_tis_weights(lr, mask, 1.3)), np.minimum(rho, 1.3), rtol=1e-5)


@SETTINGS
@given(CASES)
def test_jit_equals_eager(case):
    train, rollout, mask, _ = make_batch(case)
    lr = train - rollout
    for name, fn in FUNCS:
        np.testing.assert_allclose(np.asarray(jax.jit(fn)(lr, mask)), np.asarray(fn(lr, mask)),
                                   rtol=1e-6, atol=1e-7, err_msg=name)
    eager, jitted = mismatch_metrics(train, rollout, mask), jax.jit(mismatch_metrics)(train, rollout, mask)
    for key in eager:
        np.testing.assert_allclose(float(jitted[key]), float(eager[key]), rtol=1e-5, atol=1e-6, err_msg=key)


@SETTINGS
@given(CASES)
def test_bf16_inputs_give_the_fp32_answer_within_bf16_rounding(case):
    train, rollout, mask, _ = make_batch(case)
    train16, rollout16 = jnp.asarray(train, jnp.bfloat16), jnp.asarray(rollout, jnp.bfloat16)
    # fp32 inside: bf16 inputs give exactly the fp32 computation on the (exactly representable) bf16 values
    up_train, up_rollout = np.asarray(train16, np.float32), np.asarray(rollout16, np.float32)
    w16 = token_tis_weights(train16 - rollout16.astype(jnp.float32), mask, None)
    assert w16.dtype == jnp.float32
    m16 = mismatch_metrics(train16, rollout16, mask)
    m_up = mismatch_metrics(up_train, up_rollout, mask)
    for key in m16:
        assert m16[key].dtype == jnp.float32, key
        np.testing.assert_allclose(float(m16[key]), float(m_up[key]), rtol=1e-6, atol=1e-7, err_msg=key)
    w16, k16, _ = apply_rollout_correction(RolloutCorrectionConfig(mode="token", clip=None), train16, rollout16, mask)
    w32, _, _ = apply_rollout_correction(RolloutCorrectionConfig(mode="token", clip=None), train, rollout, mask)
    # ... and that is the fp32 answer up to bf16 rounding of the two logprobs (≤ 2^-8 relative each)
    rounding = 2.0 ** -8 * (np.abs(train) + np.abs(rollout)) + 1e-6
    log_err = np.abs(np.log(np.where(mask > 0, np.asarray(w16), 1.0)) - np.log(np.where(mask > 0, np.asarray(w32), 1.0)))
    assert np.all(log_err <= rounding), (log_err - rounding).max()
    assert np.asarray(w16).dtype == np.float32 and np.asarray(k16).dtype == np.float32


@SETTINGS
@given(CASES)
def test_self_normalised_weights_average_to_one_and_bounds_may_be_traced(case):
    train, rollout, mask, _ = make_batch(case)
    for mode in ("token", "sequence", "geometric"):
        config = RolloutCorrectionConfig(mode=mode, clip=3.0, self_normalize=True, token_mask_low=0.3)
        w, keep, m = apply_rollout_correction(config, train, rollout, mask)
        if np.asarray(keep).any():
            per_seq = mode != "token"
            w, keep = np.asarray(w, np.float64), np.asarray(keep) > 0
            mean = (np.array([w[b][keep[b]].mean() for b in range(w.shape[0]) if keep[b].any()]).mean()
                    if per_seq else w[keep].mean())
            assert abs(mean - 1.0) < 1e-5, (mode, mean)
    # thresholds can be traced arguments of a jitted function
    lr = train - rollout
    traced = jax.jit(icepop_token_mask)(lr, mask, 0.5, 2.0)
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(icepop_token_mask(lr, mask, 0.5, 2.0)))
