"""SGLang adapter contract tests against the strict fake of sglang 0.5.23 (`tests/sglang_fake.py`).

sglang needs CUDA and is not installed here; `scripts/gpu_check_sglang.py` runs the same adapter against the
real engine on a GPU box. The fake takes its keyword sets from the table `tests/fixtures/sglang_api_0.5.23.json`;
`test_recorded_table_matches_the_sglang_source` re-reads that table from SGLang's source whenever one is
available (an installed sglang, or $SGLANG_SRC = the wheel or an unpacked copy) and fails on any difference.
"""

import inspect
import json
import os
import shutil
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

from portable_rl.engines.buckets import fused_group
from portable_rl.engines.quantize import SOURCE_MARKER, write_blockwise_fp8_checkpoint
from portable_rl.engines import SamplingConfig, create_engine
from portable_rl.engines.checkpoint import WeightUpdateError
from portable_rl.engines.sglang_adapter import SGLangEngine, SGLangWeightUpdateError
from portable_rl.errors import ConfigError
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint
from sglang_api import ENGINE_METHODS, find_source, load_recorded, read_api
from sglang_fake import API, EngineProcessDied, FakeSGLangEngine, recorded_signature
from serving import Countdown, Waves, batch_requests, serve_log, short_chain

ADAPTER_CALLS = ("generate", "async_generate", "begin_weight_update", "update_weights_from_tensor", "end_weight_update",
                 "flush_cache", "release_memory_occupation", "resume_memory_occupation", "shutdown")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sgl") / "qwen2", "qwen2")


@pytest.fixture(scope="module")
def weights(qwen2):
    return load_file(f"{qwen2}/model.safetensors")


def make(path, **kw):
    return create_engine("sglang", model_path=path, engine_factory=FakeSGLangEngine, **kw)


def names_of(calls):
    return [c[0] for c in calls]


# ------------------------------------------------------------------------------------- the fake vs SGLang
def test_recorded_table_matches_the_sglang_source():
    where = find_source()
    if where is None:
        pytest.skip("no sglang source here (install sglang or set SGLANG_SRC to its wheel); the table is checked "
                    "against it where one is available")
    assert read_api(where) == load_recorded(API["version"])


def test_fake_mirrors_the_recorded_signatures(qwen2):
    assert API["version"] == "0.5.23" and "0.5.23" in inspect.getmodule(SGLangEngine).__doc__
    for method in ADAPTER_CALLS:
        assert method in ENGINE_METHODS
        assert inspect.signature(getattr(FakeSGLangEngine, method)) == recorded_signature(method)
        assert inspect.iscoroutinefunction(getattr(FakeSGLangEngine, method)) == (method in API["engine_coroutines"])
    fake = FakeSGLangEngine(model_path=qwen2)
    with pytest.raises(TypeError, match="no_such_server_arg"):
        FakeSGLangEngine(model_path=qwen2, no_such_server_arg=1)  # ServerArgs is a strict msgspec Struct
    with pytest.raises(TypeError):
        fake.update_weights_from_tensor(tensors=[])  # the real keyword is named_tensors
    with pytest.raises(TypeError, match="seed"):
        fake.generate(input_ids=[[1]], sampling_params=[{"max_new_tokens": 1, "seed": 3}])  # it is sampling_seed
    assert fake.flush_cache().success is True  # an object, not a tuple


