"""Hand-computed examples for the rejection masks (portable_rl.tis.masks)."""

import numpy as np
import pytest

from portable_rl.tis import (divergence_mask, divergence_statistic, geometric_sequence_mask,
                             icepop_token_mask, k1_bounds_from_verl, outlier_veto_mask, product_sequence_mask)

RHO = np.array([[3.0, 0.5, 1.0, 7.0],
                [0.25, 1.5, 9.0, 9.0],
                [1.1, 0.9, 1.0, 1.0]], np.float32)
MASK = np.array([[1, 1, 1, 0],
                 [1, 1, 0, 0],
                 [1, 1, 1, 1]], np.float32)
LR = np.log(RHO)


def eq(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b, np.float32))


def test_icepop_keeps_tokens_inside_bounds():
    eq(icepop_token_mask(LR, MASK, low=0.4, high=2.0),
       [[0, 1, 1, 0], [0, 1, 0, 0], [1, 1, 1, 1]])
    eq(icepop_token_mask(LR, MASK, low=0.2, high=5.0),
       [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])


def test_geometric_mask_on_sequence_geometric_mean():
    # geometric means: 1.5^(1/3)=1.145, 0.375^(1/2)=0.612, (1.1*0.9)^(1/4)=0.9975
    eq(geometric_sequence_mask(LR, MASK, low=0.9, high=1.2), [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    eq(geometric_sequence_mask(LR, MASK, low=0.99, high=1.01), [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    eq(geometric_sequence_mask(LR, MASK, low=None, high=1.0), [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])


def test_product_mask_on_sequence_product():
    # products: 1.5, 0.375, 0.99
    eq(product_sequence_mask(LR, MASK, low=0.5, high=2.0), [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    eq(product_sequence_mask(LR, MASK, low=0.3, high=1.2), [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])


def test_outlier_veto_drops_whole_sequence_and_ignores_padding():
    # row 0 has ρ=3 (over 2); row 1 has 0.25 (under 0.3); padding 7 and 9 must not veto.
    eq(outlier_veto_mask(LR, MASK, low=0.3, high=2.0), [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    eq(outlier_veto_mask(LR, MASK, low=0.2, high=None), [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    eq(outlier_veto_mask(LR, MASK, low=None, high=4.0), [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])


def test_divergence_statistics_by_hand():
    x = np.log(np.array([2.0, 0.5, 1.0], np.float32))
    np.testing.assert_allclose(divergence_statistic(x, "k1"), [-np.log(2), np.log(2), 0.0], atol=1e-6)
    np.testing.assert_allclose(divergence_statistic(x, "k2"), 0.5 * np.log([2.0, 0.5, 1.0]) ** 2, atol=1e-6)
    np.testing.assert_allclose(divergence_statistic(x, "k3"),
                               [2 - 1 - np.log(2), 0.5 - 1 + np.log(2), 0.0], atol=1e-6)
    with pytest.raises(ValueError, match="estimator"):
        divergence_statistic(x, "k4")


def test_divergence_masks_token_sum_mean_max():
    k2 = 0.5 * np.log(RHO) ** 2  # per token
    # token: keep k2 ≤ 0.3 → ρ within exp(±sqrt(0.6)) = [0.461, 2.17]
    eq(divergence_mask(LR, MASK, "k2", "token", high=0.3), [[0, 1, 1, 0], [0, 1, 0, 0], [1, 1, 1, 1]])
    sums = [(k2[0, :3]).sum(), (k2[1, :2]).sum(), k2[2].sum()]  # 0.84, 1.04, 0.0101
    means = [sums[0] / 3, sums[1] / 2, sums[2] / 4]             # 0.28, 0.52, 0.0025
    maxes = [k2[0, :3].max(), k2[1, :2].max(), k2[2].max()]      # 0.60, 0.96, 0.0055
    assert sums[0] < 1.0 < sums[1] and means[0] < 0.5 < means[1] and maxes[0] < 0.9 < maxes[1]
    eq(divergence_mask(LR, MASK, "k2", "seq_sum", high=1.0), [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    eq(divergence_mask(LR, MASK, "k2", "seq_mean", high=0.5), [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    eq(divergence_mask(LR, MASK, "k2", "seq_max", high=0.9), [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    eq(divergence_mask(LR, MASK, "k2", "seq_max", high=0.01), [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])


def test_k1_divergence_bounds_are_in_minus_log_ratio_units():
    # seq_mean k1 = −mean log ρ: row0 −0.135, row1 +0.490, row2 +0.0025
    eq(divergence_mask(LR, MASK, "k1", "seq_mean", low=-0.01, high=0.01), [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    eq(divergence_mask(LR, MASK, "k1", "seq_mean", low=0.1), [[0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    # k3 token ≤ 0.1: k3(3)=0.90, k3(.5)=0.19, k3(1.5)=0.095, k3(.25)=0.64, k3(1.1)=.0047, k3(.9)=.0054
    eq(divergence_mask(LR, MASK, "k3", "token", high=0.1), [[0, 0, 1, 0], [0, 1, 0, 0], [1, 1, 1, 1]])


@pytest.mark.parametrize("call", [
    lambda: icepop_token_mask(LR, MASK, low=2.0, high=0.5),
    lambda: geometric_sequence_mask(LR, MASK, low=1.1, high=0.9),
    lambda: product_sequence_mask(LR, MASK, low=3.0, high=2.0),
    lambda: outlier_veto_mask(LR, MASK, low=5.0, high=1.0),
    lambda: divergence_mask(LR, MASK, "k3", "seq_mean", low=0.5, high=0.1),
])
def test_inverted_bounds_raise(call):
    with pytest.raises(ValueError, match="lower bound"):
        call()


def test_unknown_aggregation_raises():
    with pytest.raises(ValueError, match="aggregation"):
        divergence_mask(LR, MASK, "k3", "seq_median", high=1.0)


def test_verl_k1_threshold_a_b_keeps_ratios_in_one_over_b_to_one_over_a():
    """verl (≥ 0.7) keeps log a ≤ mean_t(−log ρ_t) ≤ log b for rollout_rs=seq_mean_k1, "a_b" (issue 15 item 9)."""
    rng = np.random.default_rng(0)
    lr = rng.normal(0.0, 0.4, (64, 6)).astype(np.float32)
    mask = (rng.random((64, 6)) < 0.8).astype(np.float32)
    mask[:, 0] = 1
    a, b = 0.8, 1.5                               # asymmetric, so [a, b] and [1/b, 1/a] differ
    k1_mean = -(lr * mask).sum(-1) / mask.sum(-1)  # verl's statistic, restated
    verl_keep = (k1_mean >= np.log(a)) & (k1_mean <= np.log(b))
    assert 0 < verl_keep.sum() < 64
    low, high = k1_bounds_from_verl(f"{a}_{b}")
    assert (low, high) == (pytest.approx(np.log(a)), pytest.approx(np.log(b)))
    expected = verl_keep[:, None] * mask
    eq(divergence_mask(lr, mask, "k1", "seq_mean", low, high), expected)
    eq(geometric_sequence_mask(lr, mask, low=1 / b, high=1 / a), expected)   # the same test in ratio units
    assert not np.array_equal(np.asarray(geometric_sequence_mask(lr, mask, low=a, high=b)), expected)
    assert k1_bounds_from_verl(2.0) == (pytest.approx(-np.log(2.0)), pytest.approx(np.log(2.0)))  # a = 1/b
    with pytest.raises(ValueError, match="must be > 0"):
        k1_bounds_from_verl("0_2")
    with pytest.raises(ValueError, match="lower bound"):
        k1_bounds_from_verl("2_0.5")


def test_ratio_bounds_beyond_the_exp_clamp_still_bind():
    """Bounds outside [e^-20, e^20] are compared in log space, not against a ratio clamped there (item 12)."""
    lr = np.array([[-30.0, 0.0], [0.0, 0.0], [25.0, 0.0], [15.0, 15.0]], np.float32)
    mask = np.ones_like(lr)
    eq(outlier_veto_mask(lr, mask, low=1e-10), [[0, 0], [1, 1], [1, 1], [1, 1]])        # ρ = e^-30 < 1e-10
    eq(icepop_token_mask(lr, mask, low=None, high=1e10), [[1, 1], [1, 1], [0, 1], [1, 1]])  # ρ = e^25 > 1e10
    eq(icepop_token_mask(lr, mask, low=1e-10, high=None), [[0, 1], [1, 1], [1, 1], [1, 1]])
    eq(product_sequence_mask(lr, mask, high=1e10), [[1, 1], [1, 1], [0, 0], [0, 0]])    # Π ρ = e^25, e^30
    eq(geometric_sequence_mask(lr, mask, low=1e-12), [[1, 1], [1, 1], [1, 1], [1, 1]])   # e^-15 ≥ 1e-12
    eq(geometric_sequence_mask(lr, mask, low=1e-6), [[0, 0], [1, 1], [1, 1], [1, 1]])
    eq(outlier_veto_mask(lr, mask, low=0.0, high=np.inf), np.ones_like(lr))               # 0 and ∞ never bind
