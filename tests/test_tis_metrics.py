"""Hand-computed examples for the mismatch diagnostics (portable_rl.tis.mismatch_metrics)."""

import math

import numpy as np

from portable_rl.tis import mismatch_metrics

# Probabilities by hand. Row 0: 2 valid tokens, row 1: 1 valid token; padding holds junk.
P_TRAIN = np.array([[0.5, 0.2, 0.7], [0.3, 0.9, 0.9]], np.float32)
P_ROLL = np.array([[0.25, 0.4, 0.1], [0.3, 0.1, 0.1]], np.float32)
MASK = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
A, B = np.log(P_TRAIN), np.log(P_ROLL)


def metric(**kw):
    m = mismatch_metrics(A, B, MASK, **kw)
    return {k: float(v) for k, v in m.items()}


def test_required_keys_present():
    m = metric()
    for key in ("kl", "k3_kl", "chi2_token", "chi2_seq", "ppl_ratio", "log_ppl_diff", "ess"):
        assert key in m


def test_kl_and_k3_by_hand():
    # valid ρ = 2, 0.5, 1 ; log ρ = ln2, −ln2, 0
    m = metric()
    assert math.isclose(m["kl"], (-math.log(2) + math.log(2) + 0) / 3, abs_tol=1e-6)
    k3 = ((2 - 1 - math.log(2)) + (0.5 - 1 + math.log(2)) + 0.0) / 3
    assert math.isclose(m["k3_kl"], k3, rel_tol=1e-5)


def test_perplexities_by_hand():
    m = metric()
    t0, t1 = -(math.log(0.5) + math.log(0.2)) / 2, -math.log(0.3)   # per-sequence log-ppl
    r0, r1 = -(math.log(0.25) + math.log(0.4)) / 2, -math.log(0.3)
    assert math.isclose(m["training_log_ppl"], (t0 + t1) / 2, rel_tol=1e-5)
    assert math.isclose(m["training_ppl"], (math.exp(t0) + math.exp(t1)) / 2, rel_tol=1e-5)
    assert math.isclose(m["rollout_log_ppl"], (r0 + r1) / 2, rel_tol=1e-5)
    assert math.isclose(m["rollout_ppl"], (math.exp(r0) + math.exp(r1)) / 2, rel_tol=1e-5)
    d0, d1 = t0 - r0, t1 - r1
    assert math.isclose(m["log_ppl_diff"], (d0 + d1) / 2, rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(m["log_ppl_abs_diff"], (abs(d0) + abs(d1)) / 2, rel_tol=1e-5)
    assert math.isclose(m["log_ppl_diff_max"], max(d0, d1), abs_tol=1e-6)
    assert math.isclose(m["log_ppl_diff_min"], min(d0, d1), abs_tol=1e-6)
    assert math.isclose(m["ppl_ratio"], (math.exp(d0) + math.exp(d1)) / 2, rel_tol=1e-5)


def test_chi2_and_ess_by_hand():
    m = metric()
    rho = np.array([2.0, 0.5, 1.0])
    assert math.isclose(m["chi2_token"], (rho ** 2).mean() - 1, rel_tol=1e-5)
    seq_rho = np.array([2.0 * 0.5, 1.0])
    assert math.isclose(m["chi2_seq"], (seq_rho ** 2).mean() - 1, abs_tol=1e-6)
    assert math.isclose(m["ess"], rho.mean() ** 2 / (rho ** 2).mean(), rel_tol=1e-5)


def test_weight_statistics_and_clip_fractions():
    m = metric(clip=1.5)
    rho = np.array([2.0, 0.5, 1.0])
    assert math.isclose(m["rho_mean"], rho.mean(), rel_tol=1e-6)
    assert math.isclose(m["rho_std"], rho.std(), rel_tol=1e-5)
    assert math.isclose(m["rho_max"], 2.0, rel_tol=1e-6) and math.isclose(m["rho_min"], 0.5, rel_tol=1e-6)
    assert math.isclose(m["rho_frac_above_clip"], 1 / 3, rel_tol=1e-6)      # ρ=2 > 1.5
    assert math.isclose(m["rho_frac_below_inv_clip"], 1 / 3, rel_tol=1e-6)  # ρ=0.5 < 1/1.5
    assert metric(clip=2.5)["rho_frac_above_clip"] == 0.0


def test_probability_differences_and_correlation():
    m = metric()
    dp = np.array([0.25, 0.2, 0.0])
    assert math.isclose(m["prob_abs_diff_mean"], dp.mean(), rel_tol=1e-5)
    assert math.isclose(m["prob_abs_diff_max"], 0.25, rel_tol=1e-5)
    expected = np.corrcoef([0.5, 0.2, 0.3], [0.25, 0.4, 0.3])[0, 1]
    assert math.isclose(m["prob_pearson"], expected, rel_tol=1e-4)
    assert m["valid_tokens"] == 3.0


def test_on_policy_constant_probabilities_are_perfectly_correlated():
    lp = np.log(np.full((2, 3), 0.5, np.float32))
    m = {k: float(v) for k, v in mismatch_metrics(lp, lp, np.ones((2, 3))).items()}
    assert m["prob_pearson"] == 1.0 and m["kl"] == 0.0 and m["ess"] == 1.0


def test_empty_mask_gives_finite_zeros():
    m = mismatch_metrics(A, B, np.zeros_like(MASK))
    assert all(np.isfinite(float(v)) for v in m.values())
    assert float(m["kl"]) == 0.0 and float(m["valid_tokens"]) == 0.0


def test_ess_clamped_is_verls_ess_on_rho_clamped_to_inverse_clip_and_clip():
    """`ess` uses the raw ρ; `ess_clamped` verl ≤ 0.7.1's ρ clamped to [1/C, C] (issue 15 item 13)."""
    rho = np.array([2.0, 0.5, 1.0])
    for clip in (1.5, 3.0):
        clamped = np.clip(rho, 1 / clip, clip)
        verl = 1.0 / ((clamped / clamped.mean()) ** 2).mean()   # verl's formula, restated
        assert math.isclose(metric(clip=clip)["ess_clamped"], verl, rel_tol=1e-5)
    assert metric(clip=1.5)["ess_clamped"] > metric(clip=1.5)["ess"]   # clamping only evens the weights out
    assert math.isclose(metric(clip=None)["ess_clamped"], metric(clip=None)["ess"], rel_tol=1e-6)


def test_clip_fractions_count_ratios_beyond_the_exp_clamp():
    a = np.array([[25.0, 0.0, -25.0]], np.float32)
    m = {k: float(v) for k, v in mismatch_metrics(a, np.zeros_like(a), np.ones_like(a), clip=1e10).items()}
    assert m["rho_frac_above_clip"] == m["rho_frac_below_inv_clip"] == 1 / np.float32(3)
