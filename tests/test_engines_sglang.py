"""SGLang adapter contract tests against a recording fake of the sglang 0.5.23 `Engine` API.

sglang is not installed here (it needs CUDA); `scripts/gpu_check_sglang.py` runs the same adapter against
the real engine on a GPU box. The fake reproduces the 0.5.23 behaviour read in the wheel's source
(sglang/srt/managers/scheduler_components/weight_updater.py, model_loader/loader.py):
  - `update_weights_from_tensor` outside begin/end_weight_update → (False, "...must run between
    begin_weight_update() and end_weight_update()") and nothing is loaded;
  - load_format="flash_rl" rejects models other than Qwen2/Qwen3 at load, and non-`model.` names on reload;
  - generate(...) returns one dict per request with meta_info["output_token_logprobs"] = [(lp, id, None)]
    and meta_info["finish_reason"] = {"type": "stop" | "length", ...}.
Its "model" is a bigram on the tied embedding (logits = E[prev] · Eᵀ), so pushed weights visibly matter.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from portable_rl.convert.quantize import write_blockwise_fp8_checkpoint
from portable_rl.engines import SamplingConfig, create_engine
from portable_rl.engines.sglang_adapter import SGLangEngine, SGLangWeightUpdateError
from portable_rl.testing import make_tiny_checkpoint

OUTSIDE_SESSION = ("update_weights_from_tensor must run between begin_weight_update() and "
                   "end_weight_update()")


class FakeSGLangEngine:
    """Records every call; behaves like sglang 0.5.23's Engine for the calls the adapter makes."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls = []
        path = kwargs["model_path"]
        with open(f"{path}/config.json") as f:
            config = json.load(f)
        if kwargs.get("load_format") == "flash_rl" and config["architectures"][0] not in (
                "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            raise ValueError(f"FlashRL does not support {config['architectures'][0]}.load_weights")
        self.weights = load_file(f"{path}/model.safetensors")
        self.session = None

    def _logits(self, prev):
        embed = self.weights["model.embed_tokens.weight"].float()  # [V, D]
        return embed[prev] @ embed.T * 10.0  # [V]

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False, **kw):
        self.calls.append(("generate", dict(input_ids=input_ids, sampling_params=sampling_params,
                                            return_logprob=return_logprob)))
        outs = []
        for ids, p in zip(input_ids, sampling_params):
            gen = torch.Generator().manual_seed(p.get("sampling_seed", 0))
            prev, toks, lps, finish = ids[-1], [], [], {"type": "length", "length": p["max_new_tokens"]}
            for _ in range(p["max_new_tokens"]):
                logp = torch.log_softmax(self._logits(prev) / p["temperature"], -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                toks.append(tok)
                lps.append((float(logp[tok]), tok, None))
                prev = tok
                if tok in p.get("stop_token_ids", ()):
                    finish = {"type": "stop", "matched": tok}
                    break
            outs.append({"text": "", "output_ids": toks,
                         "meta_info": {"output_token_logprobs": lps, "finish_reason": finish}})
        return outs

    def begin_weight_update(self, selector="all"):
        self.calls.append(("begin_weight_update", selector))
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = {"loaded": False}
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights_from_tensor",
                           dict(names=[n for n, _ in named_tensors], flush_cache=flush_cache,
                                nbytes=sum(t.numel() * t.element_size() for _, t in named_tensors))))
        if self.session is None:
            return False, OUTSIDE_SESSION
        if self.kwargs.get("load_format") == "flash_rl":
            for name, _ in named_tensors:
                if name.startswith(("layers.", "embed_tokens.", "norm.")):
                    raise ValueError(f"FlashRL reload requires canonical checkpoint names: {name!r}")
        for name, tensor in named_tensors:
            self.weights[name] = tensor.clone()
        self.session["loaded"] = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end_weight_update", None))
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = None
        return True, "Success"

    def flush_cache(self):
        self.calls.append(("flush_cache", None))

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release_memory_occupation", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume_memory_occupation", tags))

    def shutdown(self):
        self.calls.append(("shutdown", None))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sgl") / "qwen2", "qwen2")


def make(path, **kw):
    return create_engine("sglang", model_path=path, engine_factory=FakeSGLangEngine, **kw)


def names_of(calls):
    return [c[0] for c in calls]


def test_fake_rejects_updates_outside_a_session(qwen2):
    fake = FakeSGLangEngine(model_path=qwen2)
    before = fake.weights["model.norm.weight"].clone()
    assert fake.update_weights_from_tensor([("model.norm.weight", before + 1)]) == (False, OUTSIDE_SESSION)
    assert torch.equal(fake.weights["model.norm.weight"], before)


