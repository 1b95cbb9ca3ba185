"""The CPU fp8 GEMM fast path computes exactly vLLM's per-channel formula C = s_x s_w (X W) + b, from a cache
of dequantized weights that a weight reload empties."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")


def test_rowwise_scaled_mm_matches_vllm_fallback():
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel as K

    from portable_rl.engines import vllm_cpu_fp8, vllm_internals

    original = vllm_internals.unpatched(K, "apply_scaled_mm")
    g = torch.Generator().manual_seed(0)
    m_pad, m, k, n = 8, 5, 64, 96
    a = torch.randn(m_pad, k, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn).t()       # [K, N] column-major, as vLLM
    a_scale = torch.rand(m_pad, 1, generator=g) + 0.5                    # per token
    w_scale = torch.rand(n, 1, generator=g) + 0.5                        # per output channel
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    kw = dict(A=a, B=w, out_dtype=torch.bfloat16, As=a_scale, Bs=w_scale, bias=bias, output_shape=[m, n])
    ref = original(None, **kw)
    fast = vllm_cpu_fp8.dense_scaled_mm(**kw)
    assert fast.shape == ref.shape == (m, n) and fast.dtype == torch.bfloat16
    # Exact formula, computed by hand in fp32 from the fp8 operands:
    manual = (a.float() @ w.float())[:m] * a_scale[:m] * w_scale.t() + bias.float()
    torch.testing.assert_close(fast.float(), manual, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fast, ref, rtol=1e-2, atol=1e-2)
    vllm_internals.install_cpu_patches()
    vllm_internals.install_cpu_patches()  # idempotent: patched once, CPU tensors take the dense path
    assert vllm_internals.unpatched(K, "apply_scaled_mm") is original
    torch.testing.assert_close(K.apply_scaled_mm(None, **kw), fast, rtol=0, atol=0)


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("bf16_gemm_is_fast", [True, False])
def test_dense_path_is_the_fp8_gemm_to_fp32_rounding(out_dtype, bf16_gemm_is_fast, monkeypatch):
    """float(X_fp8) @ float(W_fp8) is exact per product, so the result is the FP8 GEMM up to sum order
    (fp32 engine) or one extra bf16 rounding (bf16 engine), against a float64 reference."""
    from portable_rl.engines import vllm_cpu_fp8

    monkeypatch.setattr(vllm_cpu_fp8, "_BF16_GEMM_IS_FAST", bf16_gemm_is_fast)
    out_dtype = getattr(torch, out_dtype)
    g = torch.Generator().manual_seed(1)
    m, k, n = 16, 576, 192
    a = torch.randn(m, k, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn).t()
    a_scale, w_scale = torch.rand(m, 1, generator=g) + 0.5, torch.rand(n, 1, generator=g) + 0.5
    exact = (a.double() @ w.double()) * a_scale.double() * w_scale.double().t()
    fast = vllm_cpu_fp8.dense_scaled_mm(A=a, B=w, out_dtype=out_dtype, As=a_scale, Bs=w_scale, bias=None,
                                        output_shape=[m, n]).double()
    rel = ((fast - exact).abs().max() / exact.abs().max()).item()
    assert rel < (2 ** -7 if out_dtype == torch.bfloat16 else 1e-6), rel
    if out_dtype == torch.bfloat16:  # the weight cache holds the dtype the GEMM ran in
        assert getattr(w, vllm_cpu_fp8._CACHE_ATTR).dtype == (torch.bfloat16 if bf16_gemm_is_fast else torch.float32)


def test_cached_weight_is_dropped_by_a_reload():
    """vLLM's reload writes new values into the same tensor with `.data.copy_` (no version bump): the
    wrapped `reload_weights` must empty the cache, else the engine would keep serving the old weights."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from portable_rl.engines import vllm_cpu_fp8, vllm_internals

    vllm_internals.install_cpu_patches()
    assert GPUModelRunner.reload_weights is not vllm_internals.unpatched(GPUModelRunner, "reload_weights")
    g = torch.Generator().manual_seed(2)
    a = torch.randn(4, 32, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(8, 32, generator=g).to(torch.float8_e4m3fn).t()
    kw = dict(A=a, out_dtype=torch.float32, As=torch.ones(4, 1), Bs=torch.ones(8, 1), bias=None, output_shape=[4, 8])
    before = vllm_cpu_fp8.dense_scaled_mm(B=w, **kw)
    w.data.copy_((2 * w.float()).to(torch.float8_e4m3fn))  # what the layerwise reload does
    stale = vllm_cpu_fp8.dense_scaled_mm(B=w, **kw)
    torch.testing.assert_close(stale, before)  # the cache cannot see .data writes ...

    class Runner:  # the wrapped method, on a stand-in runner whose own reload is a no-op
        reload_weights = vllm_internals.invalidating_fp8_cache(lambda self, **kw: None)

    Runner().reload_weights(weights_iterator=iter(()))
    fresh = vllm_cpu_fp8.dense_scaled_mm(B=w, **kw)
    torch.testing.assert_close(fresh, 2 * before)  # ... so the reload wrapper drops it
