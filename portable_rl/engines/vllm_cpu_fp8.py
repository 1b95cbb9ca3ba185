"""Fast path for vLLM-CPU's per-channel FP8 GEMM (installed by vllm_internals.install_cpu_patches).

vLLM 0.32's `ChannelWiseTorchFP8ScaledMMLinearKernel` computes, for every quantized linear,

    C = s_x · s_w · (X_fp8 · W_fp8) + b        X_fp8 [M, K] per-token scaled, W_fp8 [K, N] per-channel

by calling `torch._scaled_mm`. On CPU that op is slow whatever the scales: a reference loop with scalar
scales, and oneDNN with row-wise scales, which on a CPU without native FP8 math is still several times
slower than the same GEMM in bf16 (one GEMM timed: docs/benchmarks.md, "Rollout throughput").

This patch computes the same formula from the same FP8 operands with a dense GEMM:

    C = s_x · s_w · (float(X_fp8) · float(W_fp8)) + b

`float()` is exact: every e4m3 value is a bf16 (and an fp32) value, and each product of two of them
(4 significant bits each) is exact in the fp32 accumulator. So the result is the FP8 GEMM up to the
order of the fp32 sums, plus, for a bf16 engine, one bf16 rounding of the accumulator before the scales
(the engine rounds its output to bf16 anyway). The compute dtype is bf16 when the output is bf16 and the
CPU has bf16 dot products (avx512_bf16 / AMX, the adapter's test for a fast bf16 engine), else fp32
(exact to sum order; where bf16 GEMMs run in software fp32 is also the faster one). Rollouts keep their
FP8 numerics: X and W are still quantized to e4m3 by vLLM; only the GEMM that multiplies them changes.

The dequantized weight (exact, unscaled) is cached per weight tensor: +2 bytes per quantized parameter
for a bf16 engine (+4 for fp32), ~210 MB for SmolLM2-135M. vLLM's layerwise `reload_weights` writes
re-quantized weights into the same tensors through `.data.copy_` (no version bump), so
`vllm_internals.invalidating_fp8_cache` wraps the model runner's `reload_weights` to drop the cache; a weight
tensor that is replaced is a new key.

It changes nothing on GPU (only CPU tensors take the new path). The vLLM adapter installs it before
starting an engine on CPU and then in every worker (`vllm_internals.install_cpu_patches`), so a worker in a
process of its own is patched too. tests/test_engines_vllm_cpu_fp8.py checks the formula against vLLM's
own kernel and the reload invalidation.
"""

from __future__ import annotations

import weakref

_CACHE_ATTR = "_portable_rl_dequantized"  # on each fp8 weight tensor: its exact copy in the compute dtype
# Weak references to the tensors that carry a cached copy (tensors compare elementwise, so no weak dict).
_CACHED: list = []
_BF16_GEMM_IS_FAST: bool | None = None


def _compute_dtype(out_dtype):
    import torch

    global _BF16_GEMM_IS_FAST
    if _BF16_GEMM_IS_FAST is None:
        from portable_rl.engines.cpu_features import has_fast_bf16

        _BF16_GEMM_IS_FAST = has_fast_bf16()
    return torch.bfloat16 if out_dtype == torch.bfloat16 and _BF16_GEMM_IS_FAST else torch.float32


def invalidate_dequantized_weights() -> None:
    """Drops every cached dequantized weight (called after each weight reload)."""
    for ref in _CACHED:
        tensor = ref()
        if tensor is not None and hasattr(tensor, _CACHE_ATTR):
            delattr(tensor, _CACHE_ATTR)
    _CACHED.clear()


def _dequantized_weight(weight_fp8, dtype):
    """`weight_fp8` [K, N] as `dtype`, exact, computed once per weight tensor and reload."""
    cached = getattr(weight_fp8, _CACHE_ATTR, None)
    if cached is not None and cached.dtype == dtype:
        return cached
    weight = weight_fp8.to(dtype)  # keeps the [K, N] column-major strides: mm reads it as X @ W^T
    setattr(weight_fp8, _CACHE_ATTR, weight)
    _CACHED.append(weakref.ref(weight_fp8))
    return weight


def dense_scaled_mm(*, A, B, out_dtype, As, Bs, bias, output_shape):
    """`ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm`'s result for CPU tensors, by a dense GEMM of
    the exactly upcast fp8 operands (module doc); vllm_internals.cpu_fp8_gemm installs it."""
    import torch

    num_tokens = 1
    for d in output_shape[:-1]:
        num_tokens *= d
    compute_dtype = _compute_dtype(out_dtype)
    x = torch.narrow(A, 0, 0, num_tokens).to(compute_dtype)  # A may carry padding rows beyond the tokens
    n = B.shape[1]
    scale_x = As.to(torch.float32).reshape(-1, 1)
    scale_x = scale_x if scale_x.shape[0] == 1 else torch.narrow(scale_x, 0, 0, num_tokens)  # [M, 1]
    scale_w = Bs.to(torch.float32).reshape(1, -1).expand(1, n)                                 # [1, N]
    out = torch.mm(x, _dequantized_weight(B, compute_dtype)).to(torch.float32) * (scale_x * scale_w)
    if bias is not None:
        out = out + bias
    return out.to(out_dtype).view(*output_shape)
