"""The engines' weight quantizers in JAX: what an engine serves for a learner weight, and the INT8 push.

Every function takes an NNX kernel W [..., in, C] (output channels are columns; leading axes stack
matrices) and is jit-able; each is bit-equal to the engine-side formula it names (tests/test_quantize_jax.py,
tests/test_update_survival.py). The push rounds W to bf16 first, so the served values start from B = bf16(W).

    served_bf16(W)               B
    served_fp8_per_channel(W)    vLLM's online per-channel e4m3:  s_c = max(max_i |B_ic| / 448, 1 / (448·512)),
                                 Q_ic = e4m3(B_ic / s_c),  served Q_ic · s_c
    quantize_int8_per_channel(B) INT8 W8A8 (engines/quantize.py, the compressed-tensors checkpoint):
                                 s_c = max_i |B_ic| / 127 (1 for an all-zero channel),
                                 Q_ic = clamp(round_half_even(B_ic / s_c), −127, 127)  int8
    served_int8_per_channel(W)   Q_ic · s_c of B
    served_fake_<scheme>(W)      the `fake_quant` engine (engines/quantize.py): quantize-dequantize of B with
                                 mxfp4 (e2m1 in groups of 32 inputs, one power-of-two scale each), nvfp4 (groups of
                                 16, an e4m3 scale each under an f32 tensor scale) or fp8_e4m3_tensor (one scale),
                                 rounded to bf16 again as the engine receives it (exact for mxfp4's power-of-two
                                 scales)

Groups run along the input dim (axis −2 here, the last axis of torch's [out, in]). e2m1 rounding is to nearest,
ties to even, saturating at ±6; the MX scale's exponent is read from the float's bits (frexp), exact where a log2
could round up just below a power of two (for bf16 inputs the two agree).

Divisions are true divisions (`true_divide`): XLA would otherwise rewrite x / c into x · (1/c), which rounds
twice and moves quotients that sit on a rounding midpoint (common for bf16 weights) to the other side.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0   # float8_e4m3fn's largest finite value
INT8_MAX = 127.0  # symmetric int8: −127..127
_MIN_FP8_CHANNEL_SCALE = np.float32(1.0) / np.float32(FP8_MAX * 512)  # vLLM's clamp, an f32 division as there


def true_divide(x, y):
    """x / y rounded once, as torch divides (module doc): an optimization barrier on the full-shape divisor
    keeps XLA from turning the division into a multiplication by the reciprocal."""
    shape = jnp.broadcast_shapes(jnp.shape(x), jnp.shape(y))
    return x / jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(y, jnp.float32), shape))


def served_bf16(w):
    """[..., in, C] -> the values a bf16 push delivers, as f32."""
    return w.astype(jnp.bfloat16).astype(jnp.float32)


def served_fp8_per_channel(w):
    """[..., in, C] -> vLLM 0.32's online per-channel e4m3 values (online/fp8.py), as f32."""
    b = served_bf16(w)
    scale = jnp.maximum(true_divide(jnp.max(jnp.abs(b), axis=-2, keepdims=True), FP8_MAX), _MIN_FP8_CHANNEL_SCALE)
    q = jnp.clip(true_divide(b, scale), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)    # [..., in, C]
    return q.astype(jnp.float32) * scale


