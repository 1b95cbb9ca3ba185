"""Causal self-attention over rows that may pack several sequences (segment ids), with GQA.

    out[b, t] = sum_s softmax_s(q[b, t] · k[b, s] / sqrt(H) | visible(b, t, s)) v[b, s]
    visible(b, t, s) = s <= t  and  seg[b, s] == seg[b, t]  and  seg[b, t] > 0

Segment id 0 marks padding: a padding query sees no key and its output is exactly 0; a real query
never sees a padding key or another segment. Segments are contiguous runs within a row, so causal
order by row index is causal order within each segment.

Shapes: q [B, T, N, H], k/v [B, T, K, H] (N = K * G query heads share each kv head),
segment_ids [B, T] int32 -> out [B, T, N, H] in q's dtype. Matmul inputs in the compute dtype,
float32 accumulation, float32 softmax and softmax backward.

Implementations (`attention(..., impl=)`):
    dense      the reference: materialises [B, K, G, T, T] float32 scores (memory quadratic in T).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

IMPLS = ("dense",)

_MASKED = -1e30  # finite, so a row with no visible key never makes NaN (its probabilities are zeroed)


def _grouped(q, num_kv_heads):  # [B, T, N, H] -> [B, T, K, G, H], G = N // K query heads per kv head
    B, T, N, H = q.shape
    return q.reshape(B, T, num_kv_heads, N // num_kv_heads, H)


def visible_mask(segment_ids):
    """[B, T] segment ids -> [B, T, S] bool: causal, same segment, real (non-padding) query."""
    seg = segment_ids
    T = seg.shape[-1]
    causal = jnp.tril(jnp.ones((T, T), bool))                                       # [T, S]
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)             # [B, T, S]
    return causal[None] & same


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


def attention(q, k, v, segment_ids, *, impl: str = "dense"):
    """Dispatch to one implementation (module doc); every one computes the same function."""
    if impl == "dense":
        return dense_attention(q, k, v, segment_ids)
    raise ValueError(f"attention_impl={impl!r}; use one of {IMPLS}")
