"""Fast path for vLLM-CPU's per-channel FP8 GEMM (an in-process patch, applied before engine start).

vLLM 0.32's `ChannelWiseTorchFP8ScaledMMLinearKernel` computes C = s_x · s_w · (X_fp8 · W_fp8) by
calling `torch._scaled_mm` with dummy *scalar* scales and rescaling afterwards. On CPU, torch's
scalar-scale fp8 GEMM is a reference loop (~150 ms for a 32×128×384 product on this box) while the
row-wise-scale form (scale_a [M, 1], scale_b [1, N]) goes to oneDNN (~1 ms). This patch passes the
real per-token / per-channel scales to `_scaled_mm` instead: the same formula, X and W still fp8,
so rollouts keep their FP8 numerics (results agree with the original to fp32 rounding; see
tests/test_engines_vllm_cpu_fp8.py). It changes nothing on GPU (only CPU tensors take the new path).
The vLLM adapter applies it before starting an in-process engine, and the worker extension module applies
it on import, so a multiprocess engine's worker is patched too.
"""

from __future__ import annotations

_PATCHED = False


def _rowwise_apply_scaled_mm(self, *, A, B, out_dtype, As, Bs, bias, output_shape):
    import torch

    if A.device.type != "cpu":
        return self._portable_rl_original_apply_scaled_mm(A=A, B=B, out_dtype=out_dtype, As=As, Bs=Bs,
                                                         bias=bias, output_shape=output_shape)
    num_tokens = 1
    for d in output_shape[:-1]:
        num_tokens *= d
    a = torch.narrow(A, 0, 0, num_tokens)  # A may carry padding rows beyond the real tokens
    n = B.shape[1]
    scale_a = As.to(torch.float32).reshape(-1, 1)
    scale_a = (scale_a.expand(num_tokens, 1) if scale_a.shape[0] == 1
               else torch.narrow(scale_a, 0, 0, num_tokens)).contiguous()          # [M, 1] per token
    scale_b = Bs.to(torch.float32).reshape(1, -1).expand(1, n).contiguous()        # [1, N] per channel
    out = torch._scaled_mm(a, B, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    if isinstance(out, tuple):
        out = out[0]
    if bias is not None:
        out = out + bias
    return out.to(out_dtype).view(*output_shape)


def apply() -> bool:
    """Installs the patch once; returns False when this vLLM has no such kernel (nothing to do)."""
    global _PATCHED
    if _PATCHED:
        return True
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel as K
    except ImportError:
        return False
    K._portable_rl_original_apply_scaled_mm = K.apply_scaled_mm
    K.apply_scaled_mm = _rowwise_apply_scaled_mm
    _PATCHED = True
    return True