def test_generate_request_and_rollouts(qwen2):
    engine = make(qwen2, seed=5)
    fake = engine._engine
    assert fake.kwargs == dict(model_path=qwen2, random_seed=5, dtype="bfloat16")
    sampling = SamplingConfig(temperature=0.6, max_tokens=5, n=2, seed=100, stop_token_ids=(7,))
    rollouts = engine.generate([[1, 2, 3], [4]], sampling)
    _, request = fake.calls[-1]
    assert request["return_logprob"] is True
    assert request["input_ids"] == [[1, 2, 3], [1, 2, 3], [4], [4]]  # n samples, prompt-major
    assert [p["sampling_seed"] for p in request["sampling_params"]] == [100, 101, 102, 103]
    assert all(p["temperature"] == 0.6 and p["max_new_tokens"] == 5 and p["top_p"] == 1.0 and p["top_k"] == -1
               and p["stop_token_ids"] == [7] for p in request["sampling_params"])
    assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1]
    embed = fake.weights["model.embed_tokens.weight"].float()
    for r in rollouts:  # the adapter returns the engine's sampled-token logprobs, position by position
        prev = [r.prompt_token_ids[-1]] + r.response_token_ids[:-1]
        expected = torch.log_softmax(embed[prev] @ embed.T * 10.0 / 0.6, -1)[range(len(prev)), r.response_token_ids]
        assert r.response_logprobs == pytest.approx(expected.tolist(), abs=1e-5)
        assert r.finish_reason == ("stop" if r.response_token_ids[-1] == 7 else "length")


def test_update_is_one_bucketed_session_then_cache_flush(qwen2):
    engine = make(qwen2, bucket_bytes=16 << 10)
    fake = engine._engine
    weights = load_file(f"{qwen2}/model.safetensors")
    sampling = SamplingConfig(temperature=1.0, max_tokens=6, seed=0)
    before = engine.generate([[5]], sampling)[0]
    new = {n: (t.float() * 2.0).to(t.dtype) if n == "model.embed_tokens.weight" else t for n, t in weights.items()}
    fake.calls.clear()
    engine.update_weights(iter(new.items()))
    calls = names_of(fake.calls)
    assert calls[0] == "begin_weight_update" and calls[-2:] == ["end_weight_update", "flush_cache"]
    updates = [c[1] for c in fake.calls if c[0] == "update_weights_from_tensor"]
    assert len(updates) > 1 and all(u["flush_cache"] is False for u in updates)
    # a bucket exceeds the limit only when it is a single large tensor
    assert all(u["nbytes"] <= 16 << 10 or len(u["names"]) == 1 for u in updates)
    assert sorted(n for u in updates for n in u["names"]) == sorted(new)
    after = engine.generate([[5]], sampling)[0]
    assert after.response_logprobs != before.response_logprobs  # the pushed weights are served


def test_failed_update_raises_and_closes_the_session(qwen2):
    engine = make(qwen2)
    fake = engine._engine
    fake.update_weights_from_tensor = lambda **kw: (False, "Failed to update parameter online: boom")
    with pytest.raises(SGLangWeightUpdateError, match="boom"):
        engine.update_weights([("model.norm.weight", torch.ones(128))])
    assert names_of(fake.calls) == ["begin_weight_update", "end_weight_update"]
    assert fake.session is None  # the next sync can open a new session


def test_flash_rl_mode(qwen2, tmp_path):
    engine = make(qwen2, fp8_mode="flash_rl")
    assert engine._engine.kwargs["quantization"] == "fp8" and engine._engine.kwargs["load_format"] == "flash_rl"
    with pytest.raises(ValueError, match="model.'-prefixed"):
        engine.update_weights([("layers.0.mlp.up_proj.weight", torch.zeros(256, 128))])
    assert "begin_weight_update" not in names_of(engine._engine.calls)  # rejected before any engine call
    engine.update_weights([("model.norm.weight", torch.ones(128, dtype=torch.bfloat16))])
    llama = make_tiny_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        make(llama, fp8_mode="flash_rl")


def test_blockwise_mode_pushes_fp8_weights_and_scales(qwen2, tmp_path):
    with pytest.raises(ValueError, match="write_blockwise_fp8_checkpoint"):
        make(qwen2, fp8_mode="blockwise")
    fp8_path = write_blockwise_fp8_checkpoint(qwen2, str(tmp_path / "fp8"))
    engine = make(fp8_path, fp8_mode="blockwise")
    weights = load_file(f"{qwen2}/model.safetensors")
    engine.update_weights(weights.items())
    fake = engine._engine
    pushed = [n for c in fake.calls if c[0] == "update_weights_from_tensor" for n in c[1]["names"]]
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in pushed
    assert fake.weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert fake.weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert len(pushed) == len(weights) + 7 * 2  # 7 projections per layer, 2 layers, one scale each


def test_lifecycle_and_logprob_env_guard(qwen2, monkeypatch):
    with make(qwen2) as engine:
        engine.sleep()
        engine.wake_up()
        fake = engine._engine
    assert names_of(fake.calls) == ["release_memory_occupation", "resume_memory_occupation", "shutdown"]
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1]], SamplingConfig())
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        make(qwen2)
    with pytest.raises(ValueError, match="fp8_mode"):
        SGLangEngine(model_path=qwen2, fp8_mode="fp4", engine_factory=FakeSGLangEngine)
