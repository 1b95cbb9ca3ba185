"""Engine interface pieces that need no engine: SamplingConfig, Rollout, the flat push contract, the probe."""

import dataclasses
import math

import pytest
import torch

from portable_rl.engines import EngineAdapter, Rollout, SamplingConfig
from portable_rl.engines import base
from portable_rl.engines.base import Request, check_prompts, named_tensor_pairs, prompt_seeds
from portable_rl.engines.probe import ProbeMismatchError, ProbeResult, check_probe, compare_logprobs, run_probe


def test_sampling_rejects_truncation_unless_allowed():
    with pytest.raises(ValueError, match="learner"):
        SamplingConfig(top_p=0.9)
    with pytest.raises(ValueError, match="learner"):
        SamplingConfig(top_k=50)
    assert SamplingConfig(top_k=50, allow_truncated_sampling=True).top_k == 50
    for bad in (dict(temperature=-0.1), dict(max_tokens=0), dict(n=0), dict(min_tokens=-1),
                dict(max_tokens=4, min_tokens=5)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)
    assert SamplingConfig(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # hashable, frozen


def test_rollout_validates():
    with pytest.raises(ValueError, match="logprobs"):
        Rollout(0, [1], [2, 3], [-0.1], "stop")
    with pytest.raises(ValueError, match="finish_reason"):
        Rollout(0, [1], [2], [-0.1], "abort")


def test_push_contract_is_one_flat_iterator_of_pairs():
    a, b, c = (("x", torch.zeros(1)), ("y", torch.ones(2)), ("z", torch.ones(3)))
    consumed = []

    def one_shot():  # the learner's export: a generator, read once
        for pair in (a, b, c):
            consumed.append(pair[0])
            yield pair

    pairs = named_tensor_pairs(one_shot())
    assert consumed == []  # lazy: nothing is read before the adapter iterates
    assert [n for n, _ in pairs] == ["x", "y", "z"] and consumed == ["x", "y", "z"]
    for bad in ([torch.zeros(1)], [(1, torch.zeros(1))], [[torch.zeros(1)]], [("x", torch.zeros(1), 3)]):
        with pytest.raises(TypeError, match="flat iterable of \\(hf_name, tensor\\) pairs"):
            list(named_tensor_pairs(bad))


def test_a_bucket_is_not_a_push():
    """One flat iterable of pairs: a list of pairs (the old bucketed push) is refused in one line."""
    a, b = ("x", torch.zeros(1)), ("y", torch.ones(2))
    with pytest.raises(TypeError, match="got an item of type list; e.g. engine.update_weights") as err:
        list(named_tensor_pairs([[a, b]]))
    assert "\n" not in str(err.value)
    assert [n for n, _ in named_tensor_pairs(iter([a, b]))] == ["x", "y"]


def test_check_prompts():
    assert check_prompts([(1, 2), [3]]) == [[1, 2], [3]]
    with pytest.raises(ValueError, match="batch"):
        check_prompts([1, 2, 3])
    with pytest.raises(ValueError):
        check_prompts([[]])
    with pytest.raises(TypeError):
        check_prompts("abc")


def test_compare_logprobs_statistics():
    engine = [[-1.0, -2.0], [-0.5]]
    learner = [[-1.1, -2.0], [-0.3]]
    r = compare_logprobs(engine, learner)
    d = [-0.1, 0.0, 0.2]
    assert r.n_tokens == 3
    assert r.max_abs_diff == pytest.approx(0.2)
    assert r.mean_abs_diff == pytest.approx(0.1)
    assert r.kl == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)
    assert compare_logprobs(engine, engine).kl == 0.0
    with pytest.raises(ValueError, match="sequence 1"):
        compare_logprobs(engine, [[-1.0, -2.0], []])
    assert math.isinf(compare_logprobs([[-1.0]], [[-math.inf]]).max_abs_diff)


