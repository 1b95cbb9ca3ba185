"""experiments/gradient_fidelity.py: the policy gradient each rollout engine's samples give, against the
on-policy one and the floor two on-policy estimates set.

Not slow: the math on synthetic gradients (the count sketch, the paired bootstrap), per-prompt learner gradients
adding up to the one-mini-batch gradient, one-line errors. Slow: real vLLM on a tiny random model, where two
on-policy estimates agree, an engine sampling from logits × 0.7 falls clearly below the floor, and token TIS
moves its estimate back toward the on-policy one.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import gradient_fidelity as gf


# ------------------------------------------------------------------------------------------ math, no engine
def test_count_sketch_is_linear_seeded_and_keeps_inner_products():
    rng = np.random.default_rng(0)
    dim, k = 200_000, 4096
    x, y = rng.standard_normal(dim).astype(np.float32), rng.standard_normal(dim).astype(np.float32)
    y = 0.6 * x + 0.8 * y                                         # cos(x, y) ≈ 0.6
    sketch, got_k = gf.make_sketch(dim, k, seed=3)
    assert got_k == k
    sx, sy = sketch(x), sketch(y)
    np.testing.assert_allclose(sketch(2.0 * x - y), 2.0 * sx - sy, rtol=1e-4, atol=1e-3)      # linear
    np.testing.assert_array_equal(gf.make_sketch(dim, k, seed=3)[0](x), sx)                    # seeded
    assert not np.allclose(gf.make_sketch(dim, k, seed=4)[0](x), sx)
    true_cos = float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))
    assert gf.compare(sx, sy)["cos"] == pytest.approx(true_cos, abs=0.05)                    # ~ 1/sqrt(k)
    assert np.linalg.norm(sx) == pytest.approx(np.linalg.norm(x), rel=0.05)
    identity, k_id = gf.make_sketch(1000, 0)                                                   # 0: no sketch
    assert k_id == 1000 and np.array_equal(identity(x[:1000]), x[:1000])


def _synthetic(p=48, k=512, seed=0):
    """Per-prompt gradient sketches: prompt p's true gradient mu_p; the reference and the floor are independent
    noisy draws; a biased arm is the floor (common random numbers) plus a bias; an unbiased arm the floor plus a
    little independent noise. Every n_p = 1."""
    rng = np.random.default_rng(seed)
    mu = rng.standard_normal((p, k)) + 2.0 * rng.standard_normal(k)      # a shared direction + prompt spread
    noise = lambda: 1.5 * rng.standard_normal((p, k))                   # noqa: E731
    floor = mu + noise()
    n = np.ones(p)
    return {("ref", "none"): (mu + noise(), n), ("fp32", "none"): (floor, n),
            ("biased", "none"): (floor + 1.2 * rng.standard_normal(k), n),
            ("biased", "fix"): (floor + 0.1 * rng.standard_normal(k), n),
            ("unbiased", "none"): (floor + 0.05 * rng.standard_normal((p, k)), n)}


def test_paired_bootstrap_flags_a_biased_estimate_and_not_an_unbiased_one():
    sketches = _synthetic()
    out = gf.bootstrap_intervals(sketches, gf.REFERENCE, gf.FLOOR, resamples=400, seed=0)
    floor = out[gf.FLOOR]
    assert floor["dcos_ci"] == (0.0, 0.0) and floor["excess_ci"] == (0.0, 0.0)
    lo, hi = floor["cos_ci"]
    assert 0.5 < lo < hi < 1.0 and 0.5 < floor["cos_sketch"] < 1.0
    assert out["biased", "none"]["dcos_ci"][1] < 0 and out["biased", "none"]["excess_ci"][0] > 0
    assert out["biased", "fix"]["dcos_none_ci"][0] > 0                     # the correction moved it back
    lo, hi = out["unbiased", "none"]["dcos_ci"]
    assert lo < 0 < hi or abs(hi - lo) < 0.02                              # indistinguishable from the floor
    # every estimate is the mean of its prompts' sketches (n_p = 1): the point values are those cosines
    ref = sketches[gf.REFERENCE][0].mean(0)
    assert out["biased", "none"]["cos_sketch"] == pytest.approx(
        gf.compare(sketches["biased", "none"][0].mean(0), ref)["cos"], rel=1e-9)


def test_cos_to_the_floor_sees_what_common_random_numbers_share():
    out = gf.bootstrap_intervals(_synthetic(), gf.REFERENCE, gf.FLOOR, resamples=200, seed=0)
    assert out[gf.FLOOR]["cos_floor"] == pytest.approx(1.0)
    cos = {key: row["cos_floor"] for key, row in out.items()}
    assert cos["unbiased", "none"] > cos["biased", "fix"] > cos["biased", "none"] + 0.1
    assert out["biased", "none"]["cos_floor_ci"][1] < out["unbiased", "none"]["cos_floor_ci"][0]


def test_samples_for_cos_extrapolates_the_floor():
    """Two independent means of N noisy draws around μ: the N* it predicts from the cos at N gives ~c*."""
    rng = np.random.default_rng(0)
    mu = 0.3 * rng.standard_normal(4000)

    def floor_cos(n):
        g1, g2 = (mu + rng.standard_normal((n, mu.size)).mean(0) for _ in range(2))
        return float(g1 @ g2 / np.linalg.norm(g1) / np.linalg.norm(g2))

    needed = gf.samples_for_cos(floor_cos(8), 8)
    assert set(needed) == {"0.5", "0.9", "0.99"} and needed["0.5"] < needed["0.9"] < needed["0.99"]
    assert floor_cos(needed["0.9"]) == pytest.approx(0.9, abs=0.04)
    assert gf.samples_for_cos(-0.01, 8) == {} and gf.samples_for_cos(1.0, 8) == {}


def test_group_weight_is_the_aggregations_normaliser():
    mask = np.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], np.float32)
    assert gf.group_weight("token-mean", mask) == 4
    assert gf.group_weight("seq-mean-token-mean", mask) == 2 == gf.group_weight("seq-mean-token-sum", mask)
    assert gf.group_weight("seq-mean-token-sum-norm", mask) == 3


@pytest.mark.parametrize("correction,aggregation", [("token_tis", "token-mean"), ("seq_mask", "seq-mean-token-mean")])
def test_per_prompt_gradients_add_up_to_the_one_mini_batch_gradient(correction, aggregation):
    """Σ_p n_p g_p / Σ_p n_p (each prompt's group prepared and differentiated alone) is the gradient of one
    mini-batch holding every group, with a correction that rejects whole sequences too; and the tis/* metrics of
    the concatenated groups are the whole batch's."""
    from portable_rl.engines.base import Rollout
    from portable_rl.learner_jax.model import Transformer
    from portable_rl.rl.dapo import build_batch
    from portable_rl.rl.learner import Learner
    from portable_rl.rl.rollout import ScoredGroup
    from portable_rl.rl.dapo import dapo_config
    import optax
    from test_micro_batches import CFG

    rng = np.random.default_rng(1)
    prompts, n = 3, 4
    groups = []
    for p in range(prompts):
        prompt = rng.integers(1, 48, rng.integers(2, 6)).tolist()
        rollouts = []
        for _ in range(n):
            response = rng.integers(1, 48, rng.integers(2, 12)).tolist()
            logps = (-np.log(48) + 0.7 * rng.standard_normal(len(response))).tolist()  # off-policy: some masked
            rollouts.append(Rollout(p, prompt, response, logps, "stop"))
        groups.append(ScoredGroup(None, rollouts, rng.integers(0, 2, n).astype(np.float32)))
    config = gf.correction_config(correction)
    model = Transformer(CFG, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)

    def cfg(groups_per_batch):
        return dapo_config(n_samples=n, prompt_batch_size=groups_per_batch, mini_batch_size=groups_per_batch,
                           max_response_tokens=16, loss_aggregation=aggregation, dynamic_sampling=False,
                           old_logprobs_from_update=False)

    one = Learner(model, optimizer, cfg(1), config)
    full, sketches, weights, tis_metrics, _ = gf.estimate(one, cfg(1), groups, 0, gf.make_sketch(1, 0)[0], config)
    whole = Learner(model, optimizer, cfg(prompts), config)
    batch, _ = build_batch(cfg(prompts), groups, 0)
    prepared = whole.prepare(batch)
    want, metrics = whole.gradient(prepared)
    metrics = {**prepared.metrics, **metrics}
    assert np.abs(want).max() > 1e-4
    np.testing.assert_allclose(full, want, rtol=2e-4, atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(sketches.sum(0) / weights.sum(), want, rtol=2e-4, atol=1e-6 * np.abs(want).max())
    for key in ("tis/kl", "tis/k3_kl", "tis/weight_ess", "tis/token_masked_frac", "tis/seq_masked_frac"):
        assert tis_metrics[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    if correction == "seq_mask":
        assert 0 < metrics["tis/seq_masked_frac"] < 1                      # the mask rejected some sequences


def test_bad_input_is_one_line(tmp_path):
    def error(*argv):
        with pytest.raises(SystemExit) as e:
            gf.main(["--checkpoint", str(tmp_path), *argv])
        message = str(e.value)
        assert message.startswith("error: ") and "\n" not in message
        return message

    (tmp_path / "config.json").write_text("{}")
    assert "unknown arm 'fp16'" in error("--arms", "fp16")
    assert "unknown arm 'fp32x0'" in error("--arms", "fp32x0")
    assert "unknown correction 'tls'" in error("--corrections", "tls")
    assert "two different seeds" in error("--seeds", "3", "3")
    assert "at least 2 samples" in error("--samples", "1")
    assert "--aggregation 'token-sum-norm': use one of" in error("--aggregation", "token-sum-norm")
    assert "no HF checkpoint" in error("--checkpoint", str(tmp_path / "missing"))
    assert gf.parse_arm("mxfp4") == ("mxfp4", 1.0) and gf.parse_arm("mxfp4x0.5") == ("mxfp4", 0.5)


def test_cache_round_trips_and_refuses_other_settings(tmp_path):
    from portable_rl.engines.base import Rollout
    from portable_rl.rl.rollout import ScoredGroup

    key = {"prompts": 2, "samples": 2, "seeds": [1, 2]}
    cache = gf.Cache(tmp_path, key)
    groups = [ScoredGroup("ex0", [Rollout(0, [1, 2], [3, 4], [-0.5, float("nan")], "stop"),
                                  Rollout(0, [1, 2], [5], [-1.0], "length")], np.array([1.0, 0.0], np.float32))]
    cache.save_draw("fp8", groups, {"reward_mean": 0.5})
    again, stats = gf.Cache(tmp_path, key).load_draw("fp8", ["ex0"])
    assert stats == {"reward_mean": 0.5} and again[0].example == "ex0"
    assert again[0].rollouts[1] == groups[0].rollouts[1] and np.isnan(again[0].rollouts[0].response_logprobs[1])
    np.testing.assert_array_equal(again[0].rewards, groups[0].rewards)
    assert cache.load_draw("int8", ["ex0"]) is None and cache.load_estimate(("fp8", "none")) is None
    full = np.arange(5, dtype=np.float32)
    cache.save_estimate(("ref", "none"), np.ones((2, 3)), np.array([4.0, 5.0]), {"cos": 1.0}, full=full)
    sketch, n, row = cache.load_estimate(("ref", "none"))
    assert sketch.shape == (2, 3) and list(n) == [4.0, 5.0] and row == {"cos": 1.0}
    np.testing.assert_array_equal(cache.reference_gradient(), full)
    with pytest.raises(gf.BadInput, match="other settings \\(samples, seeds\\)"):
        gf.Cache(tmp_path, {"prompts": 2, "samples": 4, "seeds": [1, 3]})


# ------------------------------------------------------------------------------------------ real vLLM
DIGITS = "gradfid_test_digits"


def _digit_reward():
    from portable_rl.tasks import available_rewards, register_reward

    if DIGITS not in available_rewards():
        register_reward(DIGITS)(lambda text, answer: sum(c.isdigit() for c in text) / max(len(text), 1))


@pytest.mark.slow  # one vLLM engine, 4 draws and 5 gradient estimates of 64 prompts (~90 s on 2 busy cores)
@pytest.mark.vllm
def test_on_policy_floor_detects_a_perturbed_engine_and_token_tis_moves_it_back(tmp_path):
    """A tiny random Qwen2 (init std 0.5: every prompt's next-character distribution is neither flat nor
    one-hot) rewarded for answering with a digit, one character per answer: (a) two on-policy estimates (fp32
    engine, seeds 1 and 2) agree (the floor); (b) the same engine with its logits scaled by 0.5 (sampled at
    T / 0.5) is clearly below the floor; (c) at a smaller mismatch (logits × 0.7, nothing clipped) token TIS
    brings the estimate back to the floor's distance: with one-token answers the token ratio is the whole
    importance weight, so capped at C = 2 without binding it is exact IS (the group's baseline and scale aside).
    Multi-token answers and a trained policy make the estimate heavy-tailed (rare tokens the learner finds
    unlikely carry large ∇log π); docs/experiments/gradient_fidelity.md shows that regime on the toy."""
    pytest.importorskip("vllm")
    from portable_rl.tasks import ArithmeticTask
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    _digit_reward()
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "qwen2", init_std=0.5, dtype="float32")
    setting = dataclasses.replace(
        gf.SETTINGS["toy"], checkpoint=checkpoint, max_tokens=1, loss={},
        task=lambda: ArithmeticTask(num_digits=2, ops="+", seed=0, num_eval=10, reward=DIGITS))
    results = gf.measure(setting, prompts=64, samples=128, arms=["fp32", "fp32x0.5", "fp32x0.7"],
                         corrections=["none", "token_tis"], seeds=[1, 2], workdir=tmp_path / "out", bootstrap=500,
                         log=lambda m: None)
    rows = {(r["arm"], r["correction"]): r for r in results["rows"]}
    floor = rows["fp32", "none"]
    assert results["draws"]["fp32x0.5"]["logit_scale"] == 0.5
    # (a) two independent on-policy estimates agree; the correction does nothing on-policy
    assert floor["cos"] > 0.9 and floor["rel_l2"] < 0.4, floor
    assert abs(floor["tis/kl"]) < 1e-3 and rows["fp32", "token_tis"]["cos"] == pytest.approx(floor["cos"], abs=1e-4)
    # (b) the wrong engine is detected: further from the reference than the floor, beyond the floor's CI
    wrong = rows["fp32x0.5", "none"]
    assert wrong["tis/kl"] > 0.3
    assert wrong["cos"] < floor["cos"] - 0.1 and wrong["cos"] < floor["cos_ci"][0], wrong
    assert wrong["dcos"] < -0.1 and wrong["excess"] > 0.1
    # (c) small mismatch: token TIS moves the estimate back toward on-policy
    hot, fixed = rows["fp32x0.7", "none"], rows["fp32x0.7", "token_tis"]
    assert 0.05 < hot["tis/kl"] < 0.3 and fixed["tis/clipped_frac"] < 0.01
    assert fixed["rel_l2"] < 0.6 * hot["rel_l2"] and fixed["cos"] > hot["cos"], (hot, fixed)
    assert fixed["excess"] < hot["excess"] and fixed["rel_l2"] < 1.5 * floor["rel_l2"]
    table = gf.markdown(results)
    assert table.count("\n") == 1 + len(results["rows"]) and "fp32 (floor)" in table
    assert gf.plot(results, tmp_path / "plot.png").stat().st_size > 0
    # the same command again: everything comes from the cache (no engine, no gradient), the same numbers
    logged = []
    again = gf.measure(setting, prompts=64, samples=128, arms=["fp32", "fp32x0.5", "fp32x0.7"],
                       corrections=["none", "token_tis"], seeds=[1, 2], workdir=tmp_path / "out", bootstrap=500,
                       log=logged.append)
    assert len(logged) == 1 and again["rows"] == results["rows"]
