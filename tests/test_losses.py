"""Hand-computed checks of the clip-higher PPO loss and its aggregation modes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from portable_rl.learner_jax.losses import AGGREGATIONS, aggregate_loss, loss_token_weights, policy_loss
from portable_rl.tis import RolloutCorrectionConfig, apply_rollout_correction

# Two sequences of 3 positions; row 1's last position is padding. Ratios r = π_new / π_old by hand.
RATIO = np.array([[1.5, 0.5, 1.0],
                  [1.5, 0.5, 4.0]], np.float32)
OLD = np.log(np.array([[0.2, 0.4, 0.3], [0.1, 0.6, 0.2]], np.float32))
NEW = OLD + np.log(RATIO)
ADV = np.array([1.0, -1.0], np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 1]], np.float32)


def per_token_loss_by_hand(dual_c=None):
    # A=+1: max(−r, −clip(r, .8, 1.28)):   r=1.5 → −1.28, r=.5 → −.5, r=1 → −1
    # A=−1: max(r, clip(r, .8, 1.28)):     r=1.5 → 1.5,   r=.5 → .8,  r=4 → 4 (dual clip: min(4, 3) = 3)
    return np.array([[-1.28, -0.5, -1.0], [1.5, 0.8, 3.0 if dual_c == 3.0 else 4.0]], np.float32)


def test_clip_higher_token_mean_by_hand():
    loss, m = policy_loss(NEW, OLD, ADV, MASK)
    assert float(loss) == pytest.approx(per_token_loss_by_hand().mean(), rel=1e-5)
    # clipped branch taken at (0,0) and (1,1): 2 of 6 tokens
    assert float(m["clip_frac"]) == pytest.approx(2 / 6)
    assert float(m["clip_frac_high"]) == pytest.approx(1 / 6)  # r=1.5 > 1.28 with A > 0
    assert float(m["clip_frac_low"]) == pytest.approx(1 / 6)   # r=0.5 < 0.8 with A < 0
    assert float(m["approx_kl"]) == pytest.approx(-np.log(RATIO).mean(), rel=1e-5)
    assert float(m["approx_kl_k3"]) == pytest.approx((RATIO - 1 - np.log(RATIO)).mean(), rel=1e-5)
    assert float(m["ratio_max"]) == pytest.approx(4.0, rel=1e-5)


def test_dual_clip_caps_negative_advantage_loss():
    loss, m = policy_loss(NEW, OLD, ADV, MASK, dual_clip_c=3.0)
    assert float(loss) == pytest.approx(per_token_loss_by_hand(3.0).mean(), rel=1e-5)
    assert float(m["dual_clip_frac"]) == pytest.approx(1 / 6)
    # dual clip never touches positive advantages
    loss_pos, _ = policy_loss(NEW, OLD, np.abs(ADV), MASK, dual_clip_c=1.01)
    loss_pos_ref, _ = policy_loss(NEW, OLD, np.abs(ADV), MASK)
    assert float(loss_pos) == pytest.approx(float(loss_pos_ref))


def test_symmetric_epsilon_changes_the_clip():
    loss, _ = policy_loss(NEW, OLD, ADV, MASK, clip_eps_low=0.2, clip_eps_high=0.2)
    expected = per_token_loss_by_hand()
    expected[0, 0] = -1.2  # now clipped at 1.2 instead of 1.28
    expected[1, 0] = 1.5
    assert float(loss) == pytest.approx(expected.mean(), rel=1e-5)


def test_aggregations_by_hand():
    loss = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]], np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)  # last row empty
    assert float(aggregate_loss(loss, mask, "token-mean")) == pytest.approx((1 + 2 + 3 + 5) / 4)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx((6 + 5) / 2)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((2 + 5) / 2)
    # constant normaliser: Σ / (B · L), default L = T = 4; B counts every row (Dr. GRPO)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx(11 / (3 * 4))
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_constant=10)) == pytest.approx(11 / 30)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate_loss(loss, mask, "token-sum")


def test_token_sum_norm_is_verl_0_6_seq_mean_token_sum_norm():
    """verl ≤ 0.6.1's `seq-mean-token-sum-norm` is Σ_b Σ_t m·l / L (no batch term); ours divides by B·L too."""
    rng = np.random.default_rng(1)
    loss = rng.standard_normal((6, 5)).astype(np.float32)
    mask = (rng.random((6, 5)) < 0.7).astype(np.float32)
    verl_06 = (loss * mask).sum(-1).sum() / mask.shape[-1]     # verl 0.6.1 agg_loss, restated
    assert float(aggregate_loss(loss, mask, "token-sum-norm")) == pytest.approx(verl_06, rel=1e-6)
    assert float(aggregate_loss(loss, mask, "token-sum-norm", norm_constant=8)) == pytest.approx(
        verl_06 * 5 / 8, rel=1e-6)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx(verl_06 / 6, rel=1e-6)
    got, _ = policy_loss(NEW, OLD, ADV, MASK, aggregation="token-sum-norm")
    per_token, _ = policy_loss(NEW, OLD, ADV, MASK, aggregation="seq-mean-token-sum-norm")
    assert float(got) == pytest.approx(float(per_token) * MASK.shape[0], rel=1e-6)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_token_weights_reproduce_every_aggregation(aggregation):
    """Σ w·l with w = loss_token_weights(mask) equals aggregate_loss, per row or over packed sequence ids."""
    rng = np.random.default_rng(0)
    loss = rng.standard_normal((5, 7)).astype(np.float32)
    mask = (rng.random((5, 7)) < 0.6).astype(np.float32)
    mask[3] = 0                                                       # a sequence with no tokens left
    want = float(aggregate_loss(loss, mask, aggregation, norm_constant=9))
    w = loss_token_weights(mask, aggregation, norm_constant=9)
    assert (w[mask == 0] == 0).all() and float((w * loss).sum()) == pytest.approx(want, rel=1e-6)
    # the same 5 sequences packed into 2 rows of 21 (sequence ids per token): same weights per token
    packed_ids = np.full((2, 21), -1)
    packed_mask, packed_loss = np.zeros((2, 21), np.float32), np.zeros((2, 21), np.float32)
    for i, (r, s) in enumerate([(0, 0), (0, 7), (1, 0), (1, 7), (0, 14)]):
        packed_ids[r, s:s + 7], packed_mask[r, s:s + 7], packed_loss[r, s:s + 7] = i, mask[i], loss[i]
    pw = loss_token_weights(packed_mask, aggregation, norm_constant=9, sequence_ids=packed_ids, num_sequences=5)
    assert float((pw * packed_loss).sum()) == pytest.approx(want, rel=1e-6)
    # policy_loss with those weights returns Σ w·l instead of aggregating
    got, _ = policy_loss(NEW, OLD, ADV, MASK, token_weights=loss_token_weights(MASK, aggregation, norm_constant=9))
    ref, _ = policy_loss(NEW, OLD, ADV, MASK, aggregation=aggregation, norm_constant=9)
    assert float(got) == pytest.approx(float(ref), rel=1e-6)


