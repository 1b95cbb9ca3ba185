"""learner_jax/dense.py: the matmul with float32 accumulation in the forward and both backward products."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from portable_rl.learner_jax.dense import dense

BF16, F32 = jnp.bfloat16, jnp.float32


def _inputs(shape_x, k, n, seed=0):
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (*shape_x, k), F32)
    w = 0.05 * jax.random.normal(kw, (k, n), F32)
    g = jax.random.normal(kg, (*shape_x, n), F32)          # upstream cotangent
    return x, w, g


def _exact(a, b, contract):  # float32 product of (already rounded) inputs, highest precision
    return jax.lax.dot_general(a.astype(F32), b.astype(F32), (contract, ((), ())),
                               precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("shape_x", [(6, 10), (7,), (2, 3, 5)])   # even, odd (no reshape), 3-D rows
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_bf16_products_accumulate_in_f32(shape_x, out_dtype):
    """Forward and both gradients equal float32 products of the bf16-rounded operands.

    In particular dw (float32 master params) is not rounded to bf16: autodiff of a bf16 dot
    returned it rounded (relative error ~2^-9), which the tolerance here is 30x below.
    """
    x, w, g = _inputs(shape_x, 48, 40)

    def f(x, w):
        return jnp.sum(dense(x, w, BF16, out_dtype).astype(F32) * g)

    y = jax.jit(lambda x, w: dense(x, w, BF16, out_dtype))(x, w)
    dx, dw = jax.jit(jax.grad(f, (0, 1)))(x, w)
    assert y.dtype == out_dtype and dx.dtype == F32 and dw.dtype == F32

    x_c, w_c, g_c = x.astype(BF16), w.astype(BF16), g.astype(out_dtype).astype(BF16)
    rows = int(np.prod(shape_x))
    want_y = _exact(x_c, w_c, ((x.ndim - 1,), (0,))).astype(out_dtype)
    want_dx = _exact(g_c, w_c, ((g.ndim - 1,), (1,)))
    want_dw = _exact(x_c.reshape(rows, -1), g_c.reshape(rows, -1), ((0,), (0,)))
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-4)


def test_float32_compute_matches_jnp_dot():
    x, w, g = _inputs((4, 9), 16, 12, seed=1)

    def loss(mm):
        return lambda x, w: jnp.sum(mm(x, w) * g)

    got = jax.jit(jax.grad(loss(lambda x, w: dense(x, w, F32, F32)), (0, 1)))(x, w)
    want = jax.jit(jax.grad(loss(lambda x, w: jnp.dot(x, w, precision="highest")), (0, 1)))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_tied_head_transposed_weight_compiles_and_is_right():
    """The tied head passes embedding.T with float32 logits. Before the barrier in the backward,
    XLA:CPU folded the transpose into a bf16 dot its runtime rejects (UNIMPLEMENTED: BF16 x BF16 = F32)."""
    x, _, _ = _inputs((4, 16), 64, 1)
    emb = 0.05 * jax.random.normal(jax.random.PRNGKey(3), (300, 64), F32)      # [V, D]
    g = jax.random.normal(jax.random.PRNGKey(4), (4, 16, 300), F32)

    def f(x, emb):
        return jnp.sum(dense(x, emb.T, BF16, F32) * g)

    dx, d_emb = jax.jit(jax.grad(f, (0, 1)))(x, emb)
    x_c, e_c, g_c = x.astype(BF16), emb.astype(BF16), g.astype(BF16)
    np.testing.assert_allclose(dx, _exact(g_c, e_c, ((2,), (0,))), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(d_emb, _exact(g_c.reshape(64, 300), x_c.reshape(64, 64), ((0,), (0,))),
                               rtol=1e-4, atol=1e-4)
