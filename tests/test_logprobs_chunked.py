"""The chunked logprob head (`sequence_logprobs(..., chunk_tokens=C)`): the same values and gradients
as the unchunked head, memory of one [C, V] chunk (from the compiled program), and packed rows that
give every sequence the logprobs it gets alone in a row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.dense import dense
from portable_rl.learner_jax.logprobs import chunked_token_logprobs, sequence_logprobs, token_logprobs
from portable_rl.learner_jax.model import Transformer

V = 64


def tiny(tie: bool) -> Transformer:
    config = ModelConfig(family="qwen3", vocab_size=V, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         tie_word_embeddings=tie)
    return Transformer(config, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(3))


def _rel(a, b):
    return float(jnp.linalg.norm(jnp.ravel(a - b)) / jnp.maximum(jnp.linalg.norm(jnp.ravel(b)), 1e-30))


CHUNKS = (1, 5, 36, 1000)


@pytest.mark.slow  # compiles five value_and_grads of the model: ~10 s
@pytest.mark.parametrize("tie", [False, True])
def test_chunked_values_and_gradients_equal_unchunked(tie):
    """B=3 rows of T=13 -> 36 predicted tokens: C=5 pads to 40 (a partial last chunk), C=36 is one
    exact chunk, C=1000 is clipped to the token count, C=1 is one token per chunk. Both outputs carry
    a cotangent (an entropy bonus), temperature != 1, right padding. fp32: equal to 1e-6 relative."""
    model = tiny(tie)
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(0, V, size=(3, 13)), jnp.int32)
    mask = jnp.asarray(np.arange(13)[None] < np.array([[13], [9], [5]]), jnp.int32)
    g_logp, g_ent = jnp.asarray(rng.normal(size=(2, 3, 13)), jnp.float32)

    def loss(model, chunk):
        logp, ent = sequence_logprobs(model, ids, mask, 0.7, chunk_tokens=chunk)
        return jnp.sum((logp * g_logp + ent * g_ent) * mask), (logp, ent)

    @nnx.jit
    def every_chunking(model):  # one compiled program for all of them
        return [nnx.value_and_grad(lambda m: loss(m, chunk), has_aux=True)(model) for chunk in (None,) + CHUNKS]

    (want_loss, (want_logp, want_ent)), want_grads = every_chunking(model)[0]
    want = dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(want_grads)))
    assert all(float(jnp.linalg.norm(w)) > 0 for w in want.values())
    for chunk, ((got_loss, (got_logp, got_ent)), got_grads) in zip(CHUNKS, every_chunking(model)[1:]):
        assert got_logp.shape == (3, 13) and float(got_logp[0, 0]) == 0.0 and float(got_ent[0, 0]) == 0.0
        np.testing.assert_allclose(got_logp, want_logp, rtol=1e-6, atol=1e-6, err_msg=f"C={chunk}")
        np.testing.assert_allclose(got_ent, want_ent, rtol=1e-6, atol=1e-6, err_msg=f"C={chunk}")
        assert abs(float(got_loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss)), chunk
        for path, g in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(got_grads)):
            assert _rel(g, want[path]) <= 1e-6, (chunk, jax.tree_util.keystr(path), _rel(g, want[path]))


def _head_temp_bytes(chunk_tokens, tokens=4096, vocab=32768, dim=64):
    """Compiled temporaries of value_and_grad(sum of logp + entropy) w.r.t. the hidden states AND the
    head weight, from abstract shapes (nothing is allocated)."""
    def loss(hidden, w, targets):
        head = lambda h: dense(h, w, jnp.float32, jnp.float32)                 # [..., V] f32
        if chunk_tokens is None:
            logp, ent = token_logprobs(head(hidden), targets)
        else:
            logp, ent = chunked_token_logprobs(head, hidden, targets, chunk_tokens=chunk_tokens)
        return jnp.sum(logp) + 0.01 * jnp.sum(ent)

    args = (jax.ShapeDtypeStruct((1, tokens, dim), jnp.float32), jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
            jax.ShapeDtypeStruct((1, tokens), jnp.int32))
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunking_bounds_the_head_memory_by_one_chunk():
    """4096 tokens x V=32768: the f32 logits alone are 512 MiB. Unchunked, the compiled value_and_grad
    holds at least that much in temporaries; with 256-token chunks (32 MiB of logits per chunk) it
    holds a small multiple of one chunk, far below the logits."""
    tokens, vocab = 4096, 32768
    logits_bytes = tokens * vocab * 4
    chunk_bytes = 256 * vocab * 4
    unchunked = _head_temp_bytes(None, tokens, vocab)
    chunked = _head_temp_bytes(256, tokens, vocab)
    assert unchunked >= logits_bytes, (unchunked, logits_bytes)
    assert chunked <= 4 * chunk_bytes, (chunked, chunk_bytes)
    assert chunked <= logits_bytes / 4, (chunked, logits_bytes)


@pytest.mark.parametrize("chunk_tokens", [None, 6])
def test_packed_rows_give_each_sequence_its_own_logprobs(chunk_tokens):
    """Three sequences packed into one row (segment ids, positions restarting per segment, padding at
    the end) give the logprobs and entropies each gets alone in a right-padded row: attention stays
    inside a segment and RoPE sees per-segment positions. A segment's first token is 0 (no context)."""
    model = tiny(tie=False)
    rng = np.random.RandomState(1)
    lengths = [5, 7, 4]
    seqs = [rng.randint(0, V, size=n) for n in lengths]
    T = 20
    packed = np.zeros((1, T), np.int32)
    segment_ids = np.zeros((1, T), np.int32)
    start = 0
    for k, s in enumerate(seqs):
        packed[0, start:start + len(s)] = s
        segment_ids[0, start:start + len(s)] = k + 1
        start += len(s)
    rows = np.zeros((3, max(lengths)), np.int32)
    mask = np.zeros_like(rows)
    for k, s in enumerate(seqs):
        rows[k, :len(s)], mask[k, :len(s)] = s, 1

    run = nnx.jit(lambda m, ids, seg: sequence_logprobs(m, ids, None, 0.8, segment_ids=seg,
                                                        chunk_tokens=chunk_tokens))
    logp, ent = run(model, jnp.asarray(packed), jnp.asarray(segment_ids))
    want_logp, want_ent = nnx.jit(lambda m, ids, am: sequence_logprobs(m, ids, am, 0.8))(
        model, jnp.asarray(rows), jnp.asarray(mask))
    start = 0
    for k, n in enumerate(lengths):
        got = np.asarray(logp[0, start:start + n]), np.asarray(ent[0, start:start + n])
        assert got[0][0] == 0.0 and got[1][0] == 0.0                   # no context in its own sequence
        np.testing.assert_allclose(got[0][1:], np.asarray(want_logp[k, 1:n]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[1][1:], np.asarray(want_ent[k, 1:n]), rtol=1e-5, atol=1e-5)
        start += n

    # explicit per-segment positions are what the model derives from the segment ids
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(T - sum(lengths), int)])[None]
    explicit = nnx.jit(lambda m, ids, seg, pos: sequence_logprobs(m, ids, None, 0.8, segment_ids=seg,
                                                                  positions=pos, chunk_tokens=chunk_tokens))(
        model, jnp.asarray(packed), jnp.asarray(segment_ids), jnp.asarray(positions, jnp.int32))
    np.testing.assert_array_equal(np.asarray(explicit[0]), np.asarray(logp))


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_bad_chunk_tokens_is_one_clear_error(bad):
    model = tiny(tie=True)
    ids = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="chunk_tokens=.* must be a positive int, or None"):
        sequence_logprobs(model, ids, chunk_tokens=bad)
