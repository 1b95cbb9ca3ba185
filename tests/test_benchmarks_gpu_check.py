"""The GPU check and the colocation check rehearsed on CPU (`bash benchmarks/gpu_check.sh --dry-run`,
`python -m benchmarks.colocation_check --dry-run`), as a user runs them from the repository root, and the check's
refusal without a GPU. The dry runs compile every learner arm in processes of their own (minutes on a small
CPU), hence `slow`. The other benchmark scripts: tests/test_benchmarks_smoke.py.

The dry runs' processes skip LLVM's optimizations (`JAX_DISABLE_MOST_OPTIMIZATIONS`, as conftest.py does in
process and the planner's compile process does): a dry run's tiny programs are compiled once and run a few
times, so compiling dominates; buffer assignment (every predicted and measured byte) and the arithmetic are the
same, only the machine code is less optimized (~20 % less CPU time for the GPU check's dry run).
"""

import json
import os
import subprocess
import sys

import pytest
from processes import ROOT
from processes import run_from_root as run


@pytest.mark.slow
def test_gpu_check_dry_run_writes_results(tmp_path):
    """The prepared GPU run, rehearsed on CPU: every learner arm, the push and learner_memory's CPU prediction
    run through the same code the GPU runs, and the numbers hang together."""
    from benchmarks.gpu_check import ARMS

    out = run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--reps", "2", "--out", str(tmp_path)],
              timeout=900, PYTHON=sys.executable, JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    assert "all checks ok" in out
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["ok"] and result["env"]["dry_run"] and result["failed"] == []
    assert result["peak_tflops"] == 989.0
    # the cuDNN path's check ran (XLA's implementation on CPU) and agreed with the blockwise kernel
    attention = result["env"]["cudnn_attention"]
    assert attention["ok"] and attention["implementation"] == "xla"
    assert set(attention["max_rel_diff"]) == {"out", "dq", "dk", "dv"} and max(attention["max_rel_diff"].values()) > 0
    assert set(result["arms"]) == {a.name for a in ARMS}
    for name, arm in result["arms"].items():
        assert arm["ok"] and "skipped" not in arm, (name, arm)
        assert arm["mfu"] == pytest.approx(arm["model_flops"] / arm["update_s_median"] / 989e12)
        assert arm["mfu_full_attention"] > arm["mfu"]              # the causal half of the attention square
        assert arm["tokens"] == arm["arm"]["sequences"] * 64 and arm["padding_fraction"] == 0.0
        assert arm["micro_batches"] == arm["tokens"] // 256         # 8192 / 32 tokens per micro-batch
        # the update reused the prediction's compilations: its first call is far below their compile time
        assert arm["first_update_s"] < arm["compile_s"] / 2, (name, arm["first_update_s"], arm["compile_s"])
        assert arm["predicted_peak_bytes"] > arm["predicted"]["params_bytes"] + arm["predicted"]["optimizer_bytes"]
    # the 7B arm sized itself from learner_memory's prediction (the tiny stand-in fits at both of its layers)
    fit = result["arms"]["7b_stack_16k_packed"]["fit"]
    assert fit["layers"] == fit["max_layers"] == 2
    assert fit["predicted_peak_2_layers_bytes"] > fit["predicted_peak_1_layer_bytes"]
    # learner_memory's CPU prediction of each 1B arm agrees with XLA's compile of the learner's own functions
    # (the same backend in a dry run) to within 1 %
    for name, p in result["cpu_prediction"].items():
        assert p["peak_bytes"] == pytest.approx(result["arms"][name]["predicted_peak_bytes"], rel=0.01), name
    # arms of one model and batch computed the same first update
    (group,) = result["same_work"].values()
    assert group["ok"] and len(group["grad_norms"]) == 4
    push = result["push"]
    assert push["ok"] and push["bf16_push"]["zero_copy"] == push["bf16_push"]["tensors"] > 10
    int8 = push["int8"]
    assert int8["bit_equal_to_torch"] and int8["int8_tensors"] == int8["projections"] == 2 * 7
    assert int8["zero_copy"] == int8["tensors"] == 27 + 14                 # every int8 weight and its scale
    assert int8["quantize_GB_per_s"] > 0 and int8["push_bf16_GB_per_s"] > 0
    fp8 = push["fp8_blockwise"]
    assert fp8["projections"] == 2 * 7 and fp8["roundtrip_max_abs_err"] <= fp8["roundtrip_bound"]


@pytest.mark.slow
def test_colocation_check_dry_run(tmp_path):
    out = run([sys.executable, "-m", "benchmarks.colocation_check", "--dry-run", "--out", str(tmp_path)],
              timeout=600, JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    colocation = json.loads((tmp_path / "colocation_check.json").read_text())
    assert colocation["ok"] and len(colocation["torch_holder"]["steps"]) == 2 and "vllm" not in colocation, out
    assert colocation["learner_xla_env"] == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                                             "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
    assert 0 < colocation["predicted"]["gpu_memory_utilization"] < 1
    assert colocation["plan_line"].startswith("[memory] time-shared")


def test_gpu_check_without_gpu_fails_fast_with_a_clear_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2
    assert "JAX sees no GPU" in proc.stderr and "--dry-run" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()
