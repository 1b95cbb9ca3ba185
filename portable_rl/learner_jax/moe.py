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
The outputs are put back in (token, slot) order with the inverse permutation and mixed with w
(`grouped_swiglu`). On a mesh, `Experts.dispatch` says where the sort runs and how weights and tokens move
(GSPMD's partition of it, or each device's own rows in a shard_map with the weights all-gathered inside); with
an `expert` mesh axis the experts are split over devices and tokens exchanged inside a shard_map. No token is
dropped and no slot padded, so the block computes the all-experts function Σ_e w_e · SwiGLU_e(x) (w_e = 0 off
the top-k) up to float32 summation order (tests/test_moe.py keeps that dense reference and checks the gradients
against it, and both dispatches against one device on 8 host devices).

Routing replay: `forced_experts` [N, K] replaces the block's own top-k; the gate weights are still
p gathered at those experts (renormalised if norm_topk_prob), so the router gets gradients. A row
with a negative id (-1: the engine gave no routing for that token, e.g. padding) keeps the block's
own top-k. The block always returns its own top-k too, so agreement with a replayed routing can be
measured; with forced = own top-k the output is bitwise the unforced one (the same gather).

Precision: the router's logits are float32 (compute-dtype inputs, float32 accumulation; transformers
keeps them in the model dtype, which is the same thing in fp32), the softmax, top-k and w are float32
(as in transformers), the expert matmuls take compute-dtype inputs with float32 accumulation and return
the compute dtype (like `Linear`), and the mix Σ_k w_k · y_k is float32.

`load_balancing_loss` is transformers' auxiliary loss (`load_balancing_loss_func`); the RL loss adds it
with `LossConfig.router_aux_loss_coef`, 0 (off) by default: RL recipes leave the router's balance to
pre-training.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from portable_rl.errors import ConfigError
from portable_rl.learner_jax.sharding import expert_parallel_size, logical_to_spec, row_spec


class Routing(NamedTuple):
    """What a sparse layer's router did, per token (N = B·T flattened rows)."""
    logits: jax.Array     # [N, E] float32 router logits (for a load-balancing loss)
    experts: jax.Array    # [N, K] int32, the router's own top-k (even when experts were forced)


class Experts(nnx.Module):
    """E SwiGLU experts, weights stacked [E, in, out] (kernels are [in, out], as in `Linear`):
    `experts(x [N, D], experts [N, K], weights [N, K]) -> Σ_k w_k · SwiGLU_{e_k}(x)  [N, D] float32`.

    Dispatch on a mesh set with `jax.set_mesh` (`dispatch`, chosen in learner_jax/memory.py):

      "gspmd"  the weights are gathered by GSPMD. Without an `expert` axis the sort by expert is
               partitioned by GSPMD, which gathers the pairs of every device's rows (the global token
               set); with one, a shard_map over `expert` runs the token exchange below.
      "local"  one shard_map over the whole mesh: each device sorts its own rows, all-gathers its
               experts' weights over `fsdp` inside (the gradient's transpose: a reduce-scatter, so no
               layer's full weight gradient outlives its backward), and with an `expert` axis
               exchanges tokens as below; a `tensor`-split expert width is summed with a psum.

    Token exchange over an `expert` axis of size P (must divide E): each device holds E / P experts and
    the tokens of its batch rows; the P devices of an expert group all-gather their tokens (and routing),
    each runs its own experts on the pairs routed to them (the others contribute 0), and a reduce-scatter
    sums the partial outputs back onto the devices the tokens came from (Megatron's all-gather token
    dispatcher). No device ever holds more than its group's tokens or its own experts."""

    def __init__(self, num_experts: int, hidden: int, width: int, *, param_dtype, compute_dtype,
                 rngs: nnx.Rngs, dispatch: str = "gspmd"):
        init = nnx.initializers.normal(0.02)
        self.gate_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, width), param_dtype))  # [E, D, F]
        self.up_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, width), param_dtype))    # [E, D, F]
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, width, hidden), param_dtype))  # [E, F, D]
        self.compute_dtype = compute_dtype
        self.dispatch = dispatch

    def __call__(self, x, experts, weights):
        params = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        num_experts = params[0].shape[0]
        mesh = jax.sharding.get_abstract_mesh()
        ways = expert_parallel_size()
        if num_experts % ways:
            raise ConfigError(f"the mesh's expert axis ({ways} devices) does not divide num_experts={num_experts}; "
                              f"set MeshConfig(expert=...) to a divisor of {num_experts}")
        if self.dispatch == "local" and not mesh.empty and mesh.size > 1:
            return self.local_dispatch(x, experts, weights, *params, mesh=mesh, ways=ways)
        if ways == 1:
            return grouped_swiglu(x, experts, weights, *params, first_expert=0, compute_dtype=self.compute_dtype)
        rows = row_spec()

        def local(x, experts, weights, gate, up, down):  # this device's rows and E / P experts
            gathered = [jax.lax.all_gather(a, "expert", axis=0, tiled=True) for a in (x, experts, weights)]
            first = jax.lax.axis_index("expert") * gate.shape[0]
            y = grouped_swiglu(*gathered, gate, up, down, first_expert=first, compute_dtype=self.compute_dtype)
            return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)   # [rows, D]

        experts_spec = PartitionSpec("expert")
        return jax.shard_map(local, in_specs=(rows, rows, rows, experts_spec, experts_spec, experts_spec),
                             out_specs=rows)(x, experts, weights, *params)

    def local_dispatch(self, x, experts, weights, gate, up, down, *, mesh, ways):
        """The "local" dispatch (class doc): the weights enter the shard_map as they are stored
        (sharding.py's specs), so nothing is gathered outside it."""
        rows = row_spec()
        in_spec = logical_to_spec(("experts", "embed", "mlp"), gate.shape, mesh)     # gate, up [E, D, F]
        out_spec = logical_to_spec(("experts", "mlp", "embed"), down.shape, mesh)    # down [E, F, D]
        _, embed, width = in_spec                                                   # mesh axes of D, F

        def gather(w, axis_name, axis):
            return w if axis_name is None else jax.lax.all_gather(w, axis_name, axis=axis, tiled=True)

        def local(x, experts, weights, gate, up, down):  # [rows, ·] here; [E / P, D / fsdp, F / tensor] here
            # The gathers wait for this layer's rows: a weight is available from the start, and XLA:CPU's
            # scheduler otherwise gathers every layer's experts at once (0 * x: XLA cannot prove it zero).
            zero = 0 * x[0, 0]
            gate, up, down = (w + zero.astype(w.dtype) for w in (gate, up, down))
            gate, up, down = gather(gate, embed, 1), gather(up, embed, 1), gather(down, embed, 2)  # [E / P, D, ·]
            first = 0
            if ways > 1:
                x, experts, weights = (jax.lax.all_gather(a, "expert", axis=0, tiled=True)
                                       for a in (x, experts, weights))                  # the group's rows
                first = jax.lax.axis_index("expert") * gate.shape[0]
            y = grouped_swiglu(x, experts, weights, gate, up, down, first_expert=first,
                               compute_dtype=self.compute_dtype)                        # [rows (· P), D] f32
            if width is not None:
                y = jax.lax.psum(y, width)                                              # partial sums over F
            if ways > 1:
                y = jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)  # [rows, D]
            return y

        return jax.shard_map(local, in_specs=(rows, rows, rows, in_spec, in_spec, out_spec),
                             out_specs=rows)(x, experts, weights, gate, up, down)