def test_correction_weights_multiply_the_clipped_loss_decoupled():
    w = np.array([[2.0, 0.5, 1.0], [0.0, 1.0, 0.25]], np.float32)
    loss, m = policy_loss(NEW, OLD, ADV, MASK, correction_weights=w)
    assert float(loss) == pytest.approx((w * per_token_loss_by_hand()).mean(), rel=1e-5)
    assert float(m["correction_weight_mean"]) == pytest.approx(w.mean())


def test_bypass_uses_rollout_logprobs_as_old_policy():
    rollout = OLD + 0.1
    bypass, _ = policy_loss(NEW, None, ADV, MASK, rollout_logprobs=rollout, mode="bypass")
    decoupled, _ = policy_loss(NEW, rollout, ADV, MASK)
    assert float(bypass) == pytest.approx(float(decoupled))
    assert float(bypass) != pytest.approx(float(policy_loss(NEW, OLD, ADV, MASK)[0]))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(NEW, OLD, ADV, MASK, mode="bypass")


def test_per_sequence_advantages_broadcast_like_per_token():
    per_token = np.broadcast_to(ADV[:, None], NEW.shape)
    a, _ = policy_loss(NEW, OLD, ADV, MASK, aggregation="seq-mean-token-mean")
    b, _ = policy_loss(NEW, OLD, per_token, MASK, aggregation="seq-mean-token-mean")
    assert float(a) == pytest.approx(float(b))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(NEW, OLD, np.ones(3), MASK)


def test_on_policy_gradient_is_the_policy_gradient():
    # at r = 1 nothing is clipped: d loss / d logp_t = −A_t · m_t / Σ m  (token-mean)
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    grad = jax.grad(lambda new: policy_loss(new, OLD, ADV, mask)[0])(jnp.asarray(OLD))
    expected = -ADV[:, None] * mask / mask.sum()
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6, atol=1e-7)


def test_padding_with_junk_changes_nothing():
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    junk_new, junk_old = NEW.copy(), OLD.copy()
    junk_new[mask == 0], junk_old[mask == 0] = np.nan, -np.inf
    w = np.where(mask > 0, 1.5, np.nan).astype(np.float32)
    for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        clean, _ = policy_loss(NEW, OLD, ADV, mask, correction_weights=np.where(mask > 0, 1.5, 0), aggregation=agg)
        junk, metrics = policy_loss(junk_new, junk_old, ADV, mask, correction_weights=w, aggregation=agg)
        assert float(junk) == pytest.approx(float(clean)), agg
        assert all(np.isfinite(float(v)) for v in metrics.values())
    grad = jax.grad(lambda n: policy_loss(n, junk_old, ADV, mask)[0])(jnp.asarray(junk_new))
    assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[mask == 0] == 0)


def test_jit_equals_eager_and_bf16_inputs_are_upcast():
    fn = lambda n, o, a, m: policy_loss(n, o, a, m, dual_clip_c=3.0, aggregation="seq-mean-token-sum")
    (l1, m1), (l2, m2) = jax.jit(fn)(NEW, OLD, ADV, MASK), fn(NEW, OLD, ADV, MASK)
    assert float(l1) == pytest.approx(float(l2), rel=1e-6)
    loss16, _ = fn(jnp.asarray(NEW, jnp.bfloat16), jnp.asarray(OLD, jnp.bfloat16), ADV, MASK)
    assert loss16.dtype == jnp.float32


def test_loss_composes_with_rollout_correction():
    rollout = OLD + np.log(np.array([[0.5, 1.0, 1.0], [1.0, 1.0, 0.1]], np.float32))  # ρ = 2, 1, 1 / 1, 1, 10
    weights, keep, _ = apply_rollout_correction(RolloutCorrectionConfig.preset("icepop"), OLD, rollout, MASK)
    loss, _ = policy_loss(NEW, OLD, ADV, keep, correction_weights=weights)
    by_hand = per_token_loss_by_hand() * np.array([[2, 1, 1], [1, 1, 0]])  # ρ=10 rejected (> 5)
    assert float(loss) == pytest.approx(by_hand.sum() / 5, rel=1e-5)


def test_an_unknown_aggregation_raises():
    # mode, the clip range and dual_clip_c are rl.LossConfig's, validated once there (tests/test_rl_config.py)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(NEW, OLD, ADV, MASK, aggregation="sum")