def test_sglang_outside_the_supported_range_is_refused_in_one_line(qwen2, monkeypatch):
    """The adapter was written against 0.5.23 (its source layout): an older SGLang, or 0.6, stops before it starts,
    with the line vLLM's adapter gives (one helper: engines/canary.check_version)."""
    from portable_rl.engines.sglang_internals import check_sglang_version
    from portable_rl.engines.vllm_internals import check_vllm_version

    for version in ("0.5.23", "0.5.23.post1", "0.5.30", "0.5.99rc1"):
        check_sglang_version(version)
    for version in ("0.5.22", "0.5.8", "0.6.0", "1.0.0", "dev"):
        with pytest.raises(ConfigError, match=rf"^SGLang {version} is installed, but portable_rl's SGLang adapter is "
                                              r"tested with 0.5.23 or a later 0.5.x only; pip install -r "
                                              r"requirements/gpu-sglang.txt") as err:
            check_sglang_version(version)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError) as vllm_err:
        check_vllm_version("0.31.0")
    assert str(vllm_err.value).startswith("vLLM 0.31.0 is installed, but portable_rl's vLLM adapter is tested with "
                                          "0.32.x only; ")
    started = []  # the real import path: the check runs before SGLang's Engine is built
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(__version__="0.5.22",
                                                                      Engine=lambda **kw: started.append(kw)))
    with pytest.raises(ConfigError, match="^SGLang 0.5.22 is installed"):
        create_engine("sglang", model_path=qwen2)
    assert started == []


def test_fake_ignores_seeds_unless_deterministic(qwen2):
    params = [{"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 5}]
    loose = FakeSGLangEngine(model_path=qwen2)
    assert loose.generate(input_ids=[[3]], sampling_params=params) != loose.generate(input_ids=[[3]],
                                                                                    sampling_params=params)
    strict = FakeSGLangEngine(model_path=qwen2, enable_deterministic_inference=True)
    assert strict.generate(input_ids=[[3]], sampling_params=params) == strict.generate(input_ids=[[3]],
                                                                                      sampling_params=params)


def test_fake_rejects_updates_outside_a_session_and_dies_on_a_bad_load(qwen2):
    fake = FakeSGLangEngine(model_path=qwen2)
    before = fake.weights["model.norm.weight"].clone()
    reply = fake.update_weights_from_tensor([("model.norm.weight", before + 1)])
    assert reply == (False, API["outside_session"])
    assert torch.equal(fake.weights["model.norm.weight"], before)
    fake.begin_weight_update()
    with pytest.raises(EngineProcessDied):
        fake.update_weights_from_tensor([("model.norm.weight", torch.ones(7))])


# ------------------------------------------------------------------------------------- rollouts and seeds
def test_generate_request_and_rollouts(qwen2):
    engine = make(qwen2, seed=5)
    fake = engine._engine
    assert fake.kwargs == dict(model_path=qwen2, random_seed=5, dtype="bfloat16", enable_deterministic_inference=True)
    sampling = SamplingConfig(temperature=0.6, max_tokens=5, n=2, seed=100, stop_token_ids=(7,))
    rollouts = engine.generate([[1, 2, 3], [4]], sampling)
    _, request = fake.calls[-1]
    assert request["return_logprob"] is True
    assert request["input_ids"] == [[1, 2, 3], [1, 2, 3], [4], [4]]  # n samples, prompt-major
    assert [p["sampling_seed"] for p in request["sampling_params"]] == [100, 101, 102, 103]  # seed_for(i, j)
    assert all(p["temperature"] == 0.6 and p["max_new_tokens"] == 5 and p["top_p"] == 1.0 and p["top_k"] == -1
               and p["stop_token_ids"] == [7] for p in request["sampling_params"])
    assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1]
    embed = fake.weights["model.embed_tokens.weight"].float()
    for r in rollouts:  # the adapter returns the engine's sampled-token logprobs, position by position
        prev = [r.prompt_token_ids[-1]] + r.response_token_ids[:-1]
        expected = torch.log_softmax(embed[prev] @ embed.T * 10.0 / 0.6, -1)[range(len(prev)), r.response_token_ids]
        assert r.response_logprobs == pytest.approx(expected.tolist(), abs=1e-5)
        assert r.finish_reason == ("stop" if r.response_token_ids[-1] == 7 else "length")


def test_stop_strings_keep_the_completing_token_and_requests_stay_inside_the_context(qwen2):
    """SamplingConfig.stop reaches SGLang as `stop` with no_stop_trim (keys checked against SamplingParams' real
    fields); the rollout's ids end with the token completing the string. A prompt near the context gets its
    max_new_tokens cut to max_model_len − len(prompt), which SGLang would otherwise refuse."""
    from sglang_fake import fake_text

    engine = make(qwen2, seed=5)
    fake = engine._engine
    assert engine.max_model_len == 512  # the config's max_position_embeddings
    prompts = [[1, 2, 3], [4]]
    plain = engine.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=40, n=2, seed=100))
    stop = fake_text(plain[0].response_token_ids[3:5])  # two letters sample 0 of prompt 0 produced
    rollouts = engine.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=40, n=2, seed=100, stop=(stop,)))
    params = fake.calls[-1][1]["sampling_params"]
    assert all(p["stop"] == [stop] and p["no_stop_trim"] is True for p in params)
    for r, whole in zip(rollouts, plain):
        ids = r.response_token_ids
        assert ids == whole.response_token_ids[:len(ids)]  # the same samples, up to the stop
        if stop in fake_text(ids):
            assert r.finish_reason == "stop" and stop not in fake_text(ids[:-1]) and fake_text(ids).endswith(stop)
    assert len(rollouts[0].response_token_ids) <= 5 and rollouts[0].finish_reason == "stop"

    near = [[1] * 500]
    (r,) = engine.generate(near, SamplingConfig(temperature=1.0, max_tokens=40, seed=1))
    assert fake.calls[-1][1]["sampling_params"][0]["max_new_tokens"] == 12 and len(r.response_token_ids) <= 12
    with pytest.raises(ValueError, match="prompt 0 has 512 tokens; the engine serves at most 512"):
        engine.generate([[1] * 512], SamplingConfig(max_tokens=4))


