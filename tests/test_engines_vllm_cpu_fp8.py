"""The CPU fp8 GEMM fast path computes exactly vLLM's per-channel formula C = s_x s_w (X W) + b."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")


def test_rowwise_scaled_mm_matches_vllm_fallback():
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel as K

    from portable_rl.engines import vllm_cpu_fp8

    original = getattr(K, "_portable_rl_original_apply_scaled_mm", K.apply_scaled_mm)
    g = torch.Generator().manual_seed(0)
    m_pad, m, k, n = 8, 5, 64, 96
    a = torch.randn(m_pad, k, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn).t()       # [K, N] column-major, as vLLM
    a_scale = torch.rand(m_pad, 1, generator=g) + 0.5                    # per token
    w_scale = torch.rand(n, 1, generator=g) + 0.5                        # per output channel
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    kw = dict(A=a, B=w, out_dtype=torch.bfloat16, As=a_scale, Bs=w_scale, bias=bias, output_shape=[m, n])
    ref = original(None, **kw)
    fast = vllm_cpu_fp8._rowwise_apply_scaled_mm(None, **kw)
    assert fast.shape == ref.shape == (m, n) and fast.dtype == torch.bfloat16
    # Exact formula, computed by hand in fp32 from the fp8 operands:
    manual = (a.float() @ w.float())[:m] * a_scale[:m] * w_scale.t() + bias.float()
    torch.testing.assert_close(fast.float(), manual, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fast, ref, rtol=1e-2, atol=1e-2)
    assert vllm_cpu_fp8.apply() and vllm_cpu_fp8.apply()  # idempotent
