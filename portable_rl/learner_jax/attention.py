"""Causal self-attention over rows that may pack several sequences (segment ids), with GQA.

    out[b, t] = sum_s softmax_s(q[b, t] · k[b, s] / sqrt(H) | visible(b, t, s)) v[b, s]
    visible(b, t, s) = s <= t  and  seg[b, t] > 0  and  (seg[b, s] == seg[b, t]  or  seg[b, s] == parent(seg[b, t]))
    parent(id)       = id >> 16      (0 for the ids below 2^16 of ordinary segments)

Segment id 0 marks padding: a padding query sees no key and its output is exactly 0; a real query
never sees a padding key or another segment. Segments are contiguous runs within a row, so causal
order by row index is causal order within each segment (blockwise's block skipping relies on it).

Shared prompts: a segment with id p·2^16 + j (j >= 1, `continuation_id`) continues the segment p
(p < 2^15) that sits right before it in the row: it sees p's keys and its own, not those of p's
other continuations. So the n answers of one prompt share one copy of the prompt's tokens
(rl/batching.py `shared_prompt_packed`): each gets the attention it gets alone after the prompt,
provided positions are given (RoPE positions continue the prompt's; `segment_positions` does not
know this). A prompt with its continuations is contiguous, so block skipping uses its span.

Shapes: q [B, T, N, H], k/v [B, T, K, H] (N = K * G query heads share each kv head),
segment_ids [B, T] int32 -> out [B, T, N, H] in q's dtype. Matmul inputs in the compute dtype,
float32 accumulation, float32 softmax and softmax backward.

Implementations (`attention(..., impl=)`), all computing the function above:
    dense      the reference: materialises [B, K, G, T, T] float32 scores (memory quadratic in T).
    blockwise  FlashAttention-2 in plain JAX, any backend; memory linear in T (below).
    cudnn      jax.nn.dot_product_attention(implementation='cudnn') on a CUDA GPU, for batches whose
               rows are each one segment from position 0 (right padding); others run blockwise.
    splash     TPU splash attention (Pallas) with SegmentIds and a causal mask.

blockwise. Query blocks i of block_q rows, key blocks j of block_k rows, S_ij = Q_i K_j^T / sqrt(H)
masked by `visible`. Forward, per query block, an online softmax over its key blocks (float32):

    m_j = max(m_{j-1}, rowmax S_ij)            running max, starts at -1e30 (finite: no NaN)
    P~  = exp(S_ij - m_j)  (0 where invisible)
    l_j = e^(m_{j-1} - m_j) l_{j-1} + rowsum P~              w_j: the same sum of P~ rounded to v's dtype
    A_j = e^(m_{j-1} - m_j) A_{j-1} + P~ V_j                 (P~ in v's dtype, f32 accumulation)
    O_i = A / w,   lse_i = m + log l           (padding query: no key, O = 0, lse = 0)

O is normalised by w, the weights the P V matmul actually used, so they sum to exactly 1 and
rowsum(dO o O) below cancels the common part of dP as the dense backward does. Backward (custom
VJP): from the saved q, k, v, float32 O and lse, per key block j over its query blocks i,

    P = exp(S_ij - lse_i),   dV_j += P^T dO_i,   dP = dO_i V_j^T (f32),   D_i = rowsum(dO_i o O_i)
    dS = P o (dP - D_i) / sqrt(H),   dQ_i += dS K_j,   dK_j += dS^T Q_i

(dQ accumulates in a float32 [B, T, N, H] buffer); probabilities are never stored. GQA: query
heads are grouped [K, G] per kv head (k / v never repeated). Block skipping: query block i runs
only key blocks that can hold a visible key: from the earliest segment start among its real rows
to its last real row (causal); in the backward, key block j runs query blocks from its first real
key to the latest end of its keys' segments; blocks of padding run none (`_block_ranges`, shared
by the batch). A T that is not a multiple of a block is padded with segment id 0 and sliced back;
a T shorter than a block is one block. Memory of a training step: O(B T N H) (inputs, float32 O
and dQ, lse) plus one [B, K, G, block_q, block_k] score tile, against dense's O(B N T^2):
tests/test_attention.py::test_blockwise_memory_is_linear_in_t measures the compiled temp memory at
T = 2048 -> 4096 (blockwise x1.7, dense x4.0). Default blocks (_DEFAULT_BLOCKS): 128 on CPU (64 and
256 were slower), 256 on GPU / TPU (fewer loop steps). On CPU blockwise is faster than dense from
T = 256 up (dense's [T, T] f32 temporaries dominate), and block skipping pays for packed rows (8
segments of 256 in a 2048-token row run 24 block pairs against one segment's 136); the measurements are
in docs/experiments/learner_performance.md ("Attention").

cudnn. The installed jax's jax.nn.dot_product_attention (jax/_src/nn/functions.py,
jax/_src/cudnn/fused_attention_stablehlo.py) expresses, with cuDNN: is_causal, per-row
query / key lengths (PADDING_CAUSAL), a sliding window, and `mask` / `bias`; it has no segment ids.
A `mask` is turned into a dense additive bias [B, 1, T, S] in the input dtype and cuDNN also
returns its gradient (dbias): memory quadratic in T, what this module exists to avoid, so the
segment mask is not passed as a mask. The packed-sequence layout (q_offsets / kv_offsets) exists
only in the private jax._src API, needs Hopper, and sizes its softmax statistics [B * M, N, T] for
M segments per row (quadratic when M grows with T); not used. So 'cudnn' runs cuDNN with
is_causal + lengths when every row of the batch is one segment from position 0 (pack_sequences
off, right padding) and blockwise otherwise, chosen per call on device by lax.cond (the backward
recomputes the chosen branch's forward: residuals are only the inputs). Inputs cuDNN does not take
(float32, head_dim not a multiple of 8 or above 128 / 256 on Hopper) run blockwise, logged once.

splash. jax.experimental.pallas.ops.tpu.splash_attention's MHA kernel with a causal MultiHeadMask
and SegmentIds (query head n reads kv head n // G, which is GQA); q is scaled by 1/sqrt(H) first
(the kernel does not scale). T is padded to a multiple of 128 (segment id 0; padding queries see
padding keys, so no softmax row is empty, and are zeroed after); head_dim not a multiple of 128
runs blockwise (logged once), and so do batches with shared-prompt continuations (per call,
lax.cond: SegmentIds masks by equality only). The kernel runs on CPU in Pallas interpret mode, where
tests/test_attention.py checks it against dense (slow test).

'auto' (resolve_attention_impl): 'cudnn' on a CUDA GPU, 'splash' on TPU, 'blockwise' elsewhere
(CPU, ROCm). Asking for 'cudnn' without a GPU or 'splash' without a TPU is a one-line ValueError.
"""

