"""Learner without a hidden call order (rl/learner.py): `step = update ∘ prepare`, stale prepared batches
refused, and a true bypass mode.

    bypass:     old := rollout logprobs, no forward pass in prepare, no correction weight in the loss
    decoupled:  old := the learner's recomputation (one forward per micro-batch), then the correction

Forward passes are counted on the learner's own jitted logprob functions (wrapped, still run).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from portable_rl import tis
from portable_rl.errors import ConfigError
from portable_rl.learner_jax.model import Transformer
from portable_rl.rl import learner as learner_lib
from portable_rl.rl.dapo import DapoConfig
from portable_rl.rl.learner import Learner
from test_micro_batches import CFG, TX, ragged_batch

NONE = tis.RolloutCorrectionConfig(mode="none")
TOKEN_TIS = tis.RolloutCorrectionConfig(mode="token", clip=2.0)


def make_learner(mode="decoupled", correction=NONE):
    model = Transformer(CFG, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    alg = DapoConfig(prompt_batch_size=3, mini_batch_size=3, n_samples=4, max_response_tokens=32,
                     policy_loss_mode=mode)
    return Learner(model, nnx.Optimizer(model, TX, wrt=nnx.Param), alg, correction)


def count_forwards(learner):
    """Wraps the learner's jitted logprob forwards; returns the list each call appends to."""
    calls = []
    for attr in ("_row_logprobs", "_logprobs"):
        fn = getattr(learner, attr)
        setattr(learner, attr, lambda *a, _fn=fn, _name=attr: calls.append(_name) or _fn(*a))
    return calls


def params(learner):
    return jax.tree.map(np.array, nnx.state(learner.model, nnx.Param))


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def batch():
    return ragged_batch()


@pytest.fixture(scope="module")
def own_batch(batch):
    """The batch with rollout logprobs := the (initial) learner's own: π_rollout = π_old."""
    own = dict(batch)
    own["rollout_logprobs"] = make_learner().old_logprobs(batch).astype(np.float32)
    return own


def test_bypass_prepare_runs_no_forward_and_takes_the_rollout_logprobs(batch):
    learner = make_learner("bypass")
    calls = count_forwards(learner)
    prepared = learner.prepare(batch)
    assert calls == []                                   # no old-logprob recompute
    mask = batch["response_mask"]
    np.testing.assert_array_equal(prepared.old_logprobs, batch["rollout_logprobs"] * mask)
    np.testing.assert_array_equal(prepared.tis_weights, mask)  # weight 1 on every response token
    assert prepared.keep_mask.all() and not any(k.startswith("tis/") for k in prepared.metrics)
    for mb in (mb for mini in prepared.micro_batches for mb in mini):  # what the loss sees
        np.testing.assert_array_equal(mb["old_logprobs"], mb["rollout_logprobs"] * mb["response_mask"])
    before = params(learner)
    metrics = learner.update(prepared)
    assert calls == [] and metrics["train/loss"] != 0 and max_diff(params(learner), before) > 1e-3


def test_decoupled_prepare_recomputes_once_per_micro_batch(batch):
    learner = make_learner("decoupled", TOKEN_TIS)
    calls = count_forwards(learner)
    prepared = learner.prepare(batch)
    assert len(calls) == prepared.metrics["batch/micro_batches"] >= 1
    assert "tis/kl" in prepared.metrics
    # the off-policy rollout logprobs (sequence 1 is 3 nats high) are corrected: weights below 1 there
    assert (prepared.tis_weights[1][batch["response_mask"][1] > 0] < 1).all()


@pytest.mark.slow  # five learners' steps (~50 s on 2 busy cores)
def test_bypass_equals_decoupled_when_rollout_is_the_old_policy(own_batch):
    """π_rollout = π_old: bypass (no recompute) and decoupled (recompute, TIS weights min(1, C) = 1) take
    the same update; with the rollout logprobs shifted, bypass follows them and decoupled does not."""
    updated = {}
    for mode, correction in (("bypass", NONE), ("decoupled", NONE), ("decoupled", TOKEN_TIS)):
        learner = make_learner(mode, correction)
        before = params(learner)
        learner.step(own_batch)
        updated[mode, correction.mode] = params(learner)
    moved = max_diff(updated["decoupled", "none"], before)
    assert moved > 1e-3
    assert max_diff(updated["bypass", "none"], updated["decoupled", "none"]) <= 1e-5 * moved
    assert max_diff(updated["decoupled", "token"], updated["decoupled", "none"]) <= 1e-5 * moved

    shifted = dict(own_batch, rollout_logprobs=own_batch["rollout_logprobs"] - 0.3 * own_batch["response_mask"])
    bypass, decoupled = make_learner("bypass"), make_learner("decoupled")
    bypass.step(shifted)
    decoupled.step(shifted)
    assert max_diff(params(decoupled), updated["decoupled", "none"]) <= 1e-5 * moved  # ignores rollout lp
    assert max_diff(params(bypass), updated["bypass", "none"]) > 1e-2 * moved       # ratio π_θ / π_rollout


def test_step_is_update_of_prepare_and_stale_batches_are_refused(batch):
    a, b = make_learner("decoupled", TOKEN_TIS), make_learner("decoupled", TOKEN_TIS)
    prepared = a.prepare(batch)
    via_parts = {**prepared.metrics, **a.update(prepared)}
    via_step = b.step(batch)
    assert via_step.keys() == via_parts.keys()
    for k, v in via_parts.items():
        assert via_step[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
    assert max_diff(params(a), params(b)) == 0.0
    # the old logprobs of `prepared` are of the policy before a's update: using it again would be stale
    with pytest.raises(ValueError, match="1 update\\(s\\) ran since; prepare it again"):
        a.update(prepared)
    early = a.prepare(batch)
    a.update(a.prepare(batch))
    with pytest.raises(ValueError, match="stale|ran since"):
        a.update(early)


def test_bypass_with_an_active_correction_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as e:
        make_learner("bypass", TOKEN_TIS)
    message = str(e.value)
    assert "\n" not in message and "tis.RolloutCorrectionConfig.mode = 'none'" in message
    with pytest.raises(ConfigError, match="bypass"):
        make_learner("bypass", tis.RolloutCorrectionConfig(mode="none", token_mask_low=0.5))


def test_correct_is_a_deprecated_alias_of_prepare(batch, monkeypatch):
    learner = make_learner("bypass")
    monkeypatch.setattr(learner_lib, "_CORRECT_WARNED", False)
    with pytest.warns(FutureWarning, match="Learner.prepare"):
        old = learner.correct(batch)
    np.testing.assert_array_equal(old.old_logprobs, learner.prepare(batch).old_logprobs)
