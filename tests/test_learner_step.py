"""Learner without a hidden call order (rl/learner.py): `step = update ∘ prepare`, stale prepared batches
refused, and a true bypass mode.

    bypass:     old := rollout logprobs, no forward pass in prepare, no correction weight in the loss
    decoupled:  old := the learner's recomputation (one forward per micro-batch), then the correction
    deferred:   decoupled, but the first mini-batch's old logprobs are its update's own forward (stop-gradient):
                one forward fewer, the same update, weights and tis/* metrics as recomputing

Forward passes are counted on the learner's own jitted logprob functions (wrapped, still run).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from portable_rl import tis
from portable_rl.errors import ConfigError
from portable_rl.learner_jax.memory import MemoryConfig
from portable_rl.learner_jax.model import Transformer
from portable_rl.rl import learner as learner_lib
from portable_rl.rl.dapo import dapo_config
from portable_rl.rl.learner import Learner
from test_micro_batches import CFG, TX, ragged_batch

NONE = tis.RolloutCorrectionConfig(mode="none")
TOKEN_TIS = tis.RolloutCorrectionConfig(mode="token", clip=2.0)


def make_learner(mode="decoupled", correction=NONE, from_update=False, mini_batch_size=3, ppo_epochs=1, memory=None):
    """`from_update`: LossConfig.old_logprobs_from_update (off here unless asked: these tests count the
    recompute's forward passes)."""
    model = Transformer(CFG, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    alg = dapo_config(prompt_batch_size=3, mini_batch_size=mini_batch_size, n_samples=4, max_response_tokens=32,
                     policy_loss_mode=mode, old_logprobs_from_update=from_update, ppo_epochs=ppo_epochs)
    return Learner(model, nnx.Optimizer(model, TX, wrt=nnx.Param), alg, correction, memory=memory)


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


def arrays_of(prepared):
    """Copies of a PreparedBatch's views, micro-batch arrays and metrics, by name."""
    out = {"old_logprobs": prepared.old_logprobs.copy(), "tis_weights": prepared.tis_weights.copy(),
           "keep_mask": prepared.keep_mask.copy(), **{k: np.array(v) for k, v in prepared.metrics.items()}}
    for i, mini in enumerate(prepared.micro_batches):
        for j, mb in enumerate(mini):
            out.update({f"{i}/{j}/{k}": v.copy() for k, v in mb.items()})
    return out


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
        learner.update(learner.prepare(own_batch))
        updated[mode, correction.mode] = params(learner)
    moved = max_diff(updated["decoupled", "none"], before)
    assert moved > 1e-3
    assert max_diff(updated["bypass", "none"], updated["decoupled", "none"]) <= 1e-5 * moved
    assert max_diff(updated["decoupled", "token"], updated["decoupled", "none"]) <= 1e-5 * moved

    shifted = dict(own_batch, rollout_logprobs=own_batch["rollout_logprobs"] - 0.3 * own_batch["response_mask"])
    bypass, decoupled = make_learner("bypass"), make_learner("decoupled")
    bypass.update(bypass.prepare(shifted))
    decoupled.update(decoupled.prepare(shifted))
    assert max_diff(params(decoupled), updated["decoupled", "none"]) <= 1e-5 * moved  # ignores rollout lp
    assert max_diff(params(bypass), updated["bypass", "none"]) > 1e-2 * moved       # ratio π_θ / π_rollout


def test_prepare_then_update_is_deterministic_and_stale_batches_are_refused(batch):
    a, b = make_learner("decoupled", TOKEN_TIS), make_learner("decoupled", TOKEN_TIS)
    prepared = a.prepare(batch)
    first = {**prepared.metrics, **a.update(prepared)}
    again = b.prepare(batch)
    second = {**again.metrics, **b.update(again)}
    assert second.keys() == first.keys()
    for k, v in first.items():
        assert second[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
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


@pytest.mark.parametrize("mini_batch_size,ppo_epochs,max_tokens", [(3, 1, None), (3, 1, 48), (1, 2, None)],
                         ids=["one-mini-batch", "micro-batches", "three-mini-batches-two-epochs"])
def test_deferred_first_mini_batch_skips_its_forward_and_equals_recompute(batch, mini_batch_size, ppo_epochs,
                                                                          max_tokens):
    """old_logprobs_from_update: the first mini-batch's old logprobs come from its update's forward, so prepare
    runs forwards only for the other mini-batches, and the update and the metrics (tis/* included) equal the
    recompute's. The PreparedBatch is left as prepare made it: the deferred rows 0, the others recomputed."""
    memory = MemoryConfig(max_tokens_per_micro_batch=max_tokens, logprob_chunk_tokens=None)
    runs = {}
    for from_update in (False, True):
        learner = make_learner("decoupled", TOKEN_TIS, from_update, mini_batch_size, ppo_epochs, memory)
        calls = count_forwards(learner)
        before = params(learner)
        prepared = learner.prepare(batch)
        forwards = len(calls)
        as_prepared = arrays_of(prepared)
        metrics = {**prepared.metrics, **learner.update(prepared)}
        assert arrays_of(prepared).keys() == as_prepared.keys()                     # update leaves it alone
        for k, v in as_prepared.items():
            np.testing.assert_array_equal(arrays_of(prepared)[k], v, err_msg=k)
        runs[from_update] = (before, params(learner), prepared, metrics, forwards, len(calls) - forwards)
    (before, want, ref, ref_metrics, ref_forwards, _), (_, got, fused, metrics, forwards, later) = runs[False], runs[True]
    first = ref.micro_batches[0]
    assert forwards == ref_forwards - len(first) and later == 0   # one forward per micro-batch saved, none added
    assert max(len(mini) for mini in ref.micro_batches) == 1 or max_tokens  # grad accumulation when budgeted
    assert len(first) > 1 or not max_tokens
    assert ref.deferred is None and fused.deferred.index == 0
    moved = max_diff(want, before)
    assert moved > 1e-3 and max_diff(got, want) <= 1e-5 * moved
    deferred = np.zeros(len(batch["seq_len"]), bool)
    deferred[np.concatenate([lay.seq for lay in fused.deferred.layouts])] = True
    assert not fused.old_logprobs[deferred].any() and not fused.tis_weights[deferred].any()
    np.testing.assert_array_equal(fused.old_logprobs[~deferred], ref.old_logprobs[~deferred])
    assert (ref.tis_weights[1][batch["response_mask"][1] > 0] < 1).all()
    assert metrics.keys() == ref_metrics.keys() and "tis/kl" in metrics
    for k, v in ref_metrics.items():
        if not k.startswith("time/"):
            assert metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k


def test_completing_the_deferred_mini_batch_equals_recomputing_it(batch):
    """DeferredMiniBatch.complete on what the loss's own forward returns for the deferred micro-batches (their old
    logprobs, stop-gradient, and token TIS weights, which it pops, leaving the metrics) gives the PreparedBatch
    that recomputing them in a separate forward gives: old logprobs, weights, micro-batches and tis/* metrics,
    to fp32 tolerance.
    Three mini-batches (the first deferred), each in 48-token micro-batches."""
    memory = MemoryConfig(max_tokens_per_micro_batch=48, logprob_chunk_tokens=None)
    deferring = make_learner("decoupled", TOKEN_TIS, True, mini_batch_size=1, memory=memory)
    prepared = deferring.prepare(batch)
    want = make_learner("decoupled", TOKEN_TIS, False, mini_batch_size=1, memory=memory).prepare(batch)
    assert len(prepared.micro_batches) == 3 and len(prepared.micro_batches[0]) > 1
    index = prepared.deferred.index
    assert not any(k in mb for mb in prepared.micro_batches[index] for k in learner_lib.DeferredMiniBatch.KEYS)
    assert not any(k.startswith("tis/") for k in prepared.metrics)
    loss_fn = learner_lib.make_loss_fn(deferring.cfg.loss, 1.0, None, TOKEN_TIS)
    outputs = [dict(loss_fn(deferring.model, mb)[1]) for mb in prepared.micro_batches[index]]
    got = prepared.deferred.complete(prepared, outputs, TOKEN_TIS)
    assert got.deferred is None and prepared.deferred is not None and prepared.micro_batches is not got.micro_batches
    assert all("tokens" in out and not set(learner_lib.DeferredMiniBatch.KEYS) & set(out) for out in outputs)
    np.testing.assert_allclose(got.old_logprobs, want.old_logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.tis_weights, want.tis_weights, rtol=1e-5, atol=1e-6)
    assert (got.tis_weights[1][batch["response_mask"][1] > 0] < 1).all()   # sequence 1's weights are corrected
    np.testing.assert_array_equal(got.keep_mask, want.keep_mask)
    assert got.metrics.keys() == want.metrics.keys() and "tis/kl" in got.metrics
    for k, v in want.metrics.items():
        assert got.metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    for got_mini, want_mini in zip(got.micro_batches, want.micro_batches, strict=True):
        for got_mb, want_mb in zip(got_mini, want_mini, strict=True):
            assert got_mb.keys() == want_mb.keys()
            for k in want_mb:
                np.testing.assert_allclose(got_mb[k], want_mb[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_deferring_needs_a_token_local_correction(batch):
    """A sequence-level weight or any mask needs every token's old logprob before the update: recomputed."""
    for correction in (tis.RolloutCorrectionConfig(mode="sequence", clip=3.0),
                       tis.RolloutCorrectionConfig(mode="token", clip=2.0, token_mask_low=0.5),
                       tis.RolloutCorrectionConfig(mode="token", clip=2.0, self_normalize=True)):
        learner = make_learner("decoupled", correction, from_update=True)
        calls = count_forwards(learner)
        prepared = learner.prepare(batch)
        assert not learner.defers_first_mini_batch and prepared.deferred is None
        assert len(calls) == prepared.metrics["batch/micro_batches"] and "tis/kl" in prepared.metrics
    assert make_learner("decoupled", TOKEN_TIS, from_update=True).defers_first_mini_batch
    assert not make_learner("bypass", NONE, from_update=True).defers_first_mini_batch


def test_gradient_is_the_update_direction_and_changes_nothing(batch):
    """Learner.gradient: the flattened loss gradient `update` would hand the optimizer (SGD at lr 1 moves the
    weights by exactly minus it), with micro-batches or one call alike, the on-policy mini-batch included;
    it leaves the weights and the update count alone, so the same PreparedBatch can still be updated."""
    import optax

    grads = {}
    for from_update, budget in ((False, None), (True, 48)):
        model = Transformer(CFG, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
        alg = dapo_config(prompt_batch_size=3, mini_batch_size=3, n_samples=4, max_response_tokens=32,
                          old_logprobs_from_update=from_update)
        learner = Learner(model, nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param), alg, TOKEN_TIS,
                          memory=MemoryConfig(max_tokens_per_micro_batch=budget, logprob_chunk_tokens=None))
        before = params(learner)
        prepared = learner.prepare(batch)
        grad, metrics = learner.gradient(prepared)
        assert learner.updates == 0 and max_diff(params(learner), before) == 0.0
        assert "tis/kl" in {**prepared.metrics, **metrics} and metrics["train/loss"] != 0
        learner.update(prepared)
        moved = np.concatenate([(b - a).ravel() for a, b in zip(jax.tree.leaves(params(learner)),
                                                                 jax.tree.leaves(before))])
        np.testing.assert_allclose(grad, moved, rtol=1e-4, atol=1e-6 * np.abs(grad).max())
        grads[from_update] = grad
    np.testing.assert_allclose(grads[True], grads[False], rtol=1e-4, atol=1e-5 * np.abs(grads[False]).max())
