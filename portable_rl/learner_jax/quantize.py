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


# engine `quantization` (engines/base.py) -> what it serves for a learner weight
SERVED_WEIGHTS = {None: served_bf16, "fp8_per_channel": served_fp8_per_channel,
                  "int8_per_channel": served_int8_per_channel}
