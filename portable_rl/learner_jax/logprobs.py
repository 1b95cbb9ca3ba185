"""Token logprobs and entropies of the tempered policy, the quantity TIS compares with engine logprobs.

The one definition (docs/architecture.md):

    logp[b, t]    = log_softmax(logits[b, t] / T)[targets[b, t]]            natural log, float32
    entropy[b, t] = -sum_v p_v log p_v,   p = softmax(logits[b, t] / T)      full vocabulary

no top-k / top-p truncation. Engines return exactly this when configured with
`logprobs_mode="processed_logprobs"`, `top_p=1`, `top_k=-1` (vLLM).

Truncated sampling (top-k / top-p): the engine drew token t from the tempered softmax renormalised over a
support S_t and returns S_t with it (engines/base.py, `Rollout.sampling_support`). Given
`sampling_support` [B, T, K] (ids, -1 = padding), the logprob is renormalised over the same set:

    logp[b, t]    = s[target] − logsumexp_{v ∈ S_t ∪ {target}} s[v],   s = logits[b, t] / T
    entropy[b, t] = the full-vocabulary entropy (above): what the model's distribution does, not the sampler's

so the learner's logprob and the engine's are the same quantity again, and a TIS ratio between them
measures only numerics (docs/tis.md). The target is always in the set (a token outside its own support
would be an engine bug; this keeps its logprob finite). Gradient: (onehot(target) − p_S) / T, p_S the
renormalised probabilities (0 outside S_t): the gradient of the truncated policy that sampled the data.

Memory: the [tokens, V] float32 logits are the largest tensor of a learner step (V ~ 150k: 0.6 MB
per token, forward, plus as much again for their gradient). `sequence_logprobs(..., chunk_tokens=C)`
runs the head and `token_logprobs` over chunks of ~C tokens per batch shard (cut along time, rows
kept whole) under `jax.checkpoint`, so one chunk of logits (and its gradient) exists at a time; the
backward recomputes each chunk's logits (one more head matmul, ~1/3 of the head's cost). Same values
and gradients as unchunked.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from portable_rl.learner_jax.sharding import LOGICAL_AXIS_RULES, constrain_batch_rows


def token_logprobs(logits, targets, temperature=1.0, support=None):
    """logits [B, T, V], targets [B, T] int -> (logp [B, T] f32, entropy [B, T] f32) at `temperature`;
    `support` [B, T, K] int (-1 = padding): logp renormalised over each token's support (module doc).

    Gradient (custom VJP, one fused pass over [B, T, V] instead of autodiff's zeros + scatter for
    the gather and separate passes for logsumexp), with p = softmax(s), s = logits / T, and p_S = p
    renormalised over the support (p_S = p without one):

        d logits = ( g_logp · (onehot(target) − p_S)  −  g_entropy · p · (log p + entropy) ) / T
    """
    if support is None:
        return _full_token_logprobs(logits, targets, temperature)
    return _support_token_logprobs(logits, targets, temperature, support)


def _support_mask(targets, support, vocab):
    """[B, T] targets, [B, T, K] support ids (-1 = padding) -> [B, T, V] bool: the support with the target."""
    B, T, K = support.shape
    b = jnp.arange(B)[:, None, None]
    t = jnp.arange(T)[None, :, None]
    ids = jnp.where(support >= 0, support, vocab).astype(jnp.int32)        # padding -> out of range: dropped
    mask = jnp.zeros((B, T, vocab), bool).at[b, t, ids].set(True, mode="drop")
    return mask | (jnp.arange(vocab) == targets[..., None])


def _token_logprobs_fwd(logits, targets, temperature, support=None):
    scaled = logits.astype(jnp.float32) / temperature                        # [B, T, V]
    logz = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)                  # [B, T, 1]
    log_probs = scaled - logz                                                # [B, T, V]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)              # [B, T]
    logz_sampled = logz
    if support is not None:                                                  # renormalise over S_t
        in_support = _support_mask(targets, support, logits.shape[-1])       # [B, T, V]
        logz_sampled = jax.nn.logsumexp(jnp.where(in_support, scaled, -jnp.inf), axis=-1, keepdims=True)
    target_scaled = jnp.take_along_axis(scaled, targets[..., None].astype(jnp.int32), axis=-1)
    logp = (target_scaled - logz_sampled)[..., 0]                            # [B, T]
    return (logp, entropy), (logits, targets, temperature, logz, logz_sampled, entropy, support)


def _token_logprobs_bwd(res, cotangents):
    logits, targets, temperature, logz, logz_sampled, entropy, support = res
    g_logp, g_entropy = cotangents                                           # [B, T] each
    scaled = logits.astype(jnp.float32) / temperature                        # [B, T, V]
    log_probs = scaled - logz
    probs = jnp.exp(log_probs)
    probs_sampled = probs
    if support is not None:
        in_support = _support_mask(targets, support, logits.shape[-1])
        probs_sampled = jnp.where(in_support, jnp.exp(scaled - logz_sampled), 0.0)
    onehot = jnp.arange(logits.shape[-1]) == targets[..., None]              # [B, T, V] bool
    d_scaled = (g_logp[..., None] * (onehot - probs_sampled)
                - g_entropy[..., None] * probs * (log_probs + entropy[..., None]))
    d_logits = (d_scaled / temperature).astype(logits.dtype)
    return d_logits, None, jnp.zeros_like(temperature), None


@jax.custom_vjp
def _support_token_logprobs(logits, targets, temperature, support):
    return _token_logprobs_fwd(logits, targets, temperature, support)[0]


_support_token_logprobs.defvjp(
    lambda logits, targets, temperature, support: _token_logprobs_fwd(logits, targets, temperature, support),
    _token_logprobs_bwd)


@jax.custom_vjp
def _full_token_logprobs(logits, targets, temperature):
    return _token_logprobs_fwd(logits, targets, temperature, None)[0]


_full_token_logprobs.defvjp(
    lambda logits, targets, temperature: _token_logprobs_fwd(logits, targets, temperature, None),
    lambda res, cotangents: _token_logprobs_bwd(res, cotangents)[:3])


def _check_chunk_tokens(chunk_tokens):
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be a positive int, or None for no chunking")


def _row_shards(rows: int) -> int:
    """How many ways the rows of a [rows, ...] batch are split over the mesh set with `jax.set_mesh`
    (its "batch" axes, learner_jax/sharding.py); 1 without a mesh or when they do not divide `rows`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    batch_axes = dict(LOGICAL_AXIS_RULES)["batch"] or ()
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    ways = math.prod(mesh.shape[a] for a in batch_axes if a in mesh.axis_names)
    return ways if rows % ways == 0 else 1