def test_same_seed_same_rollouts_and_shards_match_the_whole_batch(qwen2):
    """The resume and fleet guarantee; it failed before the adapter turned on deterministic inference."""
    engine = make(qwen2, seed=0)
    sampling = SamplingConfig(temperature=1.0, max_tokens=8, n=2, seed=31)
    prompts = [[3], [9, 4], [5, 6, 7]]
    whole = engine.generate(prompts, sampling)
    assert [r.response_token_ids for r in engine.generate(prompts, sampling)] == \
           [r.response_token_ids for r in whole]
    shard = engine.generate(prompts[1:], SamplingConfig(temperature=1.0, max_tokens=8, n=2, seed=sampling.seed_for(1)))
    assert [r.response_token_ids for r in shard] == [r.response_token_ids for r in whole[2:]]
    other = engine.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=8, n=2, seed=32))
    assert [r.response_token_ids for r in other] != [r.response_token_ids for r in whole]


def test_non_deterministic_engine_says_seeds_are_ignored(qwen2):
    engine = make(qwen2, deterministic=False)
    assert engine._engine.kwargs["enable_deterministic_inference"] is False and not engine.seeds_honoured
    with pytest.warns(RuntimeWarning, match="seeds are ignored"):
        engine.generate([[3]], SamplingConfig(max_tokens=4, seed=1))
    assert "sampling_seed" not in engine._engine.calls[-1][1]["sampling_params"][0]
    assert make(qwen2, seed=None)._engine.kwargs["enable_deterministic_inference"] is False  # nothing to honour


# ------------------------------------------------------------------------------------- serving
def test_serving_a_batch_equals_generate(qwen2):
    """The requests of one generate call, served as async_generate tasks (one per sample, on Engine.loop): the
    same rollouts, and the same per-sample sampling_params as generate's."""
    engine = make(qwen2, seed=0)
    sampling = SamplingConfig(temperature=1.0, max_tokens=8, n=2, seed=31, stop_token_ids=(7,))
    prompts = [[3], [9, 4], [5, 6, 7]]
    reference = engine.generate(prompts, sampling)
    batch_params = engine._engine.calls[-1][1]["sampling_params"]
    log = serve_log(engine, batch_requests(prompts, sampling), lambda request, rollouts: None)
    served = [r for _, _, rollouts in sorted(log, key=lambda entry: entry[1].key) for r in rollouts]
    assert [(r.response_token_ids, r.response_logprobs, r.finish_reason) for r in served] == \
           [(r.response_token_ids, r.response_logprobs, r.finish_reason) for r in reference]
    sent = [c[1] for c in engine._engine.calls if c[0] == "async_generate"]
    assert sorted(map(str, (c["sampling_params"] for c in sent))) == sorted(map(str, batch_params))
    assert all(c["return_logprob"] is True for c in sent)