def quantize_int8_per_channel(w):
    """[..., in, C] (any float dtype; the push passes bf16) -> (Q [..., in, C] int8, s [..., C] f32, finite: bool
    scalar, False when W holds a NaN or an inf)."""
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-2, keepdims=True)                                  # [..., 1, C]
    finite = jnp.all(jnp.isfinite(w))  # not of amax: XLA's max may drop a NaN
    scale = jnp.where(amax > 0, true_divide(amax, INT8_MAX), 1.0)
    q = jnp.clip(jnp.round(true_divide(w, scale)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale[..., 0, :], finite


def served_int8_per_channel(w):
    """[..., in, C] -> the INT8 per-channel values the engine's GEMM multiplies by, as f32 (weights only; the
    engine also quantizes activations per token)."""
    q, scale, _ = quantize_int8_per_channel(served_bf16(w))
    return q.astype(jnp.float32) * scale[..., None, :]


E2M1_MAX = 6.0
_E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_E2M1_MIDPOINTS = (_E2M1_GRID[1:] + _E2M1_GRID[:-1]) / 2                                  # 7 rounding boundaries


def round_to_e2m1(x):
    """f32 -> the nearest FP4 (e2m1) value, ties to the even grid index (even mantissa), saturating at ±6."""
    a = jnp.minimum(jnp.abs(x), E2M1_MAX)[..., None]
    below = jnp.sum(a > _E2M1_MIDPOINTS, axis=-1)        # a on a boundary -> the lower neighbour's index
    at_or_below = jnp.sum(a >= _E2M1_MIDPOINTS, axis=-1)  # ... the upper neighbour's
    index = jnp.where(below % 2 == 0, below, at_or_below)
    return jnp.sign(x) * jnp.asarray(_E2M1_GRID)[index]


def _input_groups(w, group: int):
    """[..., in, C] -> [..., in / group, group, C] f32 (the torch side groups [out, in] along in)."""
    *lead, n, c = w.shape
    if n % group:
        raise ValueError(f"group size {group} must divide the input dim {n} (kernel shape {tuple(w.shape)})")
    return w.astype(jnp.float32).reshape(*lead, n // group, group, c)


def served_fake_mxfp4(w, group: int = 32):
    """[..., in, C] -> the `fake_quant` engine's MXFP4 values of B = bf16(W), as f32:
    X_g = 2^(floor(log2 max_g |B|) − 2), served e2m1(B / X_g) · X_g."""
    b = _input_groups(served_bf16(w), group)                                        # [..., G, group, C]
    amax = jnp.max(jnp.abs(b), axis=-2, keepdims=True)                              # [..., G, 1, C]
    _, e = jnp.frexp(amax)                                                          # amax = m · 2^e, m in [0.5, 1)
    # floor(log2 amax) = e − 1; the floor at 2^-126 keeps the scale normal (XLA flushes subnormals to zero,
    # which would turn an all-zero group into 0 / 0); it differs from torch only for groups below 2^-123
    scale = jnp.ldexp(jnp.float32(1.0), jnp.maximum(e - 1 - 2, -126))
    return (round_to_e2m1(b / scale) * scale).reshape(w.shape)                      # power-of-two: exact


def served_fake_nvfp4(w, group: int = 16):
    """[..., in, C] -> the `fake_quant` engine's NVFP4 values of B = bf16(W), as f32: tensor scale
    g = max|B| / (448·6), block scale s_b = e4m3(max_b |B| / (6 g)), served e2m1(B / (s_b g)) · s_b g."""
    b = _input_groups(served_bf16(w), group)
    matrix_amax = jnp.max(jnp.abs(b), axis=(-3, -2, -1), keepdims=True)                # one per matrix
    tensor_scale = jnp.maximum(true_divide(matrix_amax, FP8_MAX * E2M1_MAX), 1e-12)
    block_amax = jnp.max(jnp.abs(b), axis=-2, keepdims=True)                           # [..., G, 1, C]
    block_scale = true_divide(block_amax, E2M1_MAX * tensor_scale).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    scale = jnp.maximum(block_scale * tensor_scale, 1e-30)                             # a zero block stays zero
    return served_bf16((round_to_e2m1(true_divide(b, scale)) * scale).reshape(w.shape))  # pushed as bf16


def served_fake_fp8_e4m3_tensor(w):
    """[..., in, C] -> the `fake_quant` engine's per-tensor e4m3 values of B = bf16(W), as f32 (one scale per
    matrix: a stacked [L, in, C] kernel gets one per layer)."""
    b = served_bf16(w)
    scale = jnp.maximum(true_divide(jnp.max(jnp.abs(b), axis=(-2, -1), keepdims=True), FP8_MAX), 1e-12)
    q = jnp.clip(true_divide(b, scale), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return served_bf16(q * scale)                                                   # pushed as bf16


# engine `quantization` (engines/base.py) -> what it serves for a learner weight
SERVED_WEIGHTS = {None: served_bf16, "fp8_per_channel": served_fp8_per_channel,
                  "int8_per_channel": served_int8_per_channel, "fake_mxfp4": served_fake_mxfp4,
                  "fake_nvfp4": served_fake_nvfp4, "fake_fp8_e4m3_tensor": served_fake_fp8_e4m3_tensor}
