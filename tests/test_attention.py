"""Every attention implementation computes dense_attention's function (portable_rl/learner_jax/attention.py).

fp32 comparisons are norm-relative, <= 1e-5 (measured ~5e-7: the online softmax reorders float32 sums).
The segment layouts below cover: several segments per row crossing block borders, padding at the
end, a row that is all padding, left padding, a full row; T = 77 is not a multiple of any block.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from portable_rl.learner_jax import attention as attention_lib

T = 77


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _segments(t):
    """[5, t] rows: packed (3 segments crossing 16-blocks, then padding), all padding, left padding,
    full, packed with a 1-token segment and left padding."""
    rows = np.zeros((5, t), np.int32)
    rows[0, :20], rows[0, 20:45], rows[0, 45:t - 9] = 1, 2, 3
    rows[2, 13:] = 1
    rows[3, :] = 7
    rows[4, 5:6], rows[4, 6:40], rows[4, 40:] = 1, 2, 3
    return jnp.asarray(rows)


def _inputs(b, t, n, kv, h, seed=0):
    """q [b, t, n, h], k / v [b, t, kv, h], d_out [b, t, n, h]: standard normal float32."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    return normal(b, t, n, h), normal(b, t, kv, h), normal(b, t, kv, h), normal(b, t, n, h)


@partial(jax.jit, static_argnums=0)
def _value_and_grads(fn, q, k, v, segment_ids, d_out):
    """(out, (dq, dk, dv)) for the cotangent d_out, one compile per fn."""
    out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, segment_ids), q, k, v)
    return out, pullback(d_out.astype(out.dtype))


def _assert_matches_dense(fn, q, k, v, segment_ids, d_out, ref=None, tol=1e-5):
    got = jax.tree.map(np.asarray, _value_and_grads(fn, q, k, v, segment_ids, d_out))
    ref = ref or jax.tree.map(np.asarray, _value_and_grads(attention_lib.dense_attention, q, k, v,
                                                            segment_ids, d_out))
    padding = np.asarray(segment_ids) == 0
    for name, x, r in zip(("out", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert np.all(np.isfinite(x)), name
        assert _rel(x, r) <= tol, (name, _rel(x, r))
        # exactly 0 at padding: a padding query's output and dq, a padding key's dk and dv
        assert np.all(x[padding] == 0), name
    return ref


@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (6, 2), (8, 1)])  # GQA ratios 1, 3, 8
def test_blockwise_matches_dense(num_heads, num_kv_heads):
    q, k, v, d_out = _inputs(5, T, num_heads, num_kv_heads, 16)
    blockwise = partial(attention_lib.blockwise_attention, block_q=16, block_k=16)
    _assert_matches_dense(blockwise, q, k, v, _segments(T), d_out)


def test_blockwise_unequal_blocks_and_one_block():
    """block_q != block_k (different internal padding for queries and keys), and blocks longer than T."""
    q, k, v, d_out = _inputs(5, T, 6, 2, 16, seed=1)
    ref = None
    for block_q, block_k in ((8, 24), (128, 128)):
        blockwise = partial(attention_lib.blockwise_attention, block_q=block_q, block_k=block_k)
        ref = _assert_matches_dense(blockwise, q, k, v, _segments(T), d_out, ref)


def test_block_ranges_skip_invisible_blocks():
    """Causal + segment skipping: only block pairs that can hold a visible (query, key) pair run.

    seg = [1 1 1 2 2 2 0 0], blocks of 2: query block 2 (rows 4, 5, segment 2 starting at 3) needs
    key blocks 1..2 only, block 3 (padding) none; causal alone would run 10 of 16 pairs, here 5."""
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 0, 0]], jnp.int32)
    kv_lo, kv_hi, q_lo, q_hi = attention_lib._block_ranges(seg, 2, 2, 4, 4)
    assert kv_lo.tolist()[:3] == [0, 0, 1] and kv_hi.tolist() == [1, 2, 3, 0]
    assert q_lo.tolist()[:3] == [0, 1, 2] and q_hi.tolist() == [2, 3, 3, 0]
    assert int(jnp.sum(jnp.maximum(kv_hi - kv_lo, 0))) == 5 == int(jnp.sum(jnp.maximum(q_hi - q_lo, 0)))