def test_serving_answers_a_request_when_it_finishes_not_when_its_wave_does(qwen2):
    """A 2-token request, followed three times by another, beside a 40-token one: SGLang's scheduler serves the
    follow-ups while the long one runs, so it is answered last; waves answer the first two together. Every
    request gets the tokens a lone generate gives it (its seed is its own)."""
    from portable_rl.engines.base import Request

    engine = make(qwen2, seed=0)
    short = SamplingConfig(temperature=0.7, max_tokens=2, seed=3)
    long = SamplingConfig(temperature=0.7, max_tokens=40, seed=5)
    requests = [Request(0, [3, 4], short), Request(100, [5, 6], long)]
    continuous = serve_log(engine, requests, short_chain(short))
    waves = serve_log(Waves(engine), requests, short_chain(short))
    keys = lambda log: [(call, request.key) for call, request, _ in log]  # noqa: E731
    assert keys(continuous) == [(1, 0), (2, 1), (3, 2), (4, 3), (5, 100)]
    assert keys(waves) == [(1, 0), (1, 100), (2, 1), (3, 2), (4, 3)]
    for log in (continuous, waves):
        for _, request, (rollout,) in log:
            alone, = engine.generate([request.prompt_token_ids], request.sampling)
            assert (rollout.response_token_ids, rollout.response_logprobs) == \
                   (alone.response_token_ids, alone.response_logprobs)


def test_a_raising_respond_cancels_what_still_runs(qwen2):
    """respond raises while a long request runs: its task is cancelled, which aborts it in the scheduler; the
    engine then generates as before."""
    from portable_rl.engines.base import Request

    engine = make(qwen2, seed=0)
    sampling = SamplingConfig(temperature=1.0, max_tokens=8, n=2, seed=31)
    reference = engine.generate([[3], [9, 4]], sampling)

    def respond(finished):
        raise RuntimeError("environment bug")

    requests = [Request(0, [3], SamplingConfig(max_tokens=2, n=1, seed=1)),
                Request(1, [4], SamplingConfig(max_tokens=12, n=3, seed=2))]
    with pytest.raises(RuntimeError, match="environment bug"):
        engine.serve(requests, respond)
    fake = engine._engine
    assert fake.running == 0 and fake.aborted == 3  # the long request's three samples, cancelled mid-decode
    assert [(r.response_token_ids, r.response_logprobs) for r in engine.generate([[3], [9, 4]], sampling)] == \
           [(r.response_token_ids, r.response_logprobs) for r in reference]


def test_multi_turn_trajectories_served_equal_those_in_waves(qwen2):
    """The multi-turn driver on SGLang: served continuously, the trajectories of waves (each turn one generate
    call), the observations masked."""
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.config import EnvironmentConfig
    from portable_rl.rl.turns import run_trajectories
    from portable_rl.tasks import Example

    engine = make(qwen2, seed=0)
    codec = TextCodec(qwen2)
    examples = [Example("abc", "2"), Example("hello", "3"), Example("xyz", "1")]
    sampling = SamplingConfig(temperature=1.0, max_tokens=6, n=2, seed=3)
    config = EnvironmentConfig(max_turns=3, max_total_tokens=64)
    served, _ = run_trajectories(engine, codec, examples, Countdown, sampling, config)
    waved, _ = run_trajectories(Waves(engine), codec, examples, Countdown, sampling, config)
    assert [(t.rollout, t.finish, t.num_turns) for t in served] == \
           [(t.rollout, t.finish, t.num_turns) for t in waved]
    assert [t.num_turns for t in served] == [2, 2, 3, 3, 1, 1]
    assert any(m == 0 for t in served for m in t.rollout.response_mask)
    assert any(c[0] == "async_generate" for c in engine._engine.calls)


