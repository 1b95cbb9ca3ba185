"""Canaries for the vLLM internals portable_rl relies on (engines/vllm_internals.py), without starting an engine.

One test per internal reads the installed vLLM's source and fails in one line naming the vLLM version, the
symbol and our file to change. `VLLM_SRC=<wheel or unpacked dir>` checks another vLLM's source too (a GPU
wheel is never imported: docs/engines.md, "Upgrading vLLM / SGLang"). The behaviour behind each internal is
checked by the slow engine tests named in its `relies_on`.
"""

import importlib.util
import inspect
import logging
import os
import shutil

import pytest

from portable_rl.engines import vllm_internals
from portable_rl.engines.canary import PackageSource, Problem
from portable_rl.engines.vllm_adapter import llm_kwargs
from portable_rl.engines.vllm_internals import INTERNALS, check_internals

pytestmark = pytest.mark.vllm
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


@needs_vllm
@pytest.mark.parametrize("internal", INTERNALS, ids=lambda i: i.name)
def test_installed_vllm_has_the_internal(internal):
    src = PackageSource("vllm")
    what = internal.check(src)
    if what is not None:
        pytest.fail(str(Problem(internal, "vLLM", src.version(), what)), pytrace=False)


@pytest.mark.skipif(not os.environ.get("VLLM_SRC"), reason="set VLLM_SRC to a vLLM wheel or unpacked source")
def test_vllm_source_named_by_VLLM_SRC_has_every_internal():
    problems = check_internals(os.environ["VLLM_SRC"])
    assert not problems, "\n".join(map(str, problems))


@needs_vllm
def test_a_broken_internal_fails_in_one_line_naming_version_symbol_and_our_file(tmp_path, monkeypatch):
    """A copy of exactly the vLLM files the canaries read passes; rewording one log message breaks exactly the
    internal that depends on it."""
    installed = PackageSource("vllm")
    read = []
    real_read = PackageSource.read

    def recording_read(self, module):
        text = real_read(self, module)
        if text is not None:
            read.append(module)
        return text

    with monkeypatch.context() as patch:
        patch.setattr(PackageSource, "read", recording_read)
        assert check_internals() == []
    for module in set(read) | {"vllm._version"}:
        origin = importlib.util.find_spec(module).origin
        dest = tmp_path / os.path.relpath(origin, installed.where)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(origin, dest)
    assert check_internals(str(tmp_path)) == []
    layerwise = tmp_path / "vllm/model_executor/model_loader/reload/layerwise.py"
    layerwise.write_text(layerwise.read_text().replace('"%s: Failed to load weights"', '"%s: no weights loaded"'))
    (problem,) = check_internals(str(tmp_path))
    line = str(problem)
    assert "\n" not in line and line.startswith(f"vLLM {installed.version()}: ")
    assert "vllm.model_executor.model_loader.reload.layerwise.logger" in line
    assert "update portable_rl/engines/vllm_internals.py:ExpectedReloadWarnings" in line
    assert len(check_internals(str(tmp_path / "nothing_here"))) == len(INTERNALS)  # each one says so


@needs_vllm
def test_imported_vllm_agrees_with_the_source_canaries():
    """What the source checks read, seen through the imported modules (no engine is started)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fp8 = vllm_internals.unpatched(ChannelWiseTorchFP8ScaledMMLinearKernel, "apply_scaled_mm")
    replacement = vllm_internals.cpu_fp8_gemm(fp8)
    kinds = [[(p.name, p.kind) for p in inspect.signature(f).parameters.values()] for f in (replacement, fp8)]
    assert kinds[0] == kinds[1]
    int8 = vllm_internals.unpatched(CPUInt8ScaledMMLinearKernel, "process_weights_for_onednn")
    assert list(inspect.signature(int8).parameters) == ["self", "layer"]
    assert "reload_weights" not in vars(CPUModelRunner) and issubclass(CPUModelRunner, GPUModelRunner)
    assert layerwise.logger.name == vllm_internals._LAYERWISE
    assert set(vllm_internals.LLM_KWARGS) <= {f.name for f in dataclasses.fields(EngineArgs)}
    from vllm.config import ParallelConfig  # one worker: the same-process executor; two: a process each

    assert ParallelConfig().distributed_executor_backend in vllm_internals.SAME_PROCESS_EXECUTORS
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend not in vllm_internals.SAME_PROCESS_EXECUTORS
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    assert list(inspect.signature(BaseRouter.set_capture_fn).parameters) == ["self", "capture_fn"]
    assert isinstance(MoERunner.layer_id, property)
    assert list(inspect.signature(GPUModelRunner._model_forward).parameters)[:3] == ["self", "input_ids", "positions"]


def test_llm_kwargs_passes_only_the_names_the_canary_checks():
    for on_cpu in (True, False):
        for options in (dict(), dict(enforce_eager=False, max_model_len=64, gpu_memory_utilization=0.5),
                        dict(engine_init_kwargs={"quantization": "int8_per_channel"}, dtype="float32")):
            if on_cpu or "engine_init_kwargs" not in options:
                assert set(llm_kwargs("/ckpt", on_cpu=on_cpu, **options)) <= set(vllm_internals.LLM_KWARGS)
    assert set(llm_kwargs("/ckpt", on_cpu=False, enable_sleep_mode=True)) <= set(vllm_internals.LLM_KWARGS)


def test_only_expected_reload_warnings_are_dropped():
    def record(layer):
        return logging.LogRecord(vllm_internals._LAYERWISE, logging.WARNING, __file__, 1,
                                 "%s: Failed to load weights", (layer,), None)

    keep = vllm_internals.ExpectedReloadWarnings().filter
    assert not keep(record("RotaryEmbedding")) and not keep(record("ParallelLMHead"))
    assert keep(record("QKVParallelLinear"))  # a projection that got no weights must stay visible
    assert keep(logging.LogRecord("x", logging.WARNING, __file__, 1, "something else", (), None))
