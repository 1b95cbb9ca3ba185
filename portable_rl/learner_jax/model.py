"""Decoder-only transformer in Flax NNX covering Qwen2, Qwen3 and Llama 3 (HF numerics).

  x_0     = embed[input_ids]
  h       = x_l + o_proj(attn(rope(q_norm(W_q n(x_l))), rope(k_norm(W_k n(x_l))), W_v n(x_l)))
  x_{l+1} = h + W_down(silu(W_gate n(h)) * W_up n(h))                     (SwiGLU)
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
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.attention import attention
from portable_rl.learner_jax.dense import dense


class Linear(nnx.Module):
    """y = x @ kernel (+ bias) in the compute dtype, float32 accumulation forward and backward
    (dense.py says why not `nnx.Linear`). Parameter names and init match `nnx.Linear`."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, param_dtype,
                 compute_dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (in_features, out_features),
                                                              param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None
        self.compute_dtype = compute_dtype

    def __call__(self, x):  # [..., in] -> [..., out] compute dtype
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
    def __init__(self, config: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        linear = dict(use_bias=False, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
        self.gate_proj = Linear(d, f, **linear)
        self.up_proj = Linear(d, f, **linear)
        self.down_proj = Linear(f, d, **linear)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        dtypes = dict(param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dtypes)
        self.attn = Attention(config, **dtypes, rngs=rngs)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dtypes)
        self.mlp = MLP(config, **dtypes, rngs=rngs)

    def __call__(self, x, cos, sin, segment_ids):  # x [B, T, D] float32 residual stream
        x = x + self.attn(self.input_norm(x), cos, sin, segment_ids).astype(jnp.float32)
        return x + self.mlp(self.post_attn_norm(x)).astype(jnp.float32)


def _apply_layer(layer, x, cos, sin, segment_ids):
    return layer(x, cos, sin, segment_ids)


# Recomputes a layer's activations in the backward pass instead of storing them.
_apply_layer_remat = nnx.remat(_apply_layer)


class Transformer(nnx.Module):
    """`model(input_ids [B, T] int, attention_mask [B, T] 0/1 | None) -> logits [B, T, V] float32`,
    i.e. `model.logits(model.hidden_states(input_ids, attention_mask))`; the two halves let a caller
    drop positions before the vocabulary-sized head (sequence_logprobs drops the last one).

    `remat=True` recomputes each layer in the backward pass (activation memory of one layer
    instead of all of them, for about one extra forward pass of compute).
    """

    def __init__(self, config: ModelConfig, *, param_dtype=jnp.float32, compute_dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None, remat: bool = False):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.remat = remat
        self.param_dtype, self.compute_dtype = jnp.dtype(param_dtype), jnp.dtype(compute_dtype)
        dtypes = dict(param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.embed = nnx.Embed(config.vocab_size, config.hidden_size, dtype=param_dtype,
                               param_dtype=param_dtype, rngs=rngs,
                               embedding_init=nnx.initializers.normal(0.02))
        self.layers = nnx.List([DecoderLayer(config, **dtypes, rngs=rngs)
                                for _ in range(config.num_hidden_layers)])
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dtypes)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, use_bias=False, **dtypes,
                                  rngs=rngs)

    def __call__(self, input_ids, attention_mask=None):
        return self.logits(self.hidden_states(input_ids, attention_mask))

    def hidden_states(self, input_ids, attention_mask=None, *, segment_ids=None, positions=None):
        """[B, T] ids -> [B, T, D] final-norm outputs in the compute dtype (the head's input).

        Either `attention_mask` [B, T] 0/1 (one sequence per row, any padding side) or, for packed
        rows, `segment_ids` [B, T] int (1, 2, ... per sequence, 0 = padding) with `positions` [B, T]
        (restarting at 0 for each sequence). Without positions they are cumsum(valid) - 1.
        """
        B, T = input_ids.shape
        if segment_ids is None:
            segment_ids = (jnp.ones((B, T), jnp.int32) if attention_mask is None
                           else attention_mask.astype(jnp.int32))
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(segment_ids > 0, axis=-1) - 1, 0)  # [B, T]
        freqs = positions[..., None].astype(jnp.float32) * rope_inv_freq(self.config)  # [B, T, H/2]
        angles = jnp.concatenate([freqs, freqs], axis=-1)                      # [B, T, H]
        cos, sin = jnp.cos(angles), jnp.sin(angles)                            # [B, T, H] float32

        # Residual stream in float32: bf16 only at matmul inputs (norm outputs) and outputs.
        x = self.embed(input_ids).astype(jnp.float32)                          # [B, T, D] f32
        apply = _apply_layer_remat if self.remat else _apply_layer
        for layer in self.layers:
            x = apply(layer, x, cos, sin, segment_ids)
        return self.final_norm(x)

    def logits(self, x):
        """[..., D] hidden states -> [..., V] float32 logits."""
        # Logits: compute-dtype inputs, float32 accumulation and output (no bf16 rounding of logits).
        if self.config.tie_word_embeddings:
            w = self.embed.embedding[...].T                                   # [D, V]
        else:
            w = self.lm_head.kernel[...]                                      # [D, V]
        return dense(x, w, self.compute_dtype, jnp.float32)                     # [..., V] f32