# ------------------------------------------------------------------------------------- weights
def test_update_is_one_bucketed_session_then_cache_flush(qwen2, weights):
    engine = make(qwen2, bucket_bytes=16 << 10)
    fake = engine._engine
    sampling = SamplingConfig(temperature=1.0, max_tokens=6, seed=0)
    before = engine.generate([[5]], sampling)[0]
    new = {n: (t.float() * 2.0).to(t.dtype) if n == "model.embed_tokens.weight" else t for n, t in weights.items()}
    fake.calls.clear()
    engine.update_weights(iter(new.items()))
    calls = names_of(fake.calls)
    assert calls[0] == "begin_weight_update" and calls[-2:] == ["end_weight_update", "flush_cache"]
    updates = [c[1] for c in fake.calls if c[0] == "update_weights_from_tensor"]
    assert len(updates) > 1 and all(u["flush_cache"] is False for u in updates)
    # a bucket exceeds the limit only when it is one fused group (q/k/v or gate/up) or a single tensor
    assert all(u["nbytes"] <= 16 << 10 or len({fused_group(n) for n in u["names"]}) == 1 for u in updates)
    assert sorted(n for u in updates for n in u["names"]) == sorted(new)
    after = engine.generate([[5]], sampling)[0]
    assert after.response_logprobs != before.response_logprobs  # the pushed weights are served


@pytest.mark.parametrize("fp8_mode", [None, "flash_rl"])
def test_bad_pushes_are_rejected_before_the_engine_sees_them(qwen2, weights, fp8_mode):
    """Before the check these reached the engine, where a failed load kills the process tree."""
    engine = make(qwen2, fp8_mode=fp8_mode)
    fake = engine._engine
    good = list(weights.items())
    bad = {"missing": good[1:],
           "unknown": good + [("model.layers.9.mlp.up_proj.weight", torch.zeros(256, 128))],
           "shape": [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in good]}
    for problem, pairs in bad.items():
        with pytest.raises(WeightUpdateError, match=problem):
            engine.update_weights(pairs)
    assert "begin_weight_update" not in names_of(fake.calls)  # nothing reached the engine
    engine.update_weights(good)
    assert names_of(fake.calls)[-1] == "flush_cache"


def test_flash_rl_buckets_never_split_a_fused_group(qwen2, weights):
    """Per-tensor FP8 flash_rl refuses a partial q/k/v or gate/up update (the engine dies); tiny buckets used to
    split them."""
    engine = make(qwen2, fp8_mode="flash_rl", bucket_bytes=1)  # every bucket as small as it can be
    engine.update_weights(weights.items())
    updates = [c[1]["names"] for c in engine._engine.calls if c[0] == "update_weights_from_tensor"]
    for names in updates:
        for group in {fused_group(n) for n in names}:
            assert {n for n in weights if fused_group(n) == group} <= set(names), group
    assert any(len(names) == 3 for names in updates)  # q, k, v together
    assert sorted(n for names in updates for n in names) == sorted(weights)


def test_push_sends_torch_owned_contiguous_copies(qwen2, weights):
    engine = make(qwen2)
    pushed = [(n, t.T.contiguous().T if t.dim() == 2 else t) for n, t in weights.items()]  # transposed views
    assert not all(t.is_contiguous() for _, t in pushed)
    engine.update_weights(pushed)
    sent = [p for c in engine._engine.calls if c[0] == "update_weights_from_tensor" for p in c[1]["tensors"]]
    by_name = dict(pushed)
    for name, tensor in sent:
        assert tensor.is_contiguous() and torch.equal(tensor, by_name[name])
        assert tensor.untyped_storage().data_ptr() != by_name[name].untyped_storage().data_ptr()