from __future__ import annotations

import functools
import logging
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from portable_rl.errors import ConfigError

IMPLS = ("blockwise", "dense", "cudnn", "splash")

CONTINUATION_SHIFT = 16  # a shared-prompt continuation's id is (prompt id << 16) | j (module doc)
MAX_SHARED_PROMPT_ID = (1 << (31 - CONTINUATION_SHIFT)) - 1  # ids stay positive int32


def continuation_id(prompt_id, j):
    """The segment id of continuation j (1, 2, ...) of the shared prompt segment `prompt_id`."""
    return (prompt_id << CONTINUATION_SHIFT) | j


def _visible_ids(seg_q, seg_k):
    """[B, Tq], [B, Tk] segment ids -> [B, Tq, Tk] bool: same segment, or the key is in the query's
    shared prompt (module doc); real queries only. No causality."""
    q, k = seg_q[:, :, None], seg_k[:, None, :]
    parent = q >> CONTINUATION_SHIFT
    return (q > 0) & ((q == k) | ((parent > 0) & (parent == k)))


def _span_ids(segment_ids):
    """A shared prompt and its continuations as one id (the prompt's): contiguous spans for skipping."""
    parent = segment_ids >> CONTINUATION_SHIFT
    return jnp.where(parent > 0, parent, segment_ids)


def has_continuations(segment_ids):
    """True (a traced bool) when some row holds a shared-prompt continuation."""
    return jnp.any(segment_ids >> CONTINUATION_SHIFT > 0)

_MASKED = -1e30  # finite, so a row with no visible key never makes NaN (its probabilities are zeroed)


def _grouped(q, num_kv_heads):  # [B, T, N, H] -> [B, T, K, G, H], G = N // K query heads per kv head
    B, T, N, H = q.shape
    return q.reshape(B, T, num_kv_heads, N // num_kv_heads, H)


def visible_mask(segment_ids):
    """[B, T] segment ids -> [B, T, S] bool: causal, same segment (or the query's shared prompt),
    real (non-padding) query."""
    T = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((T, T), bool))                                       # [T, S]
    return causal[None] & _visible_ids(segment_ids, segment_ids)                    # [B, T, S]


