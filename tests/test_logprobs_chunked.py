"""The chunked logprob head (`sequence_logprobs(..., chunk_tokens=C)`): the same values and gradients
as the unchunked head, memory of one [C, V] chunk (from the compiled program), and packed rows that
give every sequence the logprobs it gets alone in a row."""

import json
import os
import subprocess
import sys
import textwrap

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


CHUNKS = (1, 5, 16, 36, 1000)


@pytest.mark.slow  # compiles five value_and_grads of the model: ~10 s
@pytest.mark.parametrize("tie", [False, True])
def test_chunked_values_and_gradients_equal_unchunked(tie):
    """B=3 rows of T=13 -> 12 predicted steps per row, chunks of S = C // 3 steps: C=16 -> S=5 pads
    12 to 15 (a partial last chunk), C=36 is one exact chunk, C=1000 is clipped to the row, C=1 and
    C=5 are one step per chunk. Both outputs carry a cotangent (an entropy bonus), temperature != 1,
    right padding. fp32: equal to 1e-6 relative."""
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


SHARDED_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from portable_rl.learner_jax.dense import dense
    from portable_rl.learner_jax.logprobs import chunked_token_logprobs, token_logprobs
    from portable_rl.learner_jax.sharding import MeshConfig, make_mesh

    B, T, D, V = 4, 1024, 64, 8192
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, V)) / 8, jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)

    def grad_fn(chunk):
        def f(hidden, w):
            head = lambda h: dense(h, w, jnp.float32, jnp.float32)
            if chunk is None:
                logp, ent = token_logprobs(head(hidden), targets)
            else:
                logp, ent = chunked_token_logprobs(head, hidden, targets, chunk_tokens=chunk)
            return jnp.sum(logp) + 0.1 * jnp.sum(ent)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    want = grad_fn(None)(hidden, w)                      # one device, unchunked
    mesh = make_mesh(MeshConfig(fsdp=4))
    out = {}
    with jax.set_mesh(mesh):
        rows = jax.device_put(hidden, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
        for chunk in (None, 128):
            fn = grad_fn(chunk)
            got = fn(rows, w)
            rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
            out[str(chunk)] = dict(temp=fn.lower(rows, w).compile().memory_analysis().temp_size_in_bytes,
                                   loss=rel(got[0], want[0]), dh=rel(got[1][0], want[1][0]),
                                   dw=rel(got[1][1], want[1][1]), dh_spec=str(got[1][0].sharding.spec))
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow  # a subprocess with 4 host devices: ~15 s
def test_chunks_keep_row_split_batches_split():
    """Rows split over 4 devices (jax.set_mesh): chunks are cut along time, so each device computes
    chunks of its own row and holds one [1, 128, V] chunk of logits (4 MiB), never the other devices'
    rows; values and gradients equal the single-device unchunked ones."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    per_device_logits = 1024 * 8192 * 4
    per_device_chunk = 128 * 8192 * 4
    assert out["None"]["temp"] >= per_device_logits
    assert out["128"]["temp"] <= 4 * per_device_chunk < per_device_logits, out
    for chunk in ("None", "128"):
        assert out[chunk]["dh_spec"] == "P(('data', 'fsdp'),)", out
        assert max(out[chunk]["loss"], out[chunk]["dh"], out[chunk]["dw"]) <= 1e-6, out


def test_packed_rows_give_each_sequence_its_own_logprobs():
    """Three sequences packed into one row (segment ids, positions restarting per segment, padding at
    the end) give the logprobs and entropies each gets alone in a right-padded row, with the head
    unchunked and in chunks of 6: attention stays inside a segment and RoPE sees per-segment
    positions. A segment's first token is 0 (no context in its own sequence)."""
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
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(T - sum(lengths), int)])[None]

    @nnx.jit
    def packed_logprobs(model, ids, seg, pos):
        return {"unchunked": sequence_logprobs(model, ids, None, 0.8, segment_ids=seg),
                "chunked": sequence_logprobs(model, ids, None, 0.8, segment_ids=seg, chunk_tokens=6),
                # explicit per-segment positions: what the model derives from the segment ids
                "explicit": sequence_logprobs(model, ids, None, 0.8, segment_ids=seg, positions=pos,
                                              chunk_tokens=6)}

    got_all = packed_logprobs(model, jnp.asarray(packed), jnp.asarray(segment_ids), jnp.asarray(positions, jnp.int32))
    want_logp, want_ent = nnx.jit(lambda m, ids, am: sequence_logprobs(m, ids, am, 0.8))(
        model, jnp.asarray(rows), jnp.asarray(mask))
    for name, (logp, ent) in got_all.items():
        start = 0
        for k, n in enumerate(lengths):
            got = np.asarray(logp[0, start:start + n]), np.asarray(ent[0, start:start + n])
            assert got[0][0] == 0.0 and got[1][0] == 0.0, name
            np.testing.assert_allclose(got[0][1:], np.asarray(want_logp[k, 1:n]), rtol=1e-5, atol=1e-5, err_msg=name)
            np.testing.assert_allclose(got[1][1:], np.asarray(want_ent[k, 1:n]), rtol=1e-5, atol=1e-5, err_msg=name)
            start += n


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_bad_chunk_tokens_is_one_clear_error(bad):
    model = tiny(tie=True)
    ids = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="chunk_tokens=.* must be a positive int, or None"):
        sequence_logprobs(model, ids, chunk_tokens=bad)