def test_failed_reply_raises_and_closes_the_session(qwen2, weights):
    engine = make(qwen2)
    fake = engine._engine
    fake.begin_weight_update = lambda selector="all": (True, "Success")  # a session that did not open
    with pytest.raises(SGLangWeightUpdateError, match="must run between begin_weight_update"):
        engine.update_weights(weights.items())
    assert names_of(fake.calls)[-1] == "end_weight_update"
    assert fake.session is None  # the next sync can open a new session
    del fake.begin_weight_update
    fake.flush_cache = lambda: type("Out", (), {"success": False, "message": "requests still running"})()
    with pytest.raises(SGLangWeightUpdateError, match="flush_cache failed: requests still running"):
        engine.update_weights(weights.items())


def test_flash_rl_mode(qwen2, weights, tmp_path):
    engine = make(qwen2, fp8_mode="flash_rl")
    assert engine._engine.kwargs["quantization"] == "fp8" and engine._engine.kwargs["load_format"] == "flash_rl"
    unprefixed = [(n.removeprefix("model."), t) for n, t in weights.items()]
    with pytest.raises(ValueError, match="model.'-prefixed"):
        engine.update_weights(unprefixed)
    assert "begin_weight_update" not in names_of(engine._engine.calls)  # rejected before any engine call
    llama = make_tiny_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        make(llama, fp8_mode="flash_rl")


# ------------------------------------------------------------------------------------- blockwise FP8
def test_blockwise_from_a_bf16_checkpoint_writes_the_fp8_start_once(qwen2, weights, tmp_path):
    """The seed recipe starts from bf16: before, the adapter raised at start and nothing wrote the FP8 copy."""
    with pytest.raises(ValueError, match="SGLANG_FP8_CHECKPOINT_ROOT"):
        make(qwen2, fp8_mode="blockwise")
    root = tmp_path / "run"
    engine = make(qwen2, fp8_mode="blockwise", fp8_checkpoint_root=str(root))
    start = engine._engine.kwargs["model_path"]
    assert engine.model_path == start and os.path.dirname(start) == str(root) and engine.source_model_path == qwen2
    assert load_file(f"{start}/model.safetensors")["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert os.listdir(root) == [os.path.basename(start)]  # no temporary directory left behind
    stamp = os.stat(os.path.join(start, SOURCE_MARKER)).st_mtime_ns
    again = make(qwen2, fp8_mode="blockwise", fp8_checkpoint_root=str(root))  # a resumed run
    assert again.model_path == start and os.stat(os.path.join(start, SOURCE_MARKER)).st_mtime_ns == stamp

    engine.update_weights(weights.items())  # the learner pushes bf16; the adapter sends FP8 + scales
    fake = engine._engine
    pushed = [n for c in fake.calls if c[0] == "update_weights_from_tensor" for n in c[1]["names"]]
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in pushed
    assert fake.weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert fake.weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert len(pushed) == len(weights) + 7 * 2  # 7 projections per layer, 2 layers, one scale each


def test_blockwise_from_an_fp8_checkpoint_starts_there(qwen2, tmp_path):
    fp8_path = write_blockwise_fp8_checkpoint(qwen2, str(tmp_path / "fp8"))
    engine = make(fp8_path, fp8_mode="blockwise")
    assert engine._engine.kwargs["model_path"] == fp8_path
    # What SGLang says about a blockwise config over bf16 weights (the reason the adapter converts first).
    bf16_with_block_config = tmp_path / "bf16_block_config"
    shutil.copytree(qwen2, bf16_with_block_config)
    config = json.loads((bf16_with_block_config / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (bf16_with_block_config / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="fp8-serialized"):
        FakeSGLangEngine(model_path=str(bf16_with_block_config))


# ------------------------------------------------------------------------------------- lifecycle
def test_sleep_needs_sleep_mode_and_then_keeps_the_weights(qwen2):
    """Before, sleep() called release_memory_occupation on an engine without the memory saver: it freed nothing."""
    plain = make(qwen2)
    for method in (plain.sleep, plain.wake_up):
        with pytest.raises(RuntimeError, match="sleep_mode=True"):
            method()
    assert "release_memory_occupation" not in names_of(plain._engine.calls)
    engine = make(qwen2, sleep_mode=True)
    fake = engine._engine
    assert fake.kwargs["enable_memory_saver"] is True and fake.kwargs["enable_weights_cpu_backup"] is True
    sampling = SamplingConfig(temperature=1.0, max_tokens=6, seed=3)
    before = engine.generate([[5]], sampling)
    engine.sleep()
    assert fake.memory_freed and fake.released == {"kv_cache", "weights", "cuda_graph"}
    engine.wake_up()
    assert not fake.memory_freed and engine.generate([[5]], sampling) == before  # weights survived


def test_lifecycle_and_logprob_env_guard(qwen2, monkeypatch):
    with make(qwen2) as engine:
        fake = engine._engine
    assert names_of(fake.calls) == ["shutdown"]
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1]], SamplingConfig())
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        make(qwen2)
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB")
    with pytest.raises(ValueError, match="fp8_mode"):
        SGLangEngine(model_path=qwen2, fp8_mode="fp4", engine_factory=FakeSGLangEngine)
    with pytest.raises(TypeError, match="tp_szie"):  # a typo in ENGINE_KWARGS fails like the real ServerArgs
        make(qwen2, engine_init_kwargs={"tp_szie": 2})