def test_blockwise_bf16_grads_match_fp32():
    """As tests/test_model_grads.py::test_attention_grads_bf16_match_fp32 for the dense reference:
    sharp scores, v with a large common part (the case where dP - D cancels), GQA, a short row and
    an all-padding row; bf16 gradients within bf16 rounding (<1 %) of the fp32 ones.

    Two choices keep it there (measured on this case): D = rowsum(dO o O) from a float32 O (from a
    bf16 O: 5-10 %), and O normalised by the sum of the bf16-rounded weights (by l: 2 %)."""
    b, t, n, kv, h = 3, 48, 4, 2, 32
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = (4.0 * jax.random.normal(keys[0], (b, t, n, h))).astype(jnp.bfloat16)
    k = (4.0 * jax.random.normal(keys[1], (b, t, kv, h))).astype(jnp.bfloat16)
    v = (3.0 + 0.1 * jax.random.normal(keys[2], (b, t, kv, h))).astype(jnp.bfloat16)
    d_out = jax.random.normal(keys[3], (b, t, n, h))
    valid = jnp.arange(t)[None] < jnp.array([[t], [t // 3], [0]])                       # [B, T]
    segment_ids = valid.astype(jnp.int32)

    def grads(dtype):
        def f(q, k, v):
            out = attention_lib.blockwise_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype),
                                                    segment_ids, block_q=16, block_k=16)
            assert out.dtype == dtype
            return jnp.sum(out.astype(jnp.float32) * d_out * valid[..., None, None])
        return jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)

    got, ref = grads(jnp.bfloat16), grads(jnp.float32)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert g.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g))), name
        assert _rel(g, r) < 0.01, (name, _rel(g, r))


