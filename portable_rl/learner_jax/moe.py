"""Mixture-of-experts feed-forward block (Qwen3-MoE, Qwen2-MoE), transformers' numerics.

For N tokens x [N, D] (the post-attention RMSNorm output), E experts of SwiGLU width F, top-k K:

    router_logits = x @ W_router                       [N, E] float32
    p             = softmax(router_logits)              [N, E] float32
    experts       = top_k(p, K)                        [N, K] int32   (or the forced experts, below)
    w             = p[experts]                          [N, K] float32
    w             = w / Σ_k w                           only with norm_topk_prob
    y             = Σ_k w_k · SwiGLU_{experts_k}(x)     [N, D]
    qwen2_moe:  y = y + sigmoid(x @ w_shared_gate) · SwiGLU_shared(x)       (one always-on expert)

Dispatch (capacity-free, static shapes): the N·K (token, slot) pairs are sorted by expert
(`argsort` of the flattened expert ids), group_sizes[e] counts the pairs of expert e, and each SwiGLU
matmul is one grouped matmul over the sorted rows, `jax.lax.ragged_dot(x_sorted [N·K, D],
W [E, D, F], group_sizes [E])`: row r is multiplied by the weights of the expert whose group holds it.
The outputs are put back in (token, slot) order with the inverse permutation and mixed with w. No
token is dropped and no slot padded, so the block equals the all-experts reference
Σ_e mask_e · w_e · SwiGLU_e(x) exactly (tests/test_moe.py keeps that reference).

Routing replay: `forced_experts` [N, K] replaces the block's own top-k; the gate weights are still
p gathered at those experts (renormalised if norm_topk_prob), so the router gets gradients. The
block always returns its own top-k too, so agreement with a replayed routing can be measured; with
forced = own top-k the output is bitwise the unforced one (the same gather).

Precision: the router's logits are float32 (compute-dtype inputs, float32 accumulation; transformers
keeps them in the model dtype, which is the same thing in fp32), the softmax, top-k and w are float32
(as in transformers), the expert matmuls take compute-dtype inputs with float32 accumulation and return
the compute dtype (like `Linear`), and the mix Σ_k w_k · y_k is float32.

`load_balancing_loss` is transformers' auxiliary loss (`load_balancing_loss_func`), for RL recipes that
want it (off by default: RL fine-tuning usually leaves the router's balance to the pre-training).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx


class Routing(NamedTuple):
    """What a sparse layer's router did, per token (N = B·T flattened rows)."""
    logits: jax.Array     # [N, E] float32 router logits (for a load-balancing loss)
    experts: jax.Array    # [N, K] int32, the router's own top-k (even when experts were forced)


class Experts(nnx.Module):
    """E SwiGLU experts, weights stacked [E, in, out] (kernels are [in, out], as in `Linear`)."""

    def __init__(self, num_experts: int, hidden: int, width: int, *, param_dtype, compute_dtype,
                 rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.gate_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, width), param_dtype))  # [E, D, F]
        self.up_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, width), param_dtype))    # [E, D, F]
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, width, hidden), param_dtype))  # [E, F, D]
        self.compute_dtype = compute_dtype

    def _grouped(self, rows, weights, group_sizes):  # [M, in] x [E, in, out] -> [M, out] compute dtype
        c = self.compute_dtype
        return jax.lax.ragged_dot(rows.astype(c), weights.astype(c), group_sizes,
                                  preferred_element_type=jnp.float32).astype(c)

    def __call__(self, x, experts):  # x [N, D], experts [N, K] int -> [N, K, D] compute dtype
        N, K = experts.shape
        flat = experts.reshape(-1)                                        # [N·K] expert of each pair
        order = jnp.argsort(flat, stable=True)                            # [N·K] pairs sorted by expert
        group_sizes = jnp.bincount(flat, length=self.gate_proj.shape[0]).astype(jnp.int32)  # [E]
        rows = x[order // K]                                              # [N·K, D] token of each pair
        h = (jax.nn.silu(self._grouped(rows, self.gate_proj[...], group_sizes))
             * self._grouped(rows, self.up_proj[...], group_sizes))       # [N·K, F]
        y_sorted = self._grouped(h, self.down_proj[...], group_sizes)     # [N·K, D]
        return y_sorted[jnp.argsort(order)].reshape(N, K, -1)             # back to (token, slot) order


def route(logits, top_k: int, norm_topk_prob: bool, forced_experts=None):
    """Router logits [N, E] float32 -> (experts used [N, K] int32, gate weights w [N, K] float32,
    the router's own top-k [N, K] int32). `forced_experts` [N, K] (routing replay) replaces the own
    top-k; w is p gathered at the experts used either way."""
    probs = jax.nn.softmax(logits, axis=-1)                               # [N, E] f32
    _, own = jax.lax.top_k(probs, top_k)                                  # [N, K]
    experts = own if forced_experts is None else forced_experts.astype(own.dtype)
    weights = jnp.take_along_axis(probs, experts, axis=-1)                # [N, K] f32
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights, own


def load_balancing_loss(router_logits, top_k: int, token_mask=None):
    """transformers' MoE auxiliary loss over every sparse layer's tokens together (a scalar):

        E · Σ_e f_e · P_e,   f_e = share of (token, layer) rows with e among their top-k experts,
                             P_e = mean router probability of e over the same rows

    `router_logits` [S, N, E] (S sparse layers, N = B·T tokens); `token_mask` [N] 0/1 keeps padding out
    (transformers' `attention_mask`). Multiply by a coefficient (transformers' router_aux_loss_coef, 1e-3)."""
    S, N, E = router_logits.shape
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)              # [S, N, E]
    _, experts = jax.lax.top_k(probs, top_k)                                        # [S, N, K]
    chosen = jnp.sum(jax.nn.one_hot(experts, E, dtype=jnp.float32), axis=-2)       # [S, N, E] 0/1
    mask = jnp.ones((N,), jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
    rows = jnp.maximum(S * jnp.sum(mask), 1.0)
    share = jnp.einsum("sne,n->e", chosen, mask) / rows                             # [E] f_e (summed over k)
    mean_prob = jnp.einsum("sne,n->e", probs, mask) / rows                          # [E] P_e
    return E * jnp.sum(share * mean_prob)
