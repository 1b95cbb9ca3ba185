"""Decoder-only transformer in Flax NNX covering Qwen2, Qwen3, Llama 3, Qwen3-MoE and Qwen2-MoE (HF numerics).

  x_0     = embed[input_ids]
  h       = x_l + o_proj(attn(rope(q_norm(W_q n(x_l))), rope(k_norm(W_k n(x_l))), W_v n(x_l)))
  x_{l+1} = h + W_down(silu(W_gate n(h)) * W_up n(h))                     (SwiGLU)
  x_{l+1} = h + Σ_k w_k SwiGLU_{e_k}(n(h)) [+ shared expert]              (MoE layers, moe.py)
  logits  = final_norm(x_L) @ W_lm_head   (W_lm_head = embed^T when tied), float32

n(.) is RMSNorm: gain * x * rsqrt(mean(x^2) + eps) in float32, cast to the compute dtype.
RoPE uses HF's rotate_half convention: q' = q cos + rotate_half(q) sin, with the two halves of
head_dim holding the same frequencies. Attention is causal and ignores padded keys; positions are
cumsum(attention_mask) - 1, so left- and right-padded rows see the same positions as unpadded ones.

Parameters are stored in `param_dtype` (default float32 master weights) and cast to `compute_dtype`
(default bfloat16) for matmuls (float32 accumulation). The residual stream, norms, RoPE, attention
softmax and its backward, and the logits are float32: bf16 RoPE and a bf16 softmax backward biased
bf16-compute gradients (docs/models.md, "bf16 gradients").
Kernels are [in, out] (HF stores [out, in]; `convert/mapping.py` transposes).

Memory knobs (`Transformer(..., attention_impl=, remat=, moe_dispatch=)`, chosen in learner_jax/memory.py), for a row
of T tokens, L layers, width D, ffn F:
    attention_impl  'dense' keeps [B, heads, T, T] f32 probabilities per layer; the others
                    (attention.py) O(T) per layer
    remat='none'    each layer's activations (~ T · (6 D + 3 F) values) live from its forward to
                    its backward: memory ~ L · that
    remat='full'    each layer keeps only its input x_l [B, T, D] f32 and re-runs its forward in the
                    backward (`remat_function`): memory ~ L · T · D · 4 B + one layer's activations,
                    for about one more forward pass of compute
    remat=<policy>  a `jax.checkpoint_policies` name: keep what it saves (matmul outputs), re-run the rest
    moe_dispatch    where a sparse layer's sort by expert runs on a mesh (moe.py, `Experts`)
Packed rows (segment ids + per-segment positions, `hidden_states`) give each sequence exactly the
hidden states it has alone in a row.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from portable_rl.errors import ConfigError
from portable_rl.learner_jax import attention as attention_lib
from portable_rl.learner_jax.attention import attention
from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.dense import dense
from portable_rl.learner_jax.memory import MOE_DISPATCHES, REMAT_POLICIES
from portable_rl.learner_jax.moe import Experts, Routing, route
from portable_rl.learner_jax.sharding import constrain_batch_rows


class Linear(nnx.Module):
    """y = x @ kernel (+ bias) in the compute dtype, float32 accumulation forward and backward
    (dense.py says why not `nnx.Linear`). Parameter names and init match `nnx.Linear`."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, param_dtype,
                 compute_dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (in_features, out_features),
                                                              param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None
        self.compute_dtype = compute_dtype
        self.record_input_absmax = False  # static; on only while convert.smoothing calibrates (eager)

    def __call__(self, x):  # [..., in] -> [..., out] compute dtype
        if self.record_input_absmax:  # per input channel max |x| over every position: [in]
            self.sow(nnx.Intermediate, "input_absmax", jnp.max(jnp.abs(x.astype(jnp.float32)).reshape(-1, x.shape[-1]),
                                                               axis=0))
        y = dense(x, self.kernel[...], self.compute_dtype, self.compute_dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.compute_dtype)
        return y