def _grad_temp_bytes(fn, t):
    """Compiled temp memory of grad(sum(attention)) at T = t: one kv head, two query heads, H = 16."""
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    loss = lambda q, k, v, seg: jnp.sum(fn(q, k, v, seg))
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(
        spec(1, t, 2, 16), spec(1, t, 1, 16), spec(1, t, 1, 16),
        jax.ShapeDtypeStruct((1, t), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_is_linear_in_t():
    """T 2048 -> 4096: blockwise temp memory grows <= 2.2x (measured 1.7x), dense ~4x ([T, T] scores)."""
    blockwise = [_grad_temp_bytes(attention_lib.blockwise_attention, t) for t in (2048, 4096)]
    dense = [_grad_temp_bytes(attention_lib.dense_attention, t) for t in (2048, 4096)]
    assert blockwise[1] <= 2.2 * blockwise[0], blockwise
    assert 3.5 * dense[0] <= dense[1] <= 4.5 * dense[0], dense
    assert blockwise[1] * 20 < dense[1], (blockwise, dense)


def test_lengths_path_matches_dense_and_falls_back_for_packed_rows():
    """The 'cudnn' path's logic with jax.nn.dot_product_attention's XLA kernel standing in for cuDNN
    (same arguments): right-padded rows take the causal + per-row-length kernel, packed or
    left-padded rows fall back to blockwise, both equal to dense in outputs and gradients."""
    q, k, v, d_out = _inputs(5, T, 6, 2, 16, seed=2)
    lengths = jnp.asarray([T, 30, 0, 1, T - 5])
    right_padded = (jnp.arange(T)[None] < lengths[:, None]).astype(jnp.int32)
    assert bool(attention_lib._one_segment_per_row(right_padded))
    assert not bool(attention_lib._one_segment_per_row(_segments(T)))
    assert not bool(attention_lib._one_segment_per_row(jnp.flip(right_padded, axis=1)))  # left padding
    fn = partial(attention_lib.lengths_attention, implementation="xla")
    for segment_ids in (right_padded, _segments(T)):
        _assert_matches_dense(fn, q, k, v, segment_ids, d_out)


@pytest.mark.slow
def test_splash_interpret_matches_dense():
    """The TPU splash kernel in Pallas interpret mode on CPU: T = 200 padded to 256 inside, GQA 2,
    head_dim 128, packed rows with left padding and an all-padding row."""
    t = 200
    seg = np.zeros((3, t), np.int32)
    seg[0, :60], seg[0, 60:160], seg[0, 160:190] = 1, 2, 3
    seg[2, 30:] = 5
    q, k, v, d_out = _inputs(3, t, 4, 2, 128, seed=3)
    splash = partial(attention_lib.splash_attention, interpret=True)
    _assert_matches_dense(splash, q, k, v, jnp.asarray(seg), d_out)


def test_resolve_attention_impl():
    assert attention_lib.IMPLS == ("blockwise", "dense", "cudnn", "splash")
    resolve = attention_lib.resolve_attention_impl
    assert resolve("auto") == "blockwise" == resolve("auto", "cpu")       # this machine: CPU only
    assert resolve("auto", "gpu") == "cudnn" and resolve("auto", "tpu") == "splash"
    assert resolve("auto", "rocm") == "blockwise"                        # cuDNN is CUDA only
    assert resolve("cudnn", "gpu") == "cudnn" and resolve("splash", "tpu") == "splash"
    for impl in ("blockwise", "dense"):
        assert resolve(impl) == impl == resolve(impl, "tpu")
    with pytest.raises(ValueError, match="attention_impl='flash'; use one of"):
        resolve("flash")


@pytest.mark.parametrize("impl, device", [("cudnn", "GPU"), ("splash", "TPU")])
def test_accelerator_impls_on_cpu_raise_one_line(impl, device):
    q, k, v, _ = _inputs(1, 8, 2, 1, 8)
    with pytest.raises(ValueError) as info:
        attention_lib.attention(q, k, v, jnp.ones((1, 8), jnp.int32), impl=impl)
    message = str(info.value)
    assert "\n" not in message and f"attention_impl='{impl}' needs a {device}" in message
    assert "use 'blockwise' (or 'auto')" in message


def test_attention_dispatch():
    """attention(impl=...) traces to the named implementation ('auto' -> blockwise here)."""
    q, k, v, _ = _inputs(5, T, 6, 2, 16)
    trace = lambda fn: str(jax.make_jaxpr(fn)(q, k, v, _segments(T)))
    blockwise = trace(attention_lib.blockwise_attention)
    assert trace(partial(attention_lib.attention, impl="auto")) == blockwise
    assert trace(partial(attention_lib.attention, impl="blockwise")) == blockwise
    assert trace(partial(attention_lib.attention, impl="dense")) == trace(attention_lib.dense_attention)
    assert blockwise != trace(attention_lib.dense_attention)


def _shared_prompt_row(t):
    """[2, t] rows with shared prompts (continuation ids, learner_jax/attention.py): row 0 = prompt 1
    (9 tokens) with continuations of 5, 7 and 1 tokens, then an ordinary segment 2 (10 tokens), then
    prompt 3 (6) with continuations of 20 and 12, padding; row 1 = one ordinary segment (the batch
    mixes both kinds). Returns the ids and, per continuation, (row, prompt span, own span)."""
    cid = attention_lib.continuation_id
    rows = np.zeros((2, t), np.int32)
    spans, pos = [], 0
    layout = [(1, 9, (5, 7, 1)), (2, 10, ()), (3, 6, (20, 12))]
    for slot, prompt, continuations in layout:
        rows[0, pos:pos + prompt] = slot
        prompt_span, pos = (pos, pos + prompt), pos + prompt
        for j, n in enumerate(continuations, 1):
            rows[0, pos:pos + n] = cid(slot, j)
            spans.append((0, prompt_span, (pos, pos + n)))
            pos += n
    assert pos < t
    rows[1, 3:60] = 4
    return jnp.asarray(rows), spans


def test_shared_prompt_continuations_see_their_prompt_only():
    """A continuation attends to its prompt and itself, exactly as the sequence prompt + continuation
    alone in a row (dense, then blockwise with blocks that cut through prompts and continuations,
    and the cuDNN path's fallback), outputs and gradients."""
    seg, spans = _shared_prompt_row(T)
    q, k, v, d_out = _inputs(2, T, 6, 2, 16, seed=4)
    out = np.asarray(attention_lib.dense_attention(q, k, v, seg))
    for row, (p0, p1), (c0, c1) in spans:
        idx = np.r_[p0:p1, c0:c1]                                   # the sequence alone, one segment
        alone = attention_lib.dense_attention(*(x[row:row + 1, idx] for x in (q, k, v)),
                                              jnp.ones((1, len(idx)), jnp.int32))
        np.testing.assert_allclose(out[row, c0:c1], np.asarray(alone)[0, p1 - p0:], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out[row, p0:p1], np.asarray(alone)[0, :p1 - p0], rtol=1e-5, atol=1e-6)
    visible = np.asarray(attention_lib.visible_mask(seg))[0]
    (_, (p0, p1), (c0, c1)), (_, _, (d0, d1)) = spans[0], spans[1]
    assert visible[d0, p0:p1].all() and not visible[d0, c0:c1].any()  # not a sibling's tokens
    assert not visible[p1 - 1, c0:c1].any()                         # the prompt sees no continuation
    ref = None
    for fn in (partial(attention_lib.blockwise_attention, block_q=8, block_k=16),
               partial(attention_lib.blockwise_attention, block_q=128, block_k=128),
               partial(attention_lib.lengths_attention, implementation="xla")):
        ref = _assert_matches_dense(fn, q, k, v, seg, d_out, ref)
    assert bool(attention_lib.has_continuations(seg)) and not bool(attention_lib.has_continuations(_segments(T)))


def test_block_ranges_span_a_prompt_and_its_continuations():
    """Block skipping with shared prompts: a continuation's query block reaches back to its prompt's
    block, and a prompt's key block is seen up to the last continuation's block."""
    cid = attention_lib.continuation_id
    seg = jnp.asarray([[1, 1, cid(1, 1), cid(1, 1), cid(1, 2), cid(1, 2), 2, 2]], jnp.int32)
    kv_lo, kv_hi, q_lo, q_hi = attention_lib._block_ranges(seg, 2, 2, 4, 4)
    assert kv_lo.tolist() == [0, 0, 0, 3] and kv_hi.tolist() == [1, 2, 3, 4]
    assert q_lo.tolist() == [0, 1, 2, 3] and q_hi.tolist() == [3, 3, 3, 4]
