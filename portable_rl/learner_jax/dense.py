"""Matmul with float32 accumulation in the forward AND in both backward products.

    y  = x_c @ w_c           -> out_dtype      x_c, w_c, dy_c: x, w, dy cast to the compute dtype
    dx = dy_c @ w_c^T        -> x.dtype        every product: compute-dtype inputs, f32 accumulation
    dw = x_c^T @ dy_c        -> w.dtype        (f32 master params get an f32 dw, not a rounded bf16 one)

Numerics equal autodiff through `jnp.dot(x_c, w_c)` except that dw is no longer rounded to bf16
before the float32 optimizer sees it; a float32 cotangent (the float32 logits) is rounded to the
compute dtype exactly as JAX's dot transpose rule (and torch autocast) already did.

Why not plain autodiff of `nnx.Linear`: with bf16 inputs it emits bf16-output dots. On XLA:CPU a
[1024x768]x[768x2048] bf16 x bf16 -> f32 dot ran at 842 GFLOP/s (AMX) and the bf16 -> bf16 one at
156 GFLOP/s; an MLP forward+backward went from 107 ms to 32 ms and the 32k-vocabulary tied head
from 1.0 s to 0.35 s (docs/experiments/learner_performance.md, "Learner step"). On GPU/TPU the f32-output products are
what the matrix units accumulate in anyway.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def _dot(a, b, contracting):  # -> float32, no batch dimensions
    return jax.lax.dot_general(a, b, (contracting, ((), ())), preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def dense(x, w, compute_dtype, out_dtype):
    """x [..., K] @ w [K, N] -> [..., N] in out_dtype; inputs cast to compute_dtype, f32 accumulation."""
    return _dense_fwd(x, w, compute_dtype, out_dtype)[0]


def _dense_fwd(x, w, compute_dtype, out_dtype):
    x_c, w_c = x.astype(compute_dtype), w.astype(compute_dtype)
    y = _dot(x_c, w_c, ((x.ndim - 1,), (0,)))                              # [..., N] f32
    # Residuals: the compute-dtype copies (what the backward multiplies with) and two empty arrays
    # that remember the dtypes the gradients must come back in.
    return y.astype(out_dtype), (x_c, w_c, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _columns(x):
    """x [..., K] -> x^T [K, M] (M = rows) as a real transposed copy.

    XLA folds a plain 2-D transpose into the dot as a transposed-LHS product, which XLA:CPU runs
    in float32 at 110-180 GFLOP/s; a 3-D transpose + reshape stays a copy, and the [K, M] @ [M, N]
    product that follows ran at 450 GFLOP/s (bf16, AMX). On GPU/TPU the copy is a few MB per layer.
    """
    if x.ndim == 2:
        if x.shape[0] % 2:
            return x.T
        x = x.reshape(2, x.shape[0] // 2, x.shape[1])                     # [2, M/2, K]
    perm = (x.ndim - 1,) + tuple(range(x.ndim - 1))
    return jnp.transpose(x, perm).reshape(x.shape[-1], -1)                 # [K, M]


def _dense_bwd(compute_dtype, out_dtype, res, dy):
    x_c, w_c, x_like, w_like = res
    # The barrier keeps the compute-dtype cast: without it XLA drops a bf16 cast of a float32
    # cotangent (excess precision) and runs the products in float32.
    dy_c = jax.lax.optimization_barrier(dy.astype(compute_dtype))           # [..., N]
    dx = _dot(dy_c, w_c, ((dy_c.ndim - 1,), (1,)))                          # [..., K] f32
    dw = _dot(_columns(x_c), dy_c.reshape(-1, dy_c.shape[-1]), ((1,), (0,)))  # [K, N] f32
    # This barrier keeps XLA from folding a later transpose of dw (the tied head passes
    # embedding.T) into the product as a transposed-LHS bf16 dot, a form XLA:CPU's dot runtime
    # rejects ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32").
    dw = jax.lax.optimization_barrier(dw)
    return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)
