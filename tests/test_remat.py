"""Rematerialisation (`Transformer(..., remat=)`): every policy gives the gradients of no remat, and
'full' really lowers the compiled memory of a step (XLA's memory analysis on abstract shapes).

The second test is the one that failed before `model.remat_function`: `nnx.remat` / `jax.checkpoint`
separate the recomputation from the forward pass with optimization barriers, which XLA:CPU deletes
before CSE, so the recomputed layers were merged back into the forward and remat=True compiled to the
same temporaries as no remat (measured: identical temp bytes for 1, 2 and 4 layers)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from portable_rl.learner_jax import attention as attention_lib
from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.logprobs import sequence_logprobs
from portable_rl.learner_jax.memory import REMAT_POLICIES
from portable_rl.learner_jax.model import Transformer, resolve_attention_impl

TINY = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
# The cheapest implementation that is not dense, where the attention module has one.
NON_DENSE = next((impl for impl in ("blockwise", "splash", "cudnn") if impl in attention_lib.IMPLS), "dense")


def _rel(a, b):
    return float(jnp.linalg.norm(jnp.ravel(a - b)) / jnp.linalg.norm(jnp.ravel(b)))


@pytest.mark.slow  # compiles one value_and_grad per policy: ~10 s
def test_every_policy_gives_the_gradients_of_no_remat():
    """fp32, packed rows with per-segment positions and a chunked head (what the learner runs)."""
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(0, 64, size=(2, 12)), jnp.int32)
    segment_ids = jnp.asarray([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3], jnp.int32)
    weights = jnp.asarray(rng.normal(size=(2, 12)), jnp.float32)

    def loss(model):
        logp, ent = sequence_logprobs(model, ids, None, 0.9, segment_ids=segment_ids, chunk_tokens=7)
        return jnp.sum((logp + 0.1 * ent) * weights * (segment_ids > 0))

    # checkpoint_dots / checkpoint_dots_with_no_batch_dims are jax's aliases of the two dots policies
    assert jax.checkpoint_policies.checkpoint_dots is jax.checkpoint_policies.dots_saveable
    assert (jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
            is jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    policies = [r for r in REMAT_POLICIES if not r.startswith("checkpoint_")]
    models = {r: Transformer(TINY, compute_dtype=jnp.float32, rngs=nnx.Rngs(0), remat=r) for r in policies}
    grads = nnx.jit(lambda ms: {r: nnx.value_and_grad(loss)(m) for r, m in ms.items()})(models)
    want_loss, want = grads["none"]
    want = dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(want)))
    for remat in policies:
        got_loss, got = grads[remat]
        assert models[remat].remat == remat
        assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
        for path, g in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(got)):
            assert _rel(g, want[path]) <= 1e-6, (remat, jax.tree_util.keystr(path), _rel(g, want[path]))


def _step_bytes(remat, *, layers=4, tokens=2048, chunk_tokens=256):
    """temp + output bytes of the compiled value_and_grad of a logprob loss, from abstract shapes.
    Widths where a layer's activations (not the head, not the weights) dominate: d=256, ffn 1024."""
    config = ModelConfig(family="qwen3", vocab_size=1024, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = nnx.eval_shape(lambda: Transformer(config, param_dtype=jnp.float32, compute_dtype=jnp.bfloat16,
                                               rngs=nnx.Rngs(0), attention_impl=NON_DENSE, remat=remat))
    graphdef, state = nnx.split(model)
    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)   # the mask is an input too: a constant one
    # made XLA constant-fold the attention's block ranges (seconds of compile time)

    def loss(state, ids, mask):
        logp, _ = sequence_logprobs(nnx.merge(graphdef, state), ids, mask, chunk_tokens=chunk_tokens)
        return logp.sum()

    stats = jax.jit(jax.value_and_grad(loss)).lower(state, ids, ids).compile().memory_analysis()
    return stats.temp_size_in_bytes + stats.output_size_in_bytes


@pytest.mark.slow  # four compiles of a 2-4 layer step: ~20 s
def test_full_remat_lowers_the_compiled_step_memory():
    """4 layers, chunked head, non-dense attention (dense where none exists yet): 'full' keeps one [T, D]
    f32 input per layer plus one layer's recomputation, 'none' every layer's activations.
    (Measured, XLA:CPU, blockwise: none 201 MiB, full 76 MiB; per layer 45 vs 6 MiB, of which
    3.9 MiB are the layer's parameter gradients.)"""
    none, full = _step_bytes("none"), _step_bytes("full")
    assert full < 0.5 * none, (full, none)
    # per layer 'full' adds one residual (2048 x 256 x 4 B = 2 MiB) + its gradients, 'none' a whole layer
    full_2, none_2 = _step_bytes("full", layers=2), _step_bytes("none", layers=2)
    assert (full - full_2) / 2 < 0.25 * (none - none_2) / 2, (full, full_2, none, none_2)


def test_knobs_from_memory_config_and_bad_knobs_are_one_clear_error():
    from portable_rl.learner_jax.memory import MemoryConfig

    model = Transformer(TINY, **MemoryConfig(attention_impl="auto", remat="dots_saveable").model_kwargs())
    assert model.remat == "dots_saveable" and model.attention_impl == resolve_attention_impl("auto") != "auto"
    assert all(layer.attn.attention_impl == model.attention_impl for layer in model.layers)
    assert Transformer(TINY, remat="none").remat == "none" and Transformer(TINY, remat="full").remat == "full"
    with pytest.raises(ValueError, match=r"remat='everything'; use one of"):
        Transformer(TINY, remat="everything")
    with pytest.raises(ValueError, match=r"attention_impl='flash'"):
        Transformer(TINY, attention_impl="flash")
