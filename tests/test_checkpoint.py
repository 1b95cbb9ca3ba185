"""Orbax checkpoints: exact round trip, exact resume, keep-last-k, and no restore of partial steps."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from portable_rl.learner_jax.checkpoint import COMMIT_MARKER, Checkpointer, latest_step
from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.logprobs import sequence_logprobs
from portable_rl.learner_jax.model import Transformer
from portable_rl.learner_jax.optim import make_optimizer
from portable_rl.learner_jax.step import make_train_step

TINY = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16)
IDS = jnp.asarray(np.random.RandomState(0).randint(0, 64, size=(2, 8)), jnp.int32)


def loss_fn(model, batch):
    logp, _ = sequence_logprobs(model, batch, None, 1.0)
    return -logp[:, 1:].mean(), {}


train_step = make_train_step(loss_fn)


def fresh(seed=0):
    model = Transformer(TINY, compute_dtype=jnp.float32, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, make_optimizer(learning_rate=1e-2, warmup_steps=2), wrt=nnx.Param)
    # Restored arrays are committed to a device; commit these too so the jitted step is not
    # compiled twice (jit's cache key includes committedness). Values are unchanged.
    for module in (model, optimizer):
        nnx.update(module, jax.device_put(nnx.state(module), jax.devices()[0]))
    return model, optimizer


def pure(module, what=...):
    """A snapshot (copies): the train step donates the model's and optimizer's buffers, so arrays
    merely read from them before a step are deleted by it."""
    return jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(module, what)))


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_round_trip_and_exact_resume(tmp_path):
    model, optimizer = fresh(0)
    for _ in range(2):
        train_step(model, optimizer, IDS)
    key = jax.random.key(7)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(2, model, optimizer, extra={"data_cursor": 40, "note": "x"}, rng=key)
    saved_params, saved_opt = pure(model, nnx.Param), pure(optimizer)
    continued = [float(train_step(model, optimizer, IDS)["loss"]) for _ in range(2)]

    model2, optimizer2 = fresh(1)  # different init: everything must come from the checkpoint
    restored = Checkpointer(tmp_path / "ckpt").restore(model2, optimizer2)
    assert restored.step == 2 and restored.extra == {"data_cursor": 40, "note": "x"}
    assert jnp.array_equal(jax.random.key_data(restored.rng), jax.random.key_data(key))
    assert_trees_equal(pure(model2, nnx.Param), saved_params)
    assert_trees_equal(pure(optimizer2), saved_opt)
    resumed = [float(train_step(model2, optimizer2, IDS)["loss"]) for _ in range(2)]
    assert resumed == continued  # bit-exact continuation
    assert_trees_equal(pure(model2, nnx.Param), pure(model, nnx.Param))


def test_model_only_restore_and_errors(tmp_path):
    model, optimizer = fresh(0)
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        ckpt.restore(model)
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        ckpt.read_extra()
    ckpt.save(5, model, extra={"a": 1})          # model only, no rng
    assert ckpt.read_extra() == ckpt.read_extra(5) == {"a": 1}  # without building or loading a model
    other, other_opt = fresh(3)
    with pytest.raises(ValueError, match="no optimizer state"):
        ckpt.restore(other, other_opt)
    restored = ckpt.restore(other)
    assert restored.rng is None and restored.extra == {"a": 1}
    assert_trees_equal(pure(other, nnx.Param), pure(model, nnx.Param))
    with pytest.raises(TypeError):
        ckpt.save(6, model, extra={"bad": object()})
    assert ckpt.all_steps() == [5]


def test_keeps_last_k(tmp_path):
    model, optimizer = fresh(0)
    ckpt = Checkpointer(tmp_path, max_to_keep=2)
    for step in (1, 2, 3, 4):
        ckpt.save(step, model, optimizer, rng=jnp.array([1, 2], jnp.uint32))
    assert ckpt.all_steps() == [3, 4] and latest_step(tmp_path) == 4
    assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["3", "4"]
    assert ckpt.restore(model, optimizer).rng.tolist() == [1, 2]


def test_partially_written_step_is_never_restored(tmp_path):
    model, optimizer = fresh(0)
    Checkpointer(tmp_path).save(3, model, optimizer, extra={"step": 3})
    # A crash mid-write: a step directory with content but no commit marker, and an orbax temp dir.
    partial = tmp_path / "9"
    (partial / "model").mkdir(parents=True)
    (partial / "model" / "garbage").write_bytes(b"\0" * 10)
    (tmp_path / "10.orbax-checkpoint-tmp-123").mkdir()
    assert latest_step(tmp_path) == 3
    ckpt = Checkpointer(tmp_path)
    assert not partial.exists()  # moved aside on open, not deleted
    assert [p.name.split("-")[:2] for p in tmp_path.glob("incomplete-*")] == [["incomplete", "9"]]
    assert ckpt.restore(model, optimizer).extra == {"step": 3}
    ckpt.save(9, model, optimizer)  # the step number is free again
    assert (tmp_path / "9" / COMMIT_MARKER).exists() and ckpt.latest_step() == 9
    assert latest_step(tmp_path / "missing") is None
