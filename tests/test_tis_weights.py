"""Hand-computed examples for the TIS weights (portable_rl.tis.weights)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from portable_rl.tis import (geometric_sequence_weights, self_normalize, sequence_tis_weights,
                             token_tis_weights)

# Two sequences; row 0 has 3 valid tokens, row 1 has 2. Ratios ρ chosen by hand.
RHO = np.array([[3.0, 0.5, 1.0, 7.0],
                [0.25, 1.5, 9.0, 9.0]], np.float32)
MASK = np.array([[1, 1, 1, 0],
                 [1, 1, 0, 0]], np.float32)
LOG_RATIO = np.log(RHO)


def close(a, b, tol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b, np.float32), rtol=tol, atol=tol)


def test_token_tis_caps_each_token_and_zeroes_padding():
    w = token_tis_weights(LOG_RATIO, MASK, clip=2.0)
    close(w, [[2.0, 0.5, 1.0, 0.0],
              [0.25, 1.5, 0.0, 0.0]])
    assert w.dtype == jnp.float32


def test_sequence_tis_is_capped_product_broadcast():
    # row 0: 3 * 0.5 * 1 = 1.5 (< C=2); row 1: 0.25 * 1.5 = 0.375
    close(sequence_tis_weights(LOG_RATIO, MASK, clip=2.0),
          [[1.5, 1.5, 1.5, 0.0], [0.375, 0.375, 0.0, 0.0]])
    # a cap of 1.2 binds on row 0 only
    close(sequence_tis_weights(LOG_RATIO, MASK, clip=1.2),
          [[1.2, 1.2, 1.2, 0.0], [0.375, 0.375, 0.0, 0.0]])


def test_geometric_weight_is_capped_geometric_mean():
    g0 = 1.5 ** (1 / 3)          # (3 * 0.5 * 1)^(1/3)
    g1 = 0.375 ** 0.5            # (0.25 * 1.5)^(1/2)
    close(geometric_sequence_weights(LOG_RATIO, MASK, clip=2.0),
          [[g0, g0, g0, 0.0], [g1, g1, 0.0, 0.0]], tol=1e-5)
    close(geometric_sequence_weights(LOG_RATIO, MASK, clip=1.1),
          [[1.1, 1.1, 1.1, 0.0], [g1, g1, 0.0, 0.0]], tol=1e-5)


def test_clip_none_is_plain_importance_sampling():
    close(token_tis_weights(LOG_RATIO, MASK, clip=None), RHO * MASK, tol=1e-5)
    close(sequence_tis_weights(LOG_RATIO, MASK, clip=None)[:, 0], [1.5, 0.375], tol=1e-5)


def test_log_ratio_is_clamped_to_20_before_exp():
    lr = np.array([[100.0, -100.0]], np.float32)
    w = token_tis_weights(lr, np.ones_like(lr), clip=None)
    close(w, [[math.exp(20.0), math.exp(-20.0)]], tol=1e-5)
    assert np.isfinite(np.asarray(sequence_tis_weights(np.full((1, 8), 50.0), np.ones((1, 8)), clip=None))).all()


def test_nan_in_padding_does_not_leak():
    lr = LOG_RATIO.copy()
    lr[MASK == 0] = np.nan
    for fn in (token_tis_weights, sequence_tis_weights, geometric_sequence_weights):
        np.testing.assert_array_equal(np.asarray(fn(lr, MASK, 2.0)), np.asarray(fn(LOG_RATIO, MASK, 2.0)))


def test_self_normalize_per_token_and_per_sequence():
    w = token_tis_weights(LOG_RATIO, MASK, clip=2.0)  # valid: 2, .5, 1, .25, 1.5 → mean 1.05
    close(self_normalize(w, MASK, per="token"), np.asarray(w) / 1.05, tol=1e-6)
    s = sequence_tis_weights(LOG_RATIO, MASK, clip=2.0)  # per sequence: 1.5, .375 → mean .9375
    close(self_normalize(s, MASK, per="sequence"), np.asarray(s) / 0.9375, tol=1e-6)
    with pytest.raises(ValueError, match="per="):
        self_normalize(w, MASK, per="batch")


def test_weights_carry_no_gradient():
    def total(lr):
        return token_tis_weights(lr, MASK, 10.0).sum() + sequence_tis_weights(lr, MASK, 10.0).sum()
    np.testing.assert_array_equal(np.asarray(jax.grad(total)(jnp.asarray(LOG_RATIO))), 0.0)