def grouped_swiglu(x, experts, weights, gate, up, down, *, first_expert, compute_dtype):
    """Σ_k w_k · SwiGLU_{e_k}(x) [M, D] float32 over the experts first_expert .. first_expert + E_l - 1
    held here (gate, up [E_l, D, F], down [E_l, F, D]); pairs routed elsewhere contribute 0.
    x [M, D], experts [M, K] int, weights [M, K] float32."""
    M, K = experts.shape
    held = gate.shape[0]
    local = experts.reshape(-1) - first_expert                            # [M·K] expert of each pair, here
    mine = (local >= 0) & (local < held)
    key = jnp.where(mine, local, held)                                    # pairs held elsewhere sort last
    order = jnp.argsort(key, stable=True)                                 # [M·K] pairs sorted by expert
    group_sizes = jnp.bincount(key, length=held + 1)[:held].astype(jnp.int32)  # [E_l]; the rest: no group

    def grouped(rows, w):  # [M·K, in] x [E_l, in, out] -> [M·K, out]; rows past the groups -> 0
        return jax.lax.ragged_dot(rows.astype(compute_dtype), w.astype(compute_dtype), group_sizes,
                                  preferred_element_type=jnp.float32).astype(compute_dtype)

    inverse = jnp.argsort(order)                                          # [M·K] position of each pair
    rows = permute_rows(jnp.repeat(x, K, axis=0), order, inverse)         # [M·K, D] token of each pair
    h = jax.nn.silu(grouped(rows, gate)) * grouped(rows, up)              # [M·K, F]
    y_pairs = permute_rows(grouped(h, down), inverse, order).reshape(M, K, -1)  # back to (token, slot) order
    y_pairs = jnp.where(mine.reshape(M, K, 1), y_pairs.astype(jnp.float32), 0.0)
    return jnp.einsum("mk,mkd->md", weights, y_pairs)                     # [M, D] f32


@jax.custom_vjp
def permute_rows(x, perm, inverse):
    """x[perm] for a permutation `perm` of x's rows, `inverse` = argsort(perm). Its transpose is the gather
    g[inverse]: JAX's own transpose of a gather is a scatter-add into a zero buffer of x's size, and XLA
    allocated that [M·K, D] f32 buffer for every layer at the start of the step (the per-layer part of the
    planned temporaries; docs/experiments/moe.md)."""
    return x[perm]


def _permute_rows_fwd(x, perm, inverse):
    return x[perm], inverse


def _permute_rows_bwd(inverse, g):
    return g[inverse], None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def route(logits, top_k: int, norm_topk_prob: bool, forced_experts=None):
    """Router logits [N, E] float32 -> (experts used [N, K] int32, gate weights w [N, K] float32,
    the router's own top-k [N, K] int32). `forced_experts` [N, K] (routing replay) replaces the own
    top-k, except in rows holding a negative id (no replayed routing: own top-k); w is p gathered at the
    experts used either way."""
    probs = jax.nn.softmax(logits, axis=-1)                               # [N, E] f32
    _, own = jax.lax.top_k(probs, top_k)                                  # [N, K]
    experts = own
    if forced_experts is not None:
        forced = forced_experts.astype(own.dtype)
        experts = jnp.where(jnp.all(forced >= 0, axis=-1, keepdims=True), forced, own)
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