def test_int8_w8a8_is_refused_before_an_engine_starts(qwen2, tmp_path):
    """0.5.23's int8 linear methods cannot restore their transposed weights for an in-place reload (module doc)."""
    started = []
    with pytest.raises(ConfigError, match="^quantization='int8_per_channel': SGLang 0.5.23 cannot reload INT8 "
                                          "W8A8 weights in place .*use the 'vllm' engine") as err:
        SGLangEngine(model_path=qwen2, engine_init_kwargs={"quantization": "int8_per_channel"},
                     engine_factory=lambda **kw: started.append(kw) or FakeSGLangEngine(**kw))
    assert "\n" not in str(err.value) and started == []
    with pytest.raises(ConfigError, match="^quantization='w8a8_int8': SGLang 0.5.23 cannot reload"):
        SGLangEngine(model_path=qwen2, engine_init_kwargs={"quantization": "w8a8_int8"},
                     engine_factory=lambda **kw: started.append(kw) or FakeSGLangEngine(**kw))
    from portable_rl.engines.quantize import write_int8_checkpoint

    int8 = write_int8_checkpoint(qwen2, str(tmp_path / "int8"))
    with pytest.raises(ConfigError, match=r"\(an INT8 W8A8 checkpoint\): SGLang 0.5.23 cannot reload"):
        SGLangEngine(model_path=int8, engine_factory=lambda **kw: started.append(kw) or FakeSGLangEngine(**kw))
    assert started == []


def test_seed_recipe_engine_starts_from_a_bf16_checkpoint(qwen2, tmp_path):
    """The recipe's command as written: its ENGINE, given the bf16 MODEL_PATH, starts (FP8 copy under RUN_DIR)."""
    import gin

    from portable_rl import gin_utils
    from portable_rl.train import register_gin

    gin.clear_config()
    try:
        register_gin()
        gin_utils.parse_gin(["gin/recipes/qwen3_8b_base_dapo_math_sglang_fp8.gin"],
                            [f"RUN_DIR = '{tmp_path}/run'", f"MODEL_PATH = '{qwen2}'",
                             "DATA_PATH = 'unused.jsonl'", "EVAL_DATA_PATH = 'unused.jsonl'"])
        factory = gin_utils.query_value("train.engine_factory")  # %ENGINE → @sglang/engines.create_engine
        factory = getattr(factory, "scoped_configurable_fn", factory)
        engine = factory(model_path=qwen2, engine_factory=FakeSGLangEngine)  # train.py's call + the fake
    finally:
        gin.clear_config()
    assert engine.fp8_mode == "blockwise" and engine.quantization == "fp8_blockwise"
    assert os.path.dirname(engine.model_path) == f"{tmp_path}/run"
    assert engine._engine.kwargs["context_length"] == 22528 and engine._engine.kwargs["enable_deterministic_inference"]