class RMSNorm(nnx.Module):
    """RMSNorm in float32 (normalise, times the gain); the output is cast to the compute dtype
    because it only feeds matmuls."""

    def __init__(self, dim: int, eps: float, *, param_dtype, compute_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.compute_dtype = compute_dtype

    def __call__(self, x):  # [..., dim]
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.scale[...].astype(jnp.float32) * y).astype(self.compute_dtype)


def rope_inv_freq(config: ModelConfig) -> jnp.ndarray:
    """Inverse frequencies [head_dim // 2] in float32, with Llama-3 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if config.rope_type == "llama3":
        s = config.rope_scaling
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
        scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = jnp.where(is_medium, smoothed, scaled)
    return inv_freq


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, cos, sin):  # x [B, T, N, H], cos/sin [B, T, H] float32; rotation in float32
    x32 = x.astype(jnp.float32)
    return (x32 * cos[:, :, None, :] + rotate_half(x32) * sin[:, :, None, :]).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        c = config
        d, h, n, k = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
        linear = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
        self.q_proj = Linear(d, n * h, use_bias=c.qkv_bias, **linear)
        self.k_proj = Linear(d, k * h, use_bias=c.qkv_bias, **linear)
        self.v_proj = Linear(d, k * h, use_bias=c.qkv_bias, **linear)
        self.o_proj = Linear(n * h, d, use_bias=c.o_proj_bias, **linear)
        if c.qk_norm:
            norm = dict(param_dtype=param_dtype, compute_dtype=compute_dtype)
            self.q_norm = RMSNorm(h, c.rms_norm_eps, **norm)
            self.k_norm = RMSNorm(h, c.rms_norm_eps, **norm)
        self.qk_norm = c.qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        self.attention_impl = "dense"  # set by Transformer (attention.IMPLS)

    def __call__(self, x, cos, sin, segment_ids):  # x [B, T, D], segment_ids [B, T] int (0 = padding)
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, segment_ids, impl=self.attention_impl)   # [B, T, N, H]
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, intermediate_size: int | None = None, param_dtype, compute_dtype,
                 rngs: nnx.Rngs):
        d, f = config.hidden_size, intermediate_size or config.intermediate_size
        linear = dict(use_bias=False, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
        self.gate_proj = Linear(d, f, **linear)
        self.up_proj = Linear(d, f, **linear)
        self.down_proj = Linear(f, d, **linear)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nnx.Module):
    """Routed experts (+ Qwen2-MoE's sigmoid-gated shared expert), formulas in moe.py:
    `block(x [B, T, D], forced_experts [B·T, K] | None) -> (y [B, T, D] compute dtype, Routing)`."""

    def __init__(self, config: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs,
                 moe_dispatch: str = "gspmd"):
        d, shared = config.hidden_size, config.shared_expert_intermediate_size
        linear = dict(use_bias=False, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
        self.router = Linear(d, config.num_experts, **linear)
        self.experts = Experts(config.num_experts, d, config.moe_intermediate_size, param_dtype=param_dtype,
                               compute_dtype=compute_dtype, rngs=rngs, dispatch=moe_dispatch)
        if shared:
            self.shared_expert = MLP(config, intermediate_size=shared, param_dtype=param_dtype,
                                     compute_dtype=compute_dtype, rngs=rngs)
            self.shared_expert_gate = Linear(d, 1, **linear)
        self.has_shared_expert = bool(shared)
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.compute_dtype = compute_dtype

    def __call__(self, x, forced_experts=None):
        B, T, D = x.shape
        x = x.reshape(B * T, D)                                                   # [N, D]
        logits = dense(x, self.router.kernel[...], self.compute_dtype, jnp.float32)  # [N, E] f32
        experts, weights, own = route(logits, self.top_k, self.norm_topk_prob, forced_experts)  # [N, K] each
        y = self.experts(x, experts, weights)                                      # [N, D] f32
        if self.has_shared_expert:
            gate = jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32))  # [N, 1]
            y = y + gate * self.shared_expert(x).astype(jnp.float32)
        return y.astype(self.compute_dtype).reshape(B, T, D), Routing(logits, own)


class DecoderLayer(nnx.Module):
    """`layer(x, cos, sin, segment_ids, forced_experts=None) -> (x, Routing | None)`: Routing only
    for a sparse (MoE) layer."""

    def __init__(self, config: ModelConfig, *, sparse: bool = False, param_dtype, compute_dtype,
                 rngs: nnx.Rngs, moe_dispatch: str = "gspmd"):
        dtypes = dict(param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dtypes)
        self.attn = Attention(config, **dtypes, rngs=rngs)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dtypes)
        self.mlp = (MoEBlock(config, **dtypes, rngs=rngs, moe_dispatch=moe_dispatch) if sparse
                    else MLP(config, **dtypes, rngs=rngs))
        self.sparse = sparse

    def __call__(self, x, cos, sin, segment_ids, forced_experts=None):  # x [B, T, D] float32 residual stream
        x = x + self.attn(self.input_norm(x), cos, sin, segment_ids).astype(jnp.float32)
        if not self.sparse:
            return x + self.mlp(self.post_attn_norm(x)).astype(jnp.float32), None
        y, routing = self.mlp(self.post_attn_norm(x), forced_experts)
        return x + y.astype(jnp.float32), routing


def resolve_attention_impl(impl: str) -> str:
    """'auto' -> the attention module's choice for this backend; any other name is checked.

    Uses `attention.resolve_attention_impl` where it exists; without it 'auto' means 'blockwise' if
    that implementation is there, else 'dense'."""
    resolver = getattr(attention_lib, "resolve_attention_impl", None)
    if resolver is not None:
        return resolver(impl)
    if impl == "auto":
        return "blockwise" if "blockwise" in attention_lib.IMPLS else "dense"
    if impl not in attention_lib.IMPLS:
        raise ValueError(f"attention_impl={impl!r}; use one of {('auto',) + tuple(attention_lib.IMPLS)}")
    return impl


def resolve_remat(remat) -> str:
    """A name from `memory.REMAT_POLICIES` ('none', 'full' or a `jax.checkpoint_policies` name)."""
    if remat not in REMAT_POLICIES:
        raise ConfigError(f"remat={remat!r}; use one of {REMAT_POLICIES}")
    return remat


def resolve_moe_dispatch(dispatch) -> str:
    """A name from `memory.MOE_DISPATCHES` ('gspmd' or 'local', moe.py's `Experts`)."""
    if dispatch not in MOE_DISPATCHES:
        raise ConfigError(f"moe_dispatch={dispatch!r}; use one of {MOE_DISPATCHES}")
    return dispatch


def _tie_to(tree, cotangent):
    """`tree` + 0 * (one element of `cotangent`): the same values, but XLA must wait for the cotangent.

    Why: `jax.checkpoint` keeps its recomputation apart from the forward pass with optimization
    barriers, and XLA:CPU deletes those barriers before its last CSE pass, so the recomputed layer
    was merged back into the forward and every layer's activations stayed alive anyway (measured:
    remat=True gave the same compiled temp bytes as no remat). A real data dependence on the
    cotangent cannot be merged away or scheduled early, on any backend. The multiply by a zero XLA
    cannot prove zero costs one fused add per input; a non-finite cotangent element turns the
    layer's gradients into NaN (they would be non-finite anyway)."""
    zero = 0 * jax.tree.leaves(cotangent)[0].reshape(-1)[0]
    return jax.tree.map(lambda a: a + zero.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.number) else a,
                        tree)


def remat_function(fn, remat: str):
    """`fn(*args)` whose backward recomputes its forward (remat='full') or all but what the
    `jax.checkpoint_policies` policy of that name saves (e.g. 'dots_saveable': matmul outputs).

    The forward saves `jax.vjp(jax.checkpoint(fn, policy))`'s residuals (the inputs, plus the values the
    policy saves); the backward ties them to the incoming cotangent (`_tie_to`) and runs the recomputation.
    Gradients are exactly those of `fn`."""
    remat = resolve_remat(remat)
    if remat == "none":
        return fn
    policy = None if remat == "full" else getattr(jax.checkpoint_policies, remat)
    checkpointed = jax.checkpoint(fn, policy=policy, prevent_cse=False)  # the tie does prevent_cse's job

    @jax.custom_vjp
    def run(*args):
        return fn(*args)

    def run_fwd(*args):
        return jax.vjp(checkpointed, *args)             # (out, vjp closure: its leaves are the residuals)

    def run_bwd(vjp_fn, cotangent):
        return _tie_to(vjp_fn, cotangent)(cotangent)

    run.defvjp(run_fwd, run_bwd)
    return run


def _layer_function(graphdef):
    """A pure `(layer state, x, cos, sin, segment_ids, forced_experts) -> (x, Routing | None)` for one
    `DecoderLayer` (for remat_function)."""
    def apply(state, x, cos, sin, segment_ids, forced_experts):
        return nnx.merge(graphdef, state)(x, cos, sin, segment_ids, forced_experts)
    return apply


def segment_positions(segment_ids):
    """[B, T] segment ids (contiguous runs, 0 = padding) -> [B, T] int32 positions restarting at 0 in
    each segment (0 on padding)."""
    B, T = segment_ids.shape
    t = jnp.arange(T, dtype=jnp.int32)[None]                                    # [1, T]
    starts = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)                     # [B, T] segment's first t
    return jnp.where(segment_ids > 0, t - start, 0)