def _dense_probs(q, k, visible):  # visible [B, T, S] -> probs [B, K, G, T, S] float32, 0 where invisible
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = jnp.einsum("btkgh,bskh->bkgts", _grouped(q, k.shape[2]), k,
                        preferred_element_type=jnp.float32) * scale                # [B, K, G, T, S]
    mask = visible[:, None, None]                                                   # [B, 1, 1, T, S]
    probs = jax.nn.softmax(jnp.where(mask, scores, _MASKED), axis=-1)
    return jnp.where(mask, probs, 0.0)  # a row with no visible key: all zeros, output 0


@jax.custom_vjp
def dense_attention(q, k, v, segment_ids):
    """The reference implementation (module doc). Why a custom VJP: with autodiff through a bf16
    P·V matmul the probability cotangent dP = dO V^T is rounded to bf16 before
    dS = P (dP - rowsum(P dP)), and that difference of nearly equal numbers loses most of its bits
    (q/k gradients off by tens of %). Here dP stays float32, as in flash-attention's backward."""
    return _dense_fwd(q, k, v, segment_ids)[0]


def _dense_fwd(q, k, v, segment_ids):
    probs = _dense_probs(q, k, visible_mask(segment_ids))                           # [B, K, G, T, S] f32
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype), (q, k, v, segment_ids, probs)


def _dense_bwd(res, d_out):  # d_out [B, T, N, H]
    q, k, v, segment_ids, probs = res
    dt = v.dtype
    d_out = _grouped(d_out, k.shape[2]).astype(dt)                                   # [B, T, K, G, H]
    d_v = jnp.einsum("bkgts,btkgh->bskh", probs.astype(dt), d_out, preferred_element_type=jnp.float32)
    d_probs = jnp.einsum("btkgh,bskh->bkgts", d_out, v, preferred_element_type=jnp.float32)  # f32
    # softmax backward in f32 with f32 probs (rows sum to 1 or are all 0; invisible entries have p = 0)
    d_scores = probs * (d_probs - jnp.sum(probs * d_probs, axis=-1, keepdims=True))
    d_scores = (d_scores * (1.0 / math.sqrt(q.shape[-1]))).astype(dt)
    d_q = jnp.einsum("bkgts,bskh->btkgh", d_scores, k, preferred_element_type=jnp.float32)
    d_k = jnp.einsum("bkgts,btkgh->bskh", d_scores, _grouped(q, k.shape[2]),
                     preferred_element_type=jnp.float32)
    return (d_q.reshape(q.shape).astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None)


dense_attention.defvjp(_dense_fwd, _dense_bwd)


# ----------------------------------------------------------------------------- blockwise

_DEFAULT_BLOCKS = {"cpu": (128, 128), "gpu": (256, 256), "tpu": (256, 256)}  # (block_q, block_k)


def _pad_time(x, length):  # pad axis 1 (time) with zeros up to `length`
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _segment_spans(segment_ids):
    """[B, T] -> (start, end) [B, T] int32: the first and last index of each token's segment.

    Segments are contiguous runs (module doc), so a boundary is wherever the id changes."""
    B, T = segment_ids.shape
    t = jnp.arange(T, dtype=jnp.int32)
    change = segment_ids[:, 1:] != segment_ids[:, :-1]                             # [B, T-1]
    first = jnp.concatenate([jnp.ones((B, 1), bool), change], axis=1)               # [B, T]
    last = jnp.concatenate([change, jnp.ones((B, 1), bool)], axis=1)
    start = lax.cummax(jnp.where(first, t, 0), axis=1)
    end = lax.cummin(jnp.where(last, t, T - 1), axis=1, reverse=True)
    return start, end


