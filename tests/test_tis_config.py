"""RolloutCorrectionConfig presets/validation and apply_rollout_correction end to end."""

import dataclasses

import jax
import numpy as np
import pytest

from portable_rl.tis import (PRESETS, RolloutCorrectionConfig, apply_rollout_correction,
                             from_preset, icepop_token_mask, sequence_tis_weights,
                             token_tis_weights)

RHO = np.array([[3.0, 0.5, 1.0, 7.0],
                [0.25, 1.5, 9.0, 9.0],
                [1.0, 1.0, 1.0, 1.0]], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], np.float32)
ROLL = np.log(np.full(RHO.shape, 0.1, np.float32))
TRAIN = ROLL + np.log(RHO)


def run(config):
    w, keep, m = apply_rollout_correction(config, TRAIN, ROLL, MASK)
    return np.asarray(w), np.asarray(keep), {k: float(v) for k, v in m.items()}


def test_none_mode_returns_unit_weights_and_the_response_mask():
    w, keep, m = run(RolloutCorrectionConfig())
    np.testing.assert_array_equal(w, MASK)
    np.testing.assert_array_equal(keep, MASK)
    assert not RolloutCorrectionConfig().enabled
    assert m["token_masked_frac"] == 0.0 and "kl" in m


def test_token_tis_preset_matches_the_functional_api():
    w, keep, m = run(RolloutCorrectionConfig.preset("token_tis"))
    np.testing.assert_allclose(w, token_tis_weights(np.log(RHO), MASK, 2.0), rtol=1e-6)
    np.testing.assert_array_equal(keep, MASK)
    assert m["clipped_frac"] == pytest.approx(1 / 9)  # only ρ=3 of 9 valid tokens exceeds C=2
    kept = np.array([2.0, 0.5, 1.0, 0.25, 1.5, 1.0, 1.0, 1.0, 1.0])  # capped weights of the valid tokens
    assert m["weight_mean"] == pytest.approx(kept.mean(), rel=1e-6)
    assert m["weight_std"] == pytest.approx(kept.std(), rel=1e-5)
    assert m["weight_min"] == pytest.approx(0.25) and m["weight_max"] == pytest.approx(2.0)
    assert m["weight_ess"] == pytest.approx(kept.mean() ** 2 / (kept ** 2).mean(), rel=1e-5)


def test_sequence_tis_with_override():
    config = RolloutCorrectionConfig.preset("sequence_tis", clip=1.2)
    w, _, _ = run(config)
    np.testing.assert_allclose(w, sequence_tis_weights(np.log(RHO), MASK, 1.2), rtol=1e-6)
    assert config.clip == 1.2 and config.mode == "sequence"


def test_icepop_preset_zeroes_weights_and_mask_outside_bounds():
    w, keep, m = run(RolloutCorrectionConfig.preset("icepop", token_mask_low=0.4, token_mask_high=2.0))
    expected_keep = np.asarray(icepop_token_mask(np.log(RHO), MASK, 0.4, 2.0))
    np.testing.assert_array_equal(keep, expected_keep)
    np.testing.assert_allclose(w, np.minimum(RHO, 5.0) * expected_keep, rtol=1e-6)
    assert m["token_masked_frac"] == pytest.approx(2 / 9)  # ρ=3 and ρ=0.25
    assert m["seq_masked_frac"] == pytest.approx(2 / 3)
    assert m["seq_dropped_frac"] == 0.0


def test_seq_mis_rejects_sequences_outside_product_bounds():
    # products: 1.5 (kept), 0.375 (< 0.5, dropped), 1 (kept)
    w, keep, m = run(RolloutCorrectionConfig.preset("seq_mis"))
    np.testing.assert_array_equal(keep, [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_allclose(w[0, :3], 1.5, rtol=1e-6)
    assert m["seq_dropped_frac"] == pytest.approx(1 / 3)


def test_geo_rs_and_k3_rs_presets_keep_only_the_on_policy_row():
    for name in ("geo_rs", "k3_rs"):
        w, keep, _ = run(RolloutCorrectionConfig.preset(name))
        np.testing.assert_array_equal(keep, [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
        np.testing.assert_array_equal(w, keep)


def test_veto_and_self_normalization():
    config = RolloutCorrectionConfig(mode="token", clip=2.0, veto_low=0.3, self_normalize=True)
    w, keep, m = run(config)
    np.testing.assert_array_equal(keep, [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    raw = np.array([2.0, 0.5, 1.0, 1, 1, 1, 1])  # kept tokens' capped weights
    np.testing.assert_allclose(w[keep > 0], raw / raw.mean(), rtol=1e-6)
    assert m["weight_mean"] == pytest.approx(1.0, rel=1e-6)


def test_jit_with_static_config_equals_eager():
    config = RolloutCorrectionConfig.preset("icepop")
    jitted = jax.jit(apply_rollout_correction, static_argnums=0)
    (w1, k1, m1), (w2, k2, m2) = jitted(config, TRAIN, ROLL, MASK), apply_rollout_correction(config, TRAIN, ROLL, MASK)
    np.testing.assert_allclose(w1, w2, rtol=1e-6)
    np.testing.assert_array_equal(k1, k2)
    for key in m1:
        np.testing.assert_allclose(m1[key], m2[key], rtol=1e-5, atol=1e-7)


def test_every_preset_builds_and_runs():
    for name in PRESETS:
        w, keep, m = run(from_preset(name))
        assert w.shape == MASK.shape and np.all(keep <= MASK) and np.all(w[MASK == 0] == 0)


def test_config_is_frozen_keyword_only_and_hashable():
    config = RolloutCorrectionConfig(mode="token")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.clip = 3.0
    with pytest.raises(TypeError):
        RolloutCorrectionConfig("token")
    assert hash(config) == hash(RolloutCorrectionConfig(mode="token"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="tokens"), "unknown rollout-correction mode"),
    (dict(mode="token", clip=0.0), "clip must be > 0"),
    (dict(token_mask_low=5.0, token_mask_high=0.5), "lower bound"),
    (dict(geo_mask_low=1.1, geo_mask_high=0.9), "lower bound"),
    (dict(product_mask_low=2.0, product_mask_high=1.0), "lower bound"),
    (dict(veto_low=3.0, veto_high=2.0), "lower bound"),
    (dict(veto_low=-1.0), "must be >= 0"),
    (dict(divergence="seq_mean_k4", divergence_high=1.0), "unknown divergence mask"),
    (dict(divergence="seq_mean_k3"), "needs divergence_high"),
    (dict(divergence_high=0.1), "divergence is None"),
    (dict(divergence="token_k1", divergence_low=0.1, divergence_high=-0.1), "lower bound"),
])
def test_bad_configs_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrectionConfig(**kwargs)


def test_unknown_preset_and_shape_mismatch_raise():
    with pytest.raises(ValueError, match="unknown rollout-correction preset"):
        RolloutCorrectionConfig.preset("tis_token")
    with pytest.raises(ValueError, match="shape mismatch"):
        apply_rollout_correction(RolloutCorrectionConfig(), TRAIN, ROLL[:, :2], MASK)