def test_check_probe_raises_only_for_bf16():
    bad = ProbeResult(kl=0.3, max_abs_diff=2.0, mean_abs_diff=0.5, n_tokens=10)
    with pytest.raises(ProbeMismatchError, match="mapping"):
        check_probe(bad, threshold=0.1)
    assert check_probe(bad, threshold=0.1, quantized=True) is bad  # FP8: reported, not raised
    with pytest.raises(ProbeMismatchError):
        check_probe(ProbeResult(math.nan, math.nan, math.nan, 1), threshold=0.1)
    ok = ProbeResult(kl=1e-6, max_abs_diff=0.01, mean_abs_diff=0.001, n_tokens=10)
    assert check_probe(ok, threshold=0.1) is ok
    assert bad.as_metrics()["probe/max_abs_diff"] == 2.0


class _ConstantEngine(EngineAdapter):
    """Always emits token 1 with logprob -0.5 (stands in for an engine in the probe plumbing test)."""

    closed = False

    def generate(self, prompt_token_ids, sampling):
        self.sampling = sampling
        return [Rollout(i, list(p), [1] * sampling.max_tokens, [-0.5] * sampling.max_tokens, "length")
                for i, p in enumerate(prompt_token_ids)]

    def update_weights(self, named_tensors):
        pass

    def close(self):
        self.closed = True


def test_run_probe_plumbing_and_context_manager():
    with _ConstantEngine() as engine:
        seen = {}

        def reference(prompts, responses):
            seen["prompts"], seen["responses"] = prompts, responses
            return [[-0.5] * len(r) for r in responses]

        result = run_probe(engine, [[3, 4], [5]], reference, temperature=0.8, max_tokens=4, seed=9)
        assert result.max_abs_diff == 0.0 and result.n_tokens == 8
        assert seen["prompts"] == [[3, 4], [5]] and seen["responses"] == [[1] * 4] * 2
        assert engine.sampling == SamplingConfig(temperature=0.8, max_tokens=4, seed=9)
        with pytest.raises(ProbeMismatchError):
            run_probe(engine, [[3]], lambda p, r: [[-1.5] * len(x) for x in r], threshold=0.5)
    assert engine.closed


def test_seed_for_is_seed_plus_i_n_plus_j():
    sampling = SamplingConfig(n=4, seed=10)
    assert [sampling.seed_for(i, j) for i in range(2) for j in range(4)] == list(range(10, 18))
    assert sampling.seed_for(3) == 22 and SamplingConfig(n=4).seed_for(3, 1) is None


