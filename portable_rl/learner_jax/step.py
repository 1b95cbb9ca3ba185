"""One optimizer step: grads of a user loss, an in-place `nnx.Optimizer` update, scalar metrics.

    (loss, metrics), grads = value_and_grad(loss_fn)(model, batch)     grads w.r.t. nnx.Param
    optimizer.update(model, grads)                                     clip + AdamW (optim.py)
    metrics += {loss, grad_norm (before clipping), learning_rate (used by this update)}
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from portable_rl.learner_jax.optim import current_learning_rate


def make_train_step(loss_fn: Callable) -> Callable:
    """`loss_fn(model, batch) -> (loss, metrics dict)`; returns jitted `fn(model, optimizer, batch) -> metrics`.

    Create the optimizer with `nnx.Optimizer(model, make_optimizer(...), wrt=nnx.Param)`.

    The model's and optimizer's buffers are donated: XLA writes the new params and moments into
    them instead of holding old and new copies at once (3-4x params of peak memory saved; on a GPU
    that decides whether a 7B step fits). A buffer still exported through DLPack (a torch view held
    by an engine) is not donated: JAX copies instead, so such a view keeps the old values (tested).
    A jax.Array read from the model before a step is deleted by it; to keep a snapshot (a reference
    policy, an EMA), copy it first: `jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))`.
    """

    @functools.partial(nnx.jit, donate_argnums=(0, 1))
    def train_step(model, optimizer: nnx.Optimizer, batch):
        grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.Param), has_aux=True)
        (loss, metrics), grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        # f32 norm: bf16 params (optim.with_master_weights) have bf16 grads, whose norm would round.
        grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        metrics = dict(metrics, loss=loss, grad_norm=grad_norm)
        lr = current_learning_rate(optimizer.opt_state)
        if lr is not None:
            metrics["learning_rate"] = lr
        return metrics

    return train_step
