"""Engine interface pieces that need no engine: SamplingConfig, Rollout, weight flattening, the probe."""

import math

import pytest
import torch

from portable_rl.engines import EngineAdapter, Rollout, SamplingConfig
from portable_rl.engines.base import check_prompts, flatten_named_tensors
from portable_rl.engines.probe import ProbeMismatchError, ProbeResult, check_probe, compare_logprobs, run_probe


def test_sampling_rejects_truncation_unless_allowed():
    with pytest.raises(ValueError, match="learner"):
        SamplingConfig(top_p=0.9)
    with pytest.raises(ValueError, match="learner"):
        SamplingConfig(top_k=50)
    assert SamplingConfig(top_k=50, allow_truncated_sampling=True).top_k == 50
    for bad in (dict(temperature=-0.1), dict(max_tokens=0), dict(n=0)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)
    assert SamplingConfig(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # hashable, frozen


def test_rollout_validates():
    with pytest.raises(ValueError, match="logprobs"):
        Rollout(0, [1], [2, 3], [-0.1], "stop")
    with pytest.raises(ValueError, match="finish_reason"):
        Rollout(0, [1], [2], [-0.1], "abort")


def test_flatten_pairs_and_buckets():
    a, b, c = (("x", torch.zeros(1)), ("y", torch.ones(2)), ("z", torch.ones(3)))
    assert [n for n, _ in flatten_named_tensors([a, b, c])] == ["x", "y", "z"]
    assert [n for n, _ in flatten_named_tensors(iter([[a, b], [c]]))] == ["x", "y", "z"]
    with pytest.raises(TypeError):
        list(flatten_named_tensors([[torch.zeros(1)]]))


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
