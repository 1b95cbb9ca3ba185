"""The GPU check's arithmetic (benchmarks/gpu_check.py): FLOPs per update, the peak of a named GPU, the layer count
that fits, and the micro-batch layout each arm asks of the learner. The script itself is rehearsed end to end on
CPU by tests/test_benchmarks_gpu_check.py::test_gpu_check_dry_run_writes_results."""

import pytest

from benchmarks import gpu_check
from portable_rl.learner_jax.config import ModelConfig


def test_train_flops_count_the_causal_half_of_each_sequence_square():
    config = ModelConfig.from_hf_dict(gpu_check.MODEL_TINY)   # 2 layers, 4 heads of 32
    n = 1000
    causal, full = gpu_check.train_flops(config, n, [64, 32])
    matmul = 6 * n * 96
    attention_full = 12 * 2 * 4 * 32 * (64 ** 2 + 32 ** 2)
    assert full == matmul + attention_full
    assert causal == matmul + attention_full / 2
    # packing two sequences into one row costs no attention between them: the same as two rows
    assert gpu_check.train_flops(config, n, [48, 48])[0] < gpu_check.train_flops(config, n, [96])[0]


@pytest.mark.parametrize("name, tflops", [("NVIDIA H200", 989), ("NVIDIA H100 80GB HBM3", 989),
                                          ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835)])
def test_peak_flops_of_named_gpus(name, tflops):
    peak, source = gpu_check.peak_flops(name, None)
    assert peak == tflops * 1e12 and "datasheet" in source


def test_unknown_gpu_needs_peak_tflops():
    assert gpu_check.peak_flops("NVIDIA A100-SXM4-80GB", None) == (None, "unknown GPU 'NVIDIA A100-SXM4-80GB': "
                                                                   "pass --peak_tflops")
    assert gpu_check.peak_flops("NVIDIA A100-SXM4-80GB", 312.0) == (312e12, "--peak_tflops")


def test_layers_that_fit_extrapolate_the_two_predictions():
    GB = 1e9
    # fixed 20 GB + 4 GB a layer: predictions 24 and 28 GB at 1 and 2 layers
    assert gpu_check.layers_that_fit(60 * GB, 24 * GB, 28 * GB, max_layers=28) == 10
    assert gpu_check.layers_that_fit(200 * GB, 24 * GB, 28 * GB, max_layers=28) == 28
    assert gpu_check.layers_that_fit(22 * GB, 24 * GB, 28 * GB, max_layers=28) == 0


@pytest.mark.parametrize("arm", gpu_check.ARMS, ids=lambda a: a.name)
def test_every_arm_lays_out_whole_micro_batches(arm):
    for dry_run in (False, True):
        rows, row_tokens, micro_batches = gpu_check.micro_batch_shape(arm, dry_run)
        seq = gpu_check.SEQ_TOKENS // (gpu_check.DRY_RUN_SCALE if dry_run else 1)
        assert rows * row_tokens * micro_batches == arm.sequences * seq
        assert row_tokens % seq == 0   # a sequence is never split across rows
        memory = gpu_check.memory_config(arm, dry_run)
        assert memory.max_tokens_per_micro_batch == rows * row_tokens
        if dry_run:
            assert memory.attention_impl in ("blockwise", "dense")  # no cuDNN on CPU
