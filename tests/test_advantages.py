"""Hand-computed GRPO / Dr. GRPO advantages and DAPO overlong shaping."""

import math

import jax
import numpy as np
import pytest

from portable_rl.learner_jax.advantages import (dr_grpo_advantages, grpo_advantages,
                                                overlong_reward_shaping)

# Two prompts × 4 samples, prompt-major.
REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], np.float32)


def test_grpo_by_hand():
    std = math.sqrt(4 * 0.5 ** 2 / 3)  # unbiased std of (1, 0, 0, 1)
    a = 0.5 / (std + 1e-6)
    np.testing.assert_allclose(grpo_advantages(REWARDS, 4), [a, -a, -a, a, 0, 0, 0, 0], rtol=1e-6)


def test_grpo_eps_and_groups_are_independent():
    rewards = np.array([2.0, 4.0, 10.0, 10.0], np.float32)  # group 0 std = sqrt(2), group 1 constant
    np.testing.assert_allclose(grpo_advantages(rewards, 2, eps=1.0),
                               [-1 / (math.sqrt(2) + 1), 1 / (math.sqrt(2) + 1), 0, 0], rtol=1e-6)


def test_dr_grpo_has_no_std():
    np.testing.assert_allclose(dr_grpo_advantages(REWARDS, 4), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    np.testing.assert_allclose(grpo_advantages(REWARDS, 4, normalize_std=False), dr_grpo_advantages(REWARDS, 4))


def test_grpo_is_jittable():
    fn = jax.jit(grpo_advantages, static_argnums=1)
    np.testing.assert_allclose(fn(REWARDS, 4), grpo_advantages(REWARDS, 4), rtol=1e-6)


@pytest.mark.parametrize("rewards, group_size, match", [
    (np.ones(6), 4, "groups of 4"),
    (np.ones(4), 1, "group_size"),
    (np.ones((2, 4)), 4, "flat"),
])
def test_bad_groups_raise(rewards, group_size, match):
    with pytest.raises(ValueError, match=match):
        grpo_advantages(rewards, group_size)


def test_overlong_shaping_by_hand():
    # L_max = 20, buffer 4: free up to 16, linear to −f at 20, −f beyond
    lengths = np.array([10, 16, 17, 18, 20, 25])
    np.testing.assert_allclose(overlong_reward_shaping(lengths, 20, 4, 1.0), [0, 0, -0.25, -0.5, -1, -1])
    np.testing.assert_allclose(overlong_reward_shaping(lengths, 20, 4, 0.5), [0, 0, -0.125, -0.25, -0.5, -0.5])
    assert overlong_reward_shaping(lengths, 20, 4).dtype == np.float32


@pytest.mark.parametrize("max_len, buffer_len, factor", [(20, 0, 1.0), (20, 21, 1.0), (20, 4, -1.0)])
def test_overlong_bad_arguments_raise(max_len, buffer_len, factor):
    with pytest.raises(ValueError):
        overlong_reward_shaping(np.array([5]), max_len, buffer_len, factor)
