"""One optimizer step: grads of a user loss, an in-place `nnx.Optimizer` update, scalar metrics.

    (loss, metrics), grads = value_and_grad(loss_fn)(model, batch)     grads w.r.t. nnx.Param
    optimizer.update(model, grads)                                     clip + AdamW (optim.py)
    metrics += {loss, grad_norm (before clipping), learning_rate (used by this update)}

`make_train_step` does it in one call. With gradient accumulation over micro-batches j (a loss that
is a sum of per-micro-batch terms, e.g. `losses.policy_loss(..., token_weights=)`):

    G = zero_grads(model)                        f32, laid out (sharded) like the params
    metrics_j = grad_step(model, batch_j, G)     G += ∇ loss_j in place (G's buffers donated)
    apply_step(model, optimizer, G)              one optimizer update with Σ_j ∇ loss_j; grad_norm of it

Functions that only read the model (`grad_step`, the learner's forwards) are jitted with
`graph_updates=False`: `nnx.jit` then returns only the variables a call changed. By default it returns the
state of every graph node it was given, i.e. a copy of the params on every call and, for `grad_step`, a
second gradient-sized buffer (docs/experiments/learner_performance.md, "Read-only steps").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from portable_rl.learner_jax.optim import MasterWeightsState, current_learning_rate


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


def zero_grads(model, dtype=jnp.float32):
    """A gradient accumulator: zeros shaped (and sharded) like the model's `nnx.Param`s, in `dtype`
    (f32: bf16 params would otherwise sum micro-batch gradients in bf16)."""
    params = nnx.state(model, nnx.Param)
    return jax.tree.map(lambda p: jnp.zeros(p.shape, dtype, device=p.sharding), params)


def make_grad_step(loss_fn: Callable) -> Callable:
    """jitted `fn(model, batch, grad_sum) -> metrics` that adds ∇loss to `grad_sum` (from `zero_grads`) in
    place: its buffers are donated and written, so accumulating costs no second gradient-sized buffer, and
    the model, only read, is not copied out (module doc)."""

    def accumulate(acc: nnx.Variable, g: nnx.Variable) -> None:
        acc[...] = acc[...] + g[...].astype(acc.dtype)

    @functools.partial(nnx.jit, donate_argnums=(2,), graph_updates=False)
    def grad_step(model, batch, grad_sum):
        grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.Param), has_aux=True)
        (loss, metrics), grads = grad_fn(model, batch)
        jax.tree.map(accumulate, grad_sum, grads, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return dict(metrics, loss=loss)

    return grad_step


def make_apply_step() -> Callable:
    """jitted `fn(model, optimizer, grads) -> {grad_norm, learning_rate}`: one optimizer update with the
    accumulated `grads` (donated, with the model's and optimizer's buffers as in `make_train_step`)."""

    @functools.partial(nnx.jit, donate_argnums=(0, 1, 2))
    def apply_step(model, optimizer: nnx.Optimizer, grads):
        grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        if not isinstance(optimizer.opt_state, MasterWeightsState):
            # what a one-call step hands the optimizer: grads in the params' dtype (optax keeps moment
            # dtypes); the master-weights wrapper takes the f32 sum as it is.
            params = nnx.state(model, nnx.Param)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        optimizer.update(model, grads)
        metrics = {"grad_norm": grad_norm}
        lr = current_learning_rate(optimizer.opt_state)
        if lr is not None:
            metrics["learning_rate"] = lr
        return metrics

    return apply_step