def chunked_token_logprobs(head, hidden, targets, temperature=1.0, *, chunk_tokens: int, support=None):
    """`token_logprobs(head(hidden), targets, temperature, support)` without the whole [B, T, V] logits.

    hidden [B, T, D], targets [B, T] int -> (logp, entropy) [B, T] float32. The time axis is cut
    into n chunks of S steps (T padded with zeros to n * S) and `lax.map` runs over them; a chunk
    is [B, S] tokens, S = max(1, chunk_tokens // rows per batch shard), so each device holds at
    most max(chunk_tokens, its rows) tokens of a chunk. Rows stay the leading (sharded) axis of a
    chunk, so a row-split batch is never gathered. Each chunk's `head` ([B, S, D] -> [B, S, V] f32)
    and `token_logprobs` run under `jax.checkpoint`: the map's backward keeps only the chunk's
    [B, S, D] input and recomputes its logits, so one chunk of logits and its gradient exist at a
    time, forward and backward. The head's weight gradient is summed over chunks (float32 for
    float32 params) by the map's backward.
    """
    _check_chunk_tokens(chunk_tokens)
    B, T, D = hidden.shape
    rows_per_shard = B // _row_shards(B)
    steps = max(1, min(T, chunk_tokens // rows_per_shard))                 # S
    num_chunks = -(-T // steps)                                           # n
    pad = num_chunks * steps - T

    def chunked(x):  # [B, T, ...] -> [n, B, S, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(B, num_chunks, steps, *x.shape[2:]), 0, 1)

    # Inside a loop body the loop itself keeps the recomputation apart from the forward pass, so
    # no CSE barriers are needed (prevent_cse=False, as jax.checkpoint's docs advise for scan).
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_chunk(chunk):                        # ([B, S, D], [B, S], [B, S, K]?) -> ([B, S], [B, S])
        hidden_c, targets_c, support_c = chunk
        logits = head(constrain_batch_rows(hidden_c))                     # [B, S, V] f32
        return token_logprobs(logits, targets_c, temperature, support_c)

    chunks = (chunked(hidden), chunked(targets), None if support is None else chunked(support))
    logp, entropy = jax.lax.map(one_chunk, chunks)                        # [n, B, S] each
    unchunk = lambda x: jnp.swapaxes(x, 0, 1).reshape(B, num_chunks * steps)[:, :T]
    return unchunk(logp), unchunk(entropy)


def sequence_logprobs(model, input_ids, attention_mask=None, temperature: float = 1.0, *,
                      segment_ids=None, positions=None, chunk_tokens: int | None = None, sampling_support=None,
                      routed_experts=None, return_routing=False):
    """Per-token logprobs of a batch of sequences under `model`; both outputs [B, T] float32.

    Entry t is log p(input_ids[:, t] | input_ids[:, :t]) and entropy[:, t] is the entropy of that
    predictive distribution. Entry 0 has no context and is 0 in both. Padded positions hold
    meaningless values: multiply by a response / attention mask before using them.

    Packed rows (`segment_ids` [B, T], 1, 2, ... per sequence, 0 = padding, with optional `positions`;
    `Transformer.hidden_states`): the context is the token's own sequence, and the first token of
    each segment (no context in it) is 0 in both outputs, so every sequence gets exactly the values
    it gets alone in a row. `chunk_tokens=C` computes the head over chunks of C tokens
    (`chunked_token_logprobs`, memory of one [C, V] chunk instead of [B, T-1, V]); None: all at once.
    `sampling_support` [B, T, K] (entry t: the support token t was sampled from, -1 = padding): logp
    renormalised over it (module doc). `routed_experts` [B, T, S, K] (MoE models, routing replay): the
    experts each sparse layer routes each token to (-1: its own top-k; `Transformer.hidden_states`).
    `return_routing` (MoE models): also the sparse layers' `Routing`
    (router logits, own top-k; `Transformer.hidden_states`), as a third output.
    """
    if chunk_tokens is not None:
        _check_chunk_tokens(chunk_tokens)       # before the forward pass, not after it
    hidden = model.hidden_states(input_ids, attention_mask, segment_ids=segment_ids, positions=positions,
                                 routed_experts=routed_experts, return_routing=return_routing)             # [B, T, D]
    if return_routing:
        hidden, routing = hidden
    # The logits at t-1 predict token t; the last position predicts nothing, so it is dropped
    # before the head rather than sliced out of [B, T, V] logits (a copy of the largest tensor).
    targets = input_ids[:, 1:]                                               # [B, T-1]
    support = None if sampling_support is None else sampling_support[:, 1:]  # [B, T-1, K]
    if chunk_tokens is None:
        logits = model.logits(hidden[:, :-1])                                # [B, T-1, V]
        logp, entropy = token_logprobs(logits, targets, temperature, support)  # [B, T-1]
    else:
        logp, entropy = chunked_token_logprobs(model.logits, hidden[:, :-1], targets, temperature,
                                               chunk_tokens=chunk_tokens, support=support)  # [B, T-1]
    if segment_ids is not None:  # a segment's first token is predicted from the previous segment
        starts = segment_ids[:, 1:] != segment_ids[:, :-1]                   # [B, T-1]
        logp, entropy = jnp.where(starts, 0.0, logp), jnp.where(starts, 0.0, entropy)
    pad = jnp.zeros_like(logp[:, :1])
    logp, entropy = jnp.concatenate([pad, logp], axis=1), jnp.concatenate([pad, entropy], axis=1)
    return (logp, entropy, routing) if return_routing else (logp, entropy)
