"""The memory knobs change memory and time, never the update (issue 12's acceptance test).

One step of the default run's learner (gin/dapo_fp8.gin: DAPO clip-higher, token-mean, token TIS C = 2,
AdamW with clipping; fp32 compute) on the default tiny model (`make_tiny_checkpoint`: Qwen2, hidden 128,
2 layers, vocab 128), on a ragged batch built by `dapo.build_batch` from arithmetic prompts with random
responses, gives the same `train/loss`, `train/grad_norm`, old logprobs and TIS diagnostics whatever
the knobs: dense attention / one sequence per row / one call per mini-batch / whole head versus
blockwise attention / packed rows / 64-token micro-batches / 16-token head chunks / remat.
"""

import numpy as np
import pytest

from portable_rl.learner_jax import attention

REFERENCE = dict(attention_impl="dense", pack_sequences=False, max_tokens_per_micro_batch=None,
                 logprob_chunk_tokens=None, remat="none")
LEAN = dict(attention_impl="blockwise" if "blockwise" in attention.IMPLS else "dense", pack_sequences=True,
            max_tokens_per_micro_batch=64, logprob_chunk_tokens=16, remat="full")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from portable_rl.engines.base import Rollout
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.dapo import build_batch
    from portable_rl.rl.dapo import dapo_config
    from portable_rl.rl.rollout import ScoredGroup
    from portable_rl.tasks import ArithmeticTask
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("equiv") / "model", dtype="float32")
    codec = TextCodec(path)
    # gin/dapo_fp8.gin's algorithm with 4 prompts per step, 2 per mini-batch (two optimizer updates)
    cfg = dapo_config(prompt_batch_size=4, mini_batch_size=2, n_samples=8, dynamic_sampling=True,
                     max_response_tokens=8, overlong_buffer=2, overlong_penalty=1.0, advantage="grpo",
                     clip_eps_low=0.2, clip_eps_high=0.28, loss_aggregation="token-mean", temperature=1.0)
    rng = np.random.default_rng(0)
    groups = []
    for example in ArithmeticTask().train_batch(0, 0, cfg.data.prompt_batch_size):
        prompt = codec.encode_prompt(example.prompt)
        rollouts = []
        for _ in range(cfg.generation.n_samples):  # 1-8 response tokens, logprobs near a vocab-128 random model's
            response = rng.integers(3, 98, rng.integers(1, cfg.generation.max_response_tokens + 1)).tolist()
            logps = (-np.log(128) + 0.3 * rng.standard_normal(len(response))).tolist()
            rollouts.append(Rollout(0, prompt, response, logps, "length"))
        groups.append(ScoredGroup(example, rollouts, rng.integers(0, 2, cfg.generation.n_samples).astype(np.float32)))
    batch, _ = build_batch(cfg, groups, codec.pad_id)
    return path, cfg, batch


_STEPS = {}


def one_step(path, cfg, batch, knobs):
    """(PreparedBatch, update metrics, old logprobs [N, T]) of one learner step with `knobs`, computed once per
    knob set. The old logprobs: `Learner.old_logprobs` before the step (the PreparedBatch's are 0 on the first
    mini-batch, whose update computes them: LossConfig.old_logprobs_from_update)."""
    key = (str(path), tuple(sorted(knobs.items())))
    if key not in _STEPS:
        _STEPS[key] = _one_step(path, cfg, batch, knobs)
    return _STEPS[key]


def _one_step(path, cfg, batch, knobs):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl import tis
    from portable_rl.convert.hf import load_hf_model
    from portable_rl.learner_jax.memory import MemoryConfig
    from portable_rl.learner_jax.optim import make_optimizer
    from portable_rl.rl.learner import Learner

    memory = MemoryConfig(**knobs)
    model, _ = load_hf_model(path, param_dtype=jnp.float32, compute_dtype=jnp.float32,
                             attention_impl=memory.attention_impl, remat=memory.remat)
    tx = make_optimizer(learning_rate=3e-4, warmup_steps=5, total_steps=200, schedule="constant",
                        weight_decay=0.0, max_grad_norm=1.0)
    learner = Learner(model, nnx.Optimizer(model, tx, wrt=nnx.Param), cfg,
                      tis.RolloutCorrectionConfig(mode="token", clip=2.0), memory=memory)
    old = learner.old_logprobs(batch)
    prepared = learner.prepare(batch)
    metrics = learner.update(prepared)
    return prepared, metrics, old, [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.mark.slow  # two learners of the default tiny model compiled (~1 min on 2 busy cores)
def test_memory_knobs_give_the_same_step(setup):
    path, cfg, batch = setup
    ref_prepared, ref, ref_old, _ = one_step(path, cfg, batch, REFERENCE)
    lean_prepared, lean, lean_old, _ = one_step(path, cfg, batch, LEAN)
    assert ref_prepared.metrics["batch/micro_batches"] == 2 < lean_prepared.metrics["batch/micro_batches"]
    assert lean_prepared.metrics["batch/padding_fraction"] < ref_prepared.metrics["batch/padding_fraction"]
    assert ref["train/grad_norm"] > 0 and ref["train/loss"] != 0
    for k in ("train/loss", "train/grad_norm"):
        assert lean[k] == pytest.approx(ref[k], rel=1e-4), k
    for k, want in ref.items():
        assert lean[k] == pytest.approx(want, rel=1e-4, abs=1e-6), k
    for k, want in ref_prepared.metrics.items():
        if k.startswith("tis/"):
            assert lean_prepared.metrics[k] == pytest.approx(want, rel=1e-4, abs=1e-6), k
    np.testing.assert_allclose(lean_old, ref_old, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two more learners of the default tiny model compiled (the first test's two are reused)
def test_shared_prompts_give_the_same_step(setup):
    """share_prompts (a group's answers share one copy of the prompt) computes the same update as one
    sequence per row, on fewer tokens: with 64-token micro-batches (groups split into units that fit)
    and in one call per mini-batch (dense attention)."""
    path, cfg, batch = setup
    _, ref, ref_old, _ = one_step(path, cfg, batch, REFERENCE)
    lean_prepared, _, _, _ = one_step(path, cfg, batch, LEAN)
    for knobs in (dict(LEAN, share_prompts=True), dict(REFERENCE, pack_sequences=True, share_prompts=True)):
        prepared, got, old, _ = one_step(path, cfg, batch, knobs)
        assert prepared.metrics["batch/learner_tokens"] < 0.8 * lean_prepared.metrics["batch/learner_tokens"], knobs
        for k, want in ref.items():
            assert got[k] == pytest.approx(want, rel=1e-4, abs=1e-6), (k, knobs)
        np.testing.assert_allclose(old, ref_old, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # one more learner of the default tiny model compiled (the reference is reused)
def test_update_by_layer_gives_the_same_step(setup):
    """MemoryConfig.update_by_layer: the learner accumulates the one micro-batch's gradient and updates one layer
    per call, where the reference runs gradient and update in one call; the same metrics and params."""
    path, cfg, batch = setup
    _, ref, _, ref_params = one_step(path, cfg, batch, REFERENCE)
    _, got, _, got_params = one_step(path, cfg, batch, {**REFERENCE, "update_by_layer": True})
    assert ref["train/grad_norm"] > 0
    for k, want in ref.items():
        assert got[k] == pytest.approx(want, rel=1e-5, abs=1e-7), k
    for want, x in zip(ref_params, got_params, strict=True):
        np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-6)