class Transformer(nnx.Module):
    """`model(input_ids [B, T] int, attention_mask [B, T] 0/1 | None) -> logits [B, T, V] float32`,
    i.e. `model.logits(model.hidden_states(input_ids, attention_mask))`; the two halves let a caller
    drop positions before the vocabulary-sized head (sequence_logprobs drops the last one, and with
    `chunk_tokens` never builds all the logits at once).

    Memory knobs (learner_jax/memory.py, `MemoryConfig.model_kwargs()`), none of which changes a number:
      attention_impl  'dense' (the [B, heads, T, T] reference) or another `attention.IMPLS` entry;
                      'auto' is resolved here, once, by the attention module (`self.attention_impl`).
      remat           'none': every layer's activations live from its forward to its backward;
                      'full': each layer keeps only its input [B, T, D] f32 and recomputes the rest in
                      the backward (about one more forward of compute); a `jax.checkpoint_policies`
                      name ('dots_saveable', 'dots_with_no_batch_dims_saveable', ...) keeps what that
                      policy saves (matmul outputs) and recomputes the rest.
      moe_dispatch    MoE layers on a mesh: 'gspmd' (GSPMD partitions the sort by expert and gathers the
                      weights) or 'local' (each device sorts its own rows in a shard_map and all-gathers
                      the expert weights inside it; moe.py's `Experts`).
    """

    def __init__(self, config: ModelConfig, *, param_dtype=jnp.float32, compute_dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None, attention_impl: str = "dense", remat="none",
                 moe_dispatch: str = "gspmd"):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.remat = resolve_remat(remat)
        self.attention_impl = resolve_attention_impl(attention_impl)
        self.param_dtype, self.compute_dtype = jnp.dtype(param_dtype), jnp.dtype(compute_dtype)
        dtypes = dict(param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.embed = nnx.Embed(config.vocab_size, config.hidden_size, dtype=param_dtype,
                               param_dtype=param_dtype, rngs=rngs,
                               embedding_init=nnx.initializers.normal(0.02))
        self.layers = nnx.List([DecoderLayer(config, sparse=config.is_sparse_layer(i), **dtypes, rngs=rngs,
                                             moe_dispatch=resolve_moe_dispatch(moe_dispatch))
                                for i in range(config.num_hidden_layers)])
        for layer in self.layers:
            layer.attn.attention_impl = self.attention_impl
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dtypes)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, use_bias=False, **dtypes,
                                  rngs=rngs)

    def __call__(self, input_ids, attention_mask=None):
        return self.logits(self.hidden_states(input_ids, attention_mask))

    def hidden_states(self, input_ids, attention_mask=None, *, segment_ids=None, positions=None,
                      routed_experts=None, return_routing=False):
        """[B, T] ids -> [B, T, D] final-norm outputs in the compute dtype (the head's input).

        Either `attention_mask` [B, T] 0/1 (one sequence per row, any padding side; positions are
        cumsum(mask) - 1) or, for packed rows, `segment_ids` [B, T] int (1, 2, ... per sequence, each
        a contiguous run, 0 = padding) with `positions` [B, T] (default: restarting at 0 in each
        segment, `segment_positions`). A packed sequence gets exactly the hidden states it gets alone
        in a row: attention never crosses segments and RoPE sees its own positions.

        MoE models: `routed_experts` [B, T, S, K] int (S sparse layers, in layer order) replaces each
        sparse layer's own top-k (routing replay, moe.py; a (token, layer) holding -1 keeps its own); `return_routing=True` returns
        `(hidden, Routing(logits [S, B·T, E] f32, experts [S, B·T, K] the routers' own top-k))`.
        """
        B, T = input_ids.shape
        if segment_ids is None:
            segment_ids = (jnp.ones((B, T), jnp.int32) if attention_mask is None
                           else attention_mask.astype(jnp.int32))
            if positions is None:
                positions = jnp.maximum(jnp.cumsum(segment_ids > 0, axis=-1) - 1, 0)  # [B, T]
        elif positions is None:
            positions = segment_positions(segment_ids)                         # [B, T]
        freqs = positions[..., None].astype(jnp.float32) * rope_inv_freq(self.config)  # [B, T, H/2]
        angles = jnp.concatenate([freqs, freqs], axis=-1)                      # [B, T, H]
        cos, sin = jnp.cos(angles), jnp.sin(angles)                            # [B, T, H] float32

        # Residual stream in float32: bf16 only at matmul inputs (norm outputs) and outputs.
        x = self.embed(input_ids).astype(jnp.float32)                          # [B, T, D] f32
        routings = []
        for layer in self.layers:
            x = constrain_batch_rows(x)  # rows stay split over the mesh (sharding.py says why)
            forced = None
            if layer.sparse and routed_experts is not None:                    # [B·T, K]
                forced = routed_experts[:, :, len(routings)].reshape(B * T, -1)
            if self.remat == "none":
                x, routing = layer(x, cos, sin, segment_ids, forced)
            else:  # a pure function of the layer's arrays, so the backward can re-run it
                graphdef, state = nnx.split(layer)
                x, routing = remat_function(_layer_function(graphdef), self.remat)(state, x, cos, sin,
                                                                                   segment_ids, forced)
            if routing is not None:
                routings.append(routing)
        hidden = self.final_norm(constrain_batch_rows(x))
        if not return_routing:
            return hidden
        if routed_experts is not None and routed_experts.shape[2] != len(routings):
            raise ConfigError(f"routed_experts has {routed_experts.shape[2]} layers but the model has {len(routings)} "
                              "sparse (MoE) layers; replay the routing of an engine serving this same model")
        if not routings:
            raise ConfigError(f"return_routing=True needs a mixture-of-experts model; {self.config.family} is dense")
        return hidden, Routing(*(jnp.stack(parts) for parts in zip(*routings)))

    def logits(self, x):
        """[..., D] hidden states -> [..., V] float32 logits."""
        # Logits: compute-dtype inputs, float32 accumulation and output (no bf16 rounding of logits).
        if self.config.tie_word_embeddings:
            w = self.embed.embedding[...].T                                   # [D, V]
        else:
            w = self.lm_head.kernel[...]                                      # [D, V]
        return dense(x, w, self.compute_dtype, jnp.float32)                     # [..., V] f32
