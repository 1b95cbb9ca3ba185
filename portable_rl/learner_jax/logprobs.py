"""Token logprobs and entropies of the tempered policy, the quantity TIS compares with engine logprobs.

The one definition (docs/architecture.md):

    logp[b, t]    = log_softmax(logits[b, t] / T)[targets[b, t]]            natural log, float32
    entropy[b, t] = -sum_v p_v log p_v,   p = softmax(logits[b, t] / T)      full vocabulary

no top-k / top-p truncation. Engines return exactly this when configured with
`logprobs_mode="processed_logprobs"`, `top_p=1`, `top_k=-1` (vLLM).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def token_logprobs(logits, targets, temperature=1.0):
    """logits [B, T, V], targets [B, T] int -> (logp [B, T] f32, entropy [B, T] f32) at `temperature`.

    Gradient (custom VJP, one fused pass over [B, T, V] instead of autodiff's zeros + scatter for
    the gather and separate passes for logsumexp), with p = softmax(s), s = logits / T:

        d logits = ( g_logp · (onehot(target) − p)  −  g_entropy · p · (log p + entropy) ) / T
    """
    return _token_logprobs_fwd(logits, targets, temperature)[0]


def _token_logprobs_fwd(logits, targets, temperature):
    scaled = logits.astype(jnp.float32) / temperature                        # [B, T, V]
    logz = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)                  # [B, T, 1]
    log_probs = scaled - logz                                                # [B, T, V]
    logp = jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)              # [B, T]
    return (logp, entropy), (logits, targets, temperature, logz, entropy)


def _token_logprobs_bwd(res, cotangents):
    logits, targets, temperature, logz, entropy = res
    g_logp, g_entropy = cotangents                                           # [B, T] each
    log_probs = logits.astype(jnp.float32) / temperature - logz              # [B, T, V]
    probs = jnp.exp(log_probs)
    onehot = jnp.arange(logits.shape[-1]) == targets[..., None]              # [B, T, V] bool
    d_scaled = (g_logp[..., None] * (onehot - probs)
                - g_entropy[..., None] * probs * (log_probs + entropy[..., None]))
    d_logits = (d_scaled / temperature).astype(logits.dtype)
    return d_logits, None, jnp.zeros_like(temperature)


token_logprobs.defvjp(_token_logprobs_fwd, _token_logprobs_bwd)


def sequence_logprobs(model, input_ids, attention_mask, temperature: float = 1.0):
    """Per-token logprobs of a batch of sequences under `model`; both outputs [B, T] float32.

    Entry t is log p(input_ids[:, t] | input_ids[:, :t]) and entropy[:, t] is the entropy of that
    predictive distribution. Entry 0 has no context and is 0 in both. Padded positions hold
    meaningless values: multiply by a response / attention mask before using them.
    """
    hidden = model.hidden_states(input_ids, attention_mask)                  # [B, T, D]
    # The logits at t-1 predict token t; the last position predicts nothing, so it is dropped
    # before the head rather than sliced out of [B, T, V] logits (a copy of the largest tensor).
    logits = model.logits(hidden[:, :-1])                                    # [B, T-1, V]
    logp, entropy = token_logprobs(logits, input_ids[:, 1:], temperature)    # [B, T-1]
    pad = jnp.zeros_like(logp[:, :1])
    return jnp.concatenate([pad, logp], axis=1), jnp.concatenate([pad, entropy], axis=1)