def test_bucketed_groups_keeps_fused_matrices_together():
    from portable_rl.engines.buckets import bucketed_groups, fused_group

    layer = "model.layers.3"
    assert fused_group(f"{layer}.self_attn.k_proj.weight") == f"{layer}.self_attn.qkv_proj.weight"
    assert fused_group(f"{layer}.self_attn.v_proj.bias") == f"{layer}.self_attn.qkv_proj.bias"
    assert fused_group(f"{layer}.mlp.up_proj.weight_scale_inv") == f"{layer}.mlp.gate_up_proj.weight_scale_inv"
    assert fused_group(f"{layer}.self_attn.o_proj.weight") == f"{layer}.self_attn.o_proj.weight"
    names = [f"{layer}.self_attn.{p}_proj.weight" for p in "qkvo"] + [f"{layer}.mlp.{p}_proj.weight"
                                                                      for p in ("gate", "up", "down")]
    pairs = [(n, torch.zeros(4)) for n in names]  # 16 bytes each
    buckets = [[n.split(".")[-2] for n, _ in b] for b in bucketed_groups(pairs, bucket_bytes=32)]
    # q/k/v (48 bytes) and gate/up (32 bytes) are never split, even past the limit
    assert buckets == [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
    with pytest.raises(ValueError, match="positive"):
        list(bucketed_groups(pairs, 0))


def test_blockwise_start_checkpoint_is_written_once_and_atomically(tmp_path, monkeypatch):
    import os

    from portable_rl.engines import quantize
    from portable_rl.engines.quantize import SOURCE_MARKER, ensure_blockwise_fp8_checkpoint
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "bf16", "qwen2")
    root = tmp_path / "run"
    first = ensure_blockwise_fp8_checkpoint(src, str(root))
    assert os.path.exists(os.path.join(first, SOURCE_MARKER)) and os.listdir(root) == [os.path.basename(first)]
    assert ensure_blockwise_fp8_checkpoint(src, str(root)) == first  # found: nothing written again

    # Two writers racing on a fresh root: the second to finish finds the first's copy in place and keeps it.
    race_root = tmp_path / "race"
    real_write = quantize.write_blockwise_fp8_checkpoint

    def write_while_another_writer_finishes(s, d, block):
        real_write(s, d, block)
        monkeypatch.setattr(quantize, "write_blockwise_fp8_checkpoint", real_write)
        other.append(ensure_blockwise_fp8_checkpoint(src, str(race_root)))  # completes and renames first

    other = []
    monkeypatch.setattr(quantize, "write_blockwise_fp8_checkpoint", write_while_another_writer_finishes)
    won = ensure_blockwise_fp8_checkpoint(src, str(race_root))
    assert other == [won] and os.listdir(race_root) == [os.path.basename(won)]  # no temporary left over
    os.remove(os.path.join(won, SOURCE_MARKER))  # a copy that is not complete is refused, not served
    with pytest.raises(FileExistsError, match="delete it"):
        ensure_blockwise_fp8_checkpoint(src, str(race_root))
    (tmp_path / "bf16" / "config.json").touch()  # the source changed: a new copy under a new name
    os.utime(tmp_path / "bf16" / "config.json", ns=(1, 1))
    assert ensure_blockwise_fp8_checkpoint(src, str(root)) != first


class _SeedEchoEngine(EngineAdapter):
    """Sample j of prompt i: max_tokens copies of its seed (prompt_seeds + j; unseeded: j), logprob -0.5; records
    its calls."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_token_ids, sampling, seeds=None):
        self.calls.append((len(prompt_token_ids), sampling.max_tokens, seeds))
        first = prompt_seeds(sampling, seeds, len(prompt_token_ids))
        return [Rollout(i, list(p), [(first[i] or 0) + j] * sampling.max_tokens, [-0.5] * sampling.max_tokens, "length")
                for i, p in enumerate(prompt_token_ids) for j in range(sampling.n)]

    def update_weights(self, named_tensors):
        pass

    def close(self):
        pass


def test_default_serve_runs_waves_with_each_requests_own_seed_and_length():
    """A wave is one generate call per distinct sampling (seeds and max_tokens aside): seeds that follow the batch
    rule are not passed, others are; each request's rollouts are cut back to its own max_tokens ("length"); the
    finished ones reach respond in request order, and what it returns is the next wave."""
    engine, answered = _SeedEchoEngine(), []
    two = SamplingConfig(n=2, seed=10, max_tokens=3)
    first = [Request(0, [5], two), Request(2, [6], dataclasses.replace(two, seed=12, max_tokens=5)),
             Request(4, [7], dataclasses.replace(two, n=1, seed=None))]

    def respond(finished):
        answered.append([(r.key, [x.response_token_ids for x in rollouts], [x.finish_reason for x in rollouts])
                         for r, rollouts in finished])
        if len(answered) > 1:
            return []
        return [Request(9, [8], SamplingConfig(n=1, seed=40, max_tokens=2)),
                Request(1, [8], SamplingConfig(n=1, seed=31, max_tokens=2))]

    engine.serve(first, respond)
    assert engine.calls == [(2, 5, None), (1, 3, None), (2, 2, [40, 31])]
    assert answered[0][0] == (0, [[10] * 3, [11] * 3], ["length", "length"])  # cut from 5 to its own 3
    assert answered[0][1] == (2, [[12] * 5, [13] * 5], ["length", "length"])
    assert answered[0][2][0] == 4 and len(answered[0][2][1][0]) == 3  # unseeded: its own call
    assert answered[1] == [(9, [[40] * 2], ["length"]), (1, [[31] * 2], ["length"])]