def _block_ranges(segment_ids, block_q, block_k, num_q_blocks, num_k_blocks):
    """Which blocks can hold a visible (query, key) pair, from the segment layout (cheap: O(B T)).

    Returns kv_lo, kv_hi [nq]: query block i sees key blocks kv_lo[i] <= j < kv_hi[i] (causal: no key
    past the block's last real query; segments: no key before the earliest segment start), and
    q_lo, q_hi [nk]: key block j is seen by query blocks q_lo[j] <= i < q_hi[j] (no query before the
    block's first real key nor past the latest segment end). Empty ranges (lo >= hi) for blocks with
    no real token. The ranges are shared by the whole batch (min / max over rows)."""
    B, T = segment_ids.shape
    real = segment_ids > 0
    start, end = _segment_spans(_span_ids(segment_ids))   # a shared prompt spans its continuations
    t = jnp.arange(T, dtype=jnp.int32)[None]
    big = jnp.int32(2 ** 30)

    def per_block(x, fill, block, num_blocks, reduce):     # [B, T] -> [num_blocks]
        x = _pad_time(jnp.where(real, x, fill), num_blocks * block)
        x = jnp.where(jnp.arange(num_blocks * block)[None] < T, x, fill)
        return reduce(x.reshape(B, num_blocks, block), axis=(0, 2))

    first_start = per_block(start, big, block_q, num_q_blocks, jnp.min)    # earliest key a block sees
    last_query = per_block(t, -1, block_q, num_q_blocks, jnp.max)
    kv_lo = jnp.minimum(first_start // block_k, num_k_blocks)
    kv_hi = jnp.where(last_query >= 0, last_query // block_k + 1, 0)
    first_key = per_block(t, big, block_k, num_k_blocks, jnp.min)
    last_end = per_block(end, -1, block_k, num_k_blocks, jnp.max)           # latest query that sees it
    q_lo = jnp.minimum(first_key // block_q, num_q_blocks)
    q_hi = jnp.where(last_end >= 0, last_end // block_q + 1, 0)
    return kv_lo, kv_hi, q_lo, q_hi


def _rounded_to(x, dtype):
    """float32 x rounded to `dtype`'s precision, kept float32. reduce_precision, not a convert round
    trip: XLA may drop f32 -> bf16 -> f32 converts (excess precision allowed), this it keeps."""
    if jnp.dtype(dtype) == jnp.float32:
        return x
    info = jnp.finfo(dtype)
    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _block_visible(seg_q, seg_k, q0, k0):
    """[B, bq], [B, bk] segment ids of one block pair starting at rows q0, k0 -> [B, 1, 1, bq, bk]."""
    tq = q0 + jnp.arange(seg_q.shape[1])
    tk = k0 + jnp.arange(seg_k.shape[1])
    vis = (tq[:, None] >= tk[None, :])[None] & _visible_ids(seg_q, seg_k)           # [B, bq, bk]
    return vis[:, None, None]


def _blockwise_forward(q, k, v, segment_ids, block_q, block_k):
    """-> out [B, T, K, G, H] float32, logsumexp [B, K, G, T] float32 (0 for padding queries)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    nq, nk = -(-T // block_q), -(-T // block_k)
    scale = 1.0 / math.sqrt(H)
    qg = _pad_time(_grouped(q, K), nq * block_q)                                   # [B, Tq, K, G, H]
    kp, vp = _pad_time(k, nk * block_k), _pad_time(v, nk * block_k)               # [B, Tk, K, H]
    seg_q, seg_k = _pad_time(segment_ids, nq * block_q), _pad_time(segment_ids, nk * block_k)
    kv_lo, kv_hi, _, _ = _block_ranges(segment_ids, block_q, block_k, nq, nk)

    def query_block(i, carry):
        out, lse = carry
        q0 = i * block_q
        q_i = lax.dynamic_slice_in_dim(qg, q0, block_q, 1)                          # [B, bq, K, G, H]
        seg_i = lax.dynamic_slice_in_dim(seg_q, q0, block_q, 1)                     # [B, bq]

        def key_block(j, state):  # online softmax: running max m, running sums l / w, unnormalised acc
            m, l, w, acc = state
            k0 = j * block_k
            k_j = lax.dynamic_slice_in_dim(kp, k0, block_k, 1)                       # [B, bk, K, H]
            v_j = lax.dynamic_slice_in_dim(vp, k0, block_k, 1)
            vis = _block_visible(seg_i, lax.dynamic_slice_in_dim(seg_k, k0, block_k, 1), q0, k0)
            s = jnp.einsum("bqkgh,bskh->bkgqs", q_i, k_j,
                           preferred_element_type=jnp.float32) * scale              # [B, K, G, bq, bk]
            m_new = jnp.maximum(m, jnp.max(jnp.where(vis, s, _MASKED), axis=-1))     # [B, K, G, bq]
            p = jnp.exp(jnp.where(vis, s - m_new[..., None], -jnp.inf))             # 0 where invisible
            alpha = jnp.exp(m - m_new)  # rescales what was summed under the old max (1 while no key)
            p_in = _rounded_to(p, v.dtype)                   # the values the P V matmul sees (f32)
            l = alpha * l + jnp.sum(p, axis=-1)                                      # for logsumexp
            w = alpha * w + jnp.sum(p_in, axis=-1)                                   # for the output
            acc = alpha[..., None] * acc + jnp.einsum(
                "bkgqs,bskh->bkgqh", p_in.astype(v.dtype), v_j, preferred_element_type=jnp.float32)
            return m_new, l, w, acc

        zeros = jnp.zeros((B, K, G, block_q), jnp.float32)
        init = (jnp.full((B, K, G, block_q), _MASKED, jnp.float32), zeros, zeros,
                jnp.zeros((B, K, G, block_q, H), jnp.float32))
        m, l, w, acc = lax.fori_loop(kv_lo[i], kv_hi[i], key_block, init)
        # Normalise by the sum of the weights the matmul saw (w, the rounded p), not by l: then the
        # output weights sum to exactly 1, and D = rowsum(dO o O) in the backward cancels the common
        # part of dP as rowsum(P o dP) does (with l, bf16 dq / dk were off by 2 %, here 0.3 %).
        seen = l > 0                                   # False only for padding queries (no key at all)
        out_i = jnp.transpose(acc / jnp.where(seen, w, 1.0)[..., None], (0, 3, 1, 2, 4))  # [B,bq,K,G,H]
        lse_i = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)         # [B, K, G, bq]
        out = lax.dynamic_update_slice_in_dim(out, out_i, q0, 1)
        lse = lax.dynamic_update_slice_in_dim(lse, lse_i, q0, 3)
        return out, lse

    init = (jnp.zeros((B, nq * block_q, K, G, H), jnp.float32),
            jnp.zeros((B, K, G, nq * block_q), jnp.float32))
    out, lse = lax.fori_loop(0, nq, query_block, init)
    return out[:, :T], lse[..., :T]


def _blockwise_backward(q, k, v, segment_ids, out, lse, d_out, block_q, block_k):
    """FlashAttention-2 backward: scores recomputed per block pair from q, k and the saved logsumexp.

    out [B, T, K, G, H] f32, lse [B, K, G, T] f32, d_out [B, T, N, H] -> dq, dk, dv (input dtypes)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    dt = v.dtype
    nq, nk = -(-T // block_q), -(-T // block_k)
    Tq, Tk = nq * block_q, nk * block_k
    scale = 1.0 / math.sqrt(H)
    d_out = _grouped(d_out, K).astype(dt)                                          # [B, T, K, G, H]
    # D = rowsum(dO o O) = rowsum(P o dP) (as P V = O): from the float32 O, so dS keeps its bits
    delta = jnp.transpose(jnp.sum(d_out.astype(jnp.float32) * out, axis=-1), (0, 2, 3, 1))  # [B,K,G,T]
    qg, d_out = _pad_time(_grouped(q, K), Tq), _pad_time(d_out, Tq)                # [B, Tq, K, G, H]
    lse, delta = (jnp.pad(x, [(0, 0)] * 3 + [(0, Tq - T)]) for x in (lse, delta))  # [B, K, G, Tq]
    kp, vp = _pad_time(k, Tk), _pad_time(v, Tk)                                    # [B, Tk, K, H]
    seg_q, seg_k = _pad_time(segment_ids, Tq), _pad_time(segment_ids, Tk)
    _, _, q_lo, q_hi = _block_ranges(segment_ids, block_q, block_k, nq, nk)

    def key_block(j, carry):  # dK_j, dV_j accumulate over query blocks; dQ accumulates in the carry
        dq, dk, dv = carry
        k0 = j * block_k
        k_j = lax.dynamic_slice_in_dim(kp, k0, block_k, 1)                           # [B, bk, K, H]
        v_j = lax.dynamic_slice_in_dim(vp, k0, block_k, 1)
        seg_j = lax.dynamic_slice_in_dim(seg_k, k0, block_k, 1)

        def query_block(i, state):
            dq, dk_j, dv_j = state
            q0 = i * block_q
            q_i = lax.dynamic_slice_in_dim(qg, q0, block_q, 1)                      # [B, bq, K, G, H]
            do_i = lax.dynamic_slice_in_dim(d_out, q0, block_q, 1)
            lse_i = lax.dynamic_slice_in_dim(lse, q0, block_q, 3)                   # [B, K, G, bq]
            delta_i = lax.dynamic_slice_in_dim(delta, q0, block_q, 3)
            vis = _block_visible(lax.dynamic_slice_in_dim(seg_q, q0, block_q, 1), seg_j, q0, k0)
            s = jnp.einsum("bqkgh,bskh->bkgqs", q_i, k_j,
                           preferred_element_type=jnp.float32) * scale              # [B, K, G, bq, bk]
            p = jnp.exp(jnp.where(vis, s - lse_i[..., None], -jnp.inf))             # f32, 0 invisible
            dv_j = dv_j + jnp.einsum("bkgqs,bqkgh->bskh", p.astype(dt), do_i,
                                     preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgh,bskh->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_i[..., None]) * scale).astype(dt)                 # softmax bwd in f32
            dq_i = lax.dynamic_slice_in_dim(dq, q0, block_q, 1) + jnp.einsum(
                "bkgqs,bskh->bqkgh", ds, k_j, preferred_element_type=jnp.float32)
            dk_j = dk_j + jnp.einsum("bkgqs,bqkgh->bskh", ds, q_i, preferred_element_type=jnp.float32)
            return lax.dynamic_update_slice_in_dim(dq, dq_i, q0, 1), dk_j, dv_j

        zeros = jnp.zeros((B, block_k, K, H), jnp.float32)
        dq, dk_j, dv_j = lax.fori_loop(q_lo[j], q_hi[j], query_block, (dq, zeros, zeros))
        dk = lax.dynamic_update_slice_in_dim(dk, dk_j, k0, 1)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_j, k0, 1)
        return dq, dk, dv

    # Accumulators that depend on d_out (+ a zero XLA cannot prove zero, as model._tie_to): input-free
    # zeros were hoisted by XLA:CPU's scheduler far ahead of this layer's backward, so every layer's
    # f32 dQ, dK, dV buffers were alive at once (0.8 GB per layer at 32k tokens, Qwen3-8B widths;
    # benchmarks/learner_memory.py).
    zero = 0 * d_out.reshape(-1)[0].astype(jnp.float32)
    init = (jnp.zeros((B, Tq, K, G, H), jnp.float32) + zero,
            jnp.zeros((B, Tk, K, H), jnp.float32) + zero, jnp.zeros((B, Tk, K, H), jnp.float32) + zero)
    dq, dk, dv = lax.fori_loop(0, nk, key_block, init)
    return (dq[:, :T].reshape(q.shape).astype(q.dtype), dk[:, :T].astype(k.dtype),
            dv[:, :T].astype(v.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blockwise(q, k, v, segment_ids, block_q, block_k):
    out, _ = _blockwise_forward(q, k, v, segment_ids, block_q, block_k)
    return out.reshape(q.shape).astype(q.dtype)


def _blockwise_fwd(q, k, v, segment_ids, block_q, block_k):
    out, lse = _blockwise_forward(q, k, v, segment_ids, block_q, block_k)
    # out stays float32 for D = rowsum(dO o O): from a bf16-rounded O, dP - D loses its bits
    # (dq / dk off by 5-10 % instead of 0.3 % in the bf16 test); for float32 inputs it is the output.
    return out.reshape(q.shape).astype(q.dtype), (q, k, v, segment_ids, out, lse)


def _blockwise_bwd(block_q, block_k, res, d_out):
    q, k, v, segment_ids, out, lse = res
    return (*_blockwise_backward(q, k, v, segment_ids, out, lse, d_out, block_q, block_k), None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q, k, v, segment_ids, *, block_q: int | None = None, block_k: int | None = None):
    """FlashAttention-2 in plain JAX (module doc): memory O(B T N H + B N block_q block_k).

    Block sizes default per backend (_DEFAULT_BLOCKS); a T shorter than a block is one block, and a T
    that is not a multiple is padded internally with segment id 0 and sliced back."""
    default_q, default_k = _DEFAULT_BLOCKS.get(jax.default_backend(), _DEFAULT_BLOCKS["cpu"])
    T = q.shape[1]
    block_q, block_k = (default_q if block_q is None else block_q), (default_k if block_k is None else block_k)
    if block_q < 1 or block_k < 1:
        raise ConfigError(f"block_q={block_q}, block_k={block_k}: use positive block sizes (or None)")
    block_q, block_k = min(int(block_q), T), min(int(block_k), T)
    return _blockwise(q, k, v, segment_ids.astype(jnp.int32), block_q, block_k)


# ----------------------------------------------------------------------------- cudnn

_logger = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(message):
    if message not in _warned:
        _warned.add(message)
        _logger.warning(message)


def _one_segment_per_row(segment_ids):
    """True when every row is one segment from position 0 followed by padding (or all padding)."""
    real = segment_ids > 0
    lengths = jnp.sum(real, axis=1)                                                 # [B]
    prefix = real == (jnp.arange(segment_ids.shape[1])[None] < lengths[:, None])
    one_id = (segment_ids == segment_ids[:, :1]) | ~real
    return jnp.all(prefix & one_id)


def _lengths_attention(q, k, v, segment_ids, implementation):
    """Rows of one segment from position 0 then padding, as causal + per-row length (what
    jax.nn.dot_product_attention expresses without a [B, T, T] mask)."""
    real = segment_ids > 0                                                          # [B, T]
    # an all-padding row runs as length 1 (no zero-length edge case); its output is zeroed below
    lengths = jnp.maximum(jnp.sum(real, axis=1, dtype=jnp.int32), 1)                # [B]
    keep = real[:, :, None, None]
    # zeroed inputs at padding: whatever the kernel computes there gets no gradient and no NaN
    q, k, v = (jnp.where(keep, x, jnp.zeros((), x.dtype)) for x in (q, k, v))
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                       key_value_seq_lengths=lengths, implementation=implementation)
    return jnp.where(keep, out, jnp.zeros((), out.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def lengths_attention(q, k, v, segment_ids, implementation="cudnn"):
    """jax.nn.dot_product_attention(implementation=...) when every row is one segment starting at
    position 0 (right padding), else blockwise_attention: chosen per call on device (lax.cond).

    The backward recomputes the chosen branch's forward (jax.vjp inside the same lax.cond), so the
    residuals are only the inputs. implementation='xla' runs the same path on any backend (tests)."""
    return lax.cond(_one_segment_per_row(segment_ids),
                    partial(_lengths_attention, implementation=implementation),
                    blockwise_attention, q, k, v, segment_ids)


def _lengths_attention_fwd(q, k, v, segment_ids, implementation):
    return lengths_attention(q, k, v, segment_ids, implementation), (q, k, v, segment_ids)


def _lengths_attention_bwd(implementation, res, d_out):
    q, k, v, segment_ids = res

    def grads_of(fn):
        def grads(q, k, v, segment_ids, d_out):
            return jax.vjp(lambda q, k, v: fn(q, k, v, segment_ids), q, k, v)[1](d_out)
        return grads

    d_q, d_k, d_v = lax.cond(_one_segment_per_row(segment_ids),
                             grads_of(partial(_lengths_attention, implementation=implementation)),
                             grads_of(blockwise_attention), q, k, v, segment_ids, d_out)
    return d_q, d_k, d_v, None


lengths_attention.defvjp(_lengths_attention_fwd, _lengths_attention_bwd)


def _cudnn_unsupported(q) -> str | None:
    """Why cuDNN flash attention cannot take these inputs (its documented limits), or None."""
    H = q.shape[-1]
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN attention takes bf16/fp16 inputs, got {q.dtype}"
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    h_max = 256 if tuple(int(x) for x in str(capability).split(".")) >= (9, 0) else 128
    if H % 8 or H > h_max:
        return f"cuDNN attention needs head_dim a multiple of 8 and <= {h_max}, got {H}"
    return None


def cudnn_attention(q, k, v, segment_ids):
    """cuDNN flash attention for rows of one segment from position 0 (module doc, 'cudnn');
    blockwise for packed rows / left padding (per call) and for inputs cuDNN does not take (logged)."""
    reason = _cudnn_unsupported(q)
    if reason is not None:
        _warn_once(f"attention_impl='cudnn': {reason}; using 'blockwise'")
        return blockwise_attention(q, k, v, segment_ids)
    _warn_once("attention_impl='cudnn': rows that pack several segments or are left-padded run "
               "'blockwise' (jax.nn.dot_product_attention has no segment ids); checked per call")
    return lengths_attention(q, k, v, segment_ids, "cudnn")


# ----------------------------------------------------------------------------- splash (TPU)

_SPLASH_LANES = 128  # splash tiles: sequence blocks and head_dim in multiples of the TPU lane width


@functools.lru_cache(maxsize=32)
def _splash_kernel(num_heads, seq_len, block, interpret):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash
    mask = splash.MultiHeadMask([splash.CausalMask((seq_len, seq_len))] * num_heads)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    with jax.ensure_compile_time_eval():  # the cached kernel holds concrete mask tables, no tracer
        return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                      interpret=interpret)


def splash_attention(q, k, v, segment_ids, *, interpret: bool = False):
    """TPU splash attention: causal mask and SegmentIds, GQA by its MHA kernel (query head n reads
    kv head n // G). T is padded to a multiple of 128 with segment id 0 (padding queries see the
    padding keys, so no softmax row is empty; their output is zeroed). head_dim not a multiple of
    128: blockwise (logged); rows with shared-prompt continuations: blockwise (per call). interpret=True runs the Pallas kernel on any backend (tests, slow)."""
    B, T, N, H = q.shape
    if H % _SPLASH_LANES:
        _warn_once(f"attention_impl='splash': head_dim {H} is not a multiple of {_SPLASH_LANES}; "
                   "using 'blockwise'")
        return blockwise_attention(q, k, v, segment_ids)
    # splash's SegmentIds mask is equality only: rows with shared-prompt continuations run blockwise
    return lax.cond(has_continuations(segment_ids), blockwise_attention,
                    partial(_splash_path, interpret=interpret), q, k, v, segment_ids)


def _splash_path(q, k, v, segment_ids, *, interpret: bool):
    B, T, N, H = q.shape
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds
    Tp = -(-T // _SPLASH_LANES) * _SPLASH_LANES
    block = next(b for b in (512, 256, 128) if Tp % b == 0)
    kernel = _splash_kernel(N, Tp, block, interpret)
    segment_ids = _pad_time(segment_ids.astype(jnp.int32), Tp)                      # [B, Tp]
    heads_first = lambda x: jnp.swapaxes(_pad_time(x, Tp), 1, 2)                    # [B, heads, Tp, H]
    q = (q.astype(jnp.float32) * (1.0 / math.sqrt(H))).astype(q.dtype)  # splash does not scale
    out = jax.vmap(kernel)(heads_first(q), heads_first(k), heads_first(v),
                           SegmentIds(q=segment_ids, kv=segment_ids))               # [B, N, Tp, H]
    out = jnp.swapaxes(out, 1, 2)[:, :T]                                            # [B, T, N, H]
    return jnp.where(segment_ids[:, :T, None, None] > 0, out, jnp.zeros((), out.dtype))


# ----------------------------------------------------------------------------- dispatch

def _platform() -> str:
    """'gpu' (CUDA), 'rocm', 'tpu' or 'cpu' for the default backend."""
    backend = jax.default_backend()
    if backend in ("gpu", "cuda"):
        version = getattr(jax.devices()[0].client, "platform_version", "")
        return "rocm" if "rocm" in str(version).lower() else "gpu"
    return backend


def resolve_attention_impl(impl: str, backend: str | None = None) -> str:
    """'auto' -> 'cudnn' on a CUDA GPU, 'splash' on TPU, 'blockwise' elsewhere; an explicit impl is
    checked against the backend (default: jax.default_backend()) and returned."""
    backend = _platform() if backend is None else {"cuda": "gpu"}.get(backend, backend)
    if impl == "auto":
        return {"gpu": "cudnn", "tpu": "splash"}.get(backend, "blockwise")
    if impl not in IMPLS:
        raise ConfigError(f"attention_impl={impl!r}; use one of {('auto',) + IMPLS}")
    if impl == "cudnn" and backend != "gpu":
        raise ConfigError(f"attention_impl='cudnn' needs a GPU (backend here: {backend}); "
                          "use 'blockwise' (or 'auto')")
    if impl == "splash" and backend != "tpu":
        raise ConfigError(f"attention_impl='splash' needs a TPU (backend here: {backend}); "
                          "use 'blockwise' (or 'auto')")
    return impl


def attention(q, k, v, segment_ids, *, impl: str = "dense"):
    """Dispatch to one implementation (module doc); every one computes the same function."""
    impl = resolve_attention_impl(impl)
    if impl == "dense":
        return dense_attention(q, k, v, segment_ids)
    if impl == "blockwise":
        return blockwise_attention(q, k, v, segment_ids)
    if impl == "cudnn":
        return cudnn_attention(q, k, v, segment_ids)
    return splash_attention(q, k, v, segment_ids)
