"""One optimizer step: grads of a user loss, an in-place `nnx.Optimizer` update, scalar metrics.

    (loss, metrics), grads = value_and_grad(loss_fn)(model, batch)     grads w.r.t. nnx.Param
    optimizer.update(model, grads)                                     clip + AdamW (optim.py)
    metrics += {loss, grad_norm (before clipping), learning_rate (used by this update)}

`make_train_step` does it in one call. With gradient accumulation over micro-batches j (a loss that
is a sum of per-micro-batch terms, e.g. `losses.policy_loss(..., token_weights=)`):

    G = zero_grads(model)                        f32, laid out (sharded) like the params
    metrics_j = grad_step(model, batch_j, G)     G += ∇ loss_j in place (G's buffers donated)
    apply_step(model, optimizer, G)              one optimizer update with Σ_j ∇ loss_j; grad_norm of it
                                                 (make_apply_step(by_layer=True): one call per layer)

Functions that only read the model (`grad_step`, the learner's forwards) are jitted with
`graph_updates=False`: `nnx.jit` then returns only the variables a call changed. By default it returns the
state of every graph node it was given, i.e. a copy of the params on every call and, for `grad_step`, a
second gradient-sized buffer (docs/experiments/learner_performance.md, "Read-only steps").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from portable_rl.errors import ConfigError
from portable_rl.learner_jax.optim import MasterWeightsState, current_learning_rate, hyperparameter


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


def make_apply_step(by_layer: bool = False) -> Callable:
    """jitted `fn(model, optimizer, grads) -> {grad_norm, learning_rate}`: one optimizer update with the
    accumulated `grads` (donated, with the model's and optimizer's buffers as in `make_train_step`).
    `by_layer`: the same update as one jitted call per layer (`LayerwiseApplyStep`)."""
    if by_layer:
        return LayerwiseApplyStep()

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


def layer_groups(params) -> list[tuple]:
    """The update groups of a params tree, in order: each decoder layer (`("layers", i)`), and each other
    top-level module (`("embed",)`, `("final_norm",)`, `("lm_head",)`)."""
    groups = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [k.key for k in path]
        group = tuple(keys[:2]) if len(keys) > 1 and isinstance(keys[1], int) else tuple(keys[:1])
        if group not in groups:
            groups.append(group)
    return groups


class GroupCall(NamedTuple):
    """One group's call of `LayerwiseApplyStep`: indices into the flat params (and grads) and optimizer state."""
    group: tuple
    spec: tuple            # static: (cut state treedef, which of its leaves the group owns, group params treedef)
    params: list[int]      # the group's params (and grads) leaves
    owned: list[int]       # its optimizer leaves (moments, master weights), written by its call
    shared: list[int]      # the step count and hyperparameters, read by every call

    def arguments(self, params: list, state: list, grads: list) -> tuple:
        """The call's array arguments, from the flat params, optimizer state and grads leaves."""
        return ([params[i] for i in self.params], [state[i] for i in self.owned], [state[i] for i in self.shared],
                [grads[i] for i in self.params])


class LayerwiseApplyStep:
    """`make_apply_step()`'s update, run as one jitted call per layer group (`layer_groups`).

    Why: one jitted update computes its f32 temporaries (AdamW's direction, the clipped gradient) for every
    parameter before it writes any: ~1.25 parameter-sized f32 buffers, the learner's peak for a large model
    (docs/experiments/moe.md). XLA may order one program's independent ops so (and XLA:CPU drops optimization
    barriers), so the order is fixed here, between calls:

        norm      = ‖grads‖ (f32)                              one read-only call over all the grads (bf16 params
                                                               without master weights: also ‖bf16(grads)‖, what the
                                                               optimizer's clip sees; grad_norm reports the f32 one)
        per group = clip(grads_g, norm) → optimizer.tx.update(grads_g, state_g, params_g) → params_g, state_g
                    one call per group, its params and optimizer leaves donated: written in place

    state_g is the optimizer state with every parameter-shaped subtree (moments, master weights) cut to the
    group's part; the step count and hyperparameters are read by every call and taken from the first. The
    global-norm clip is AdamW's one whole-tree step: it is applied here with the whole tree's norm and the max
    norm that `make_optimizer` keeps among its hyperparameters, so the optimizer's own clip, which sees a
    group's smaller norm, leaves the gradient as it is. Same update as `make_apply_step()` to float rounding
    (tested). Decoder layers of one kind share one compilation.
    """

    def __init__(self):
        self.norm = jax.jit(lambda grads: optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads)))
        self.clip_norm = jax.jit(optax.tree.norm)  # as optax.clip_by_global_norm computes it (bf16 grads: bf16)
        self._updates = {}  # optimizer.tx -> its jitted group update
        self._plans = {}    # (params treedef, optimizer state treedef) -> `plan`'s calls

    def group_update(self, tx):
        """jitted `fn(spec, params, owned, shared, grads, norm) -> (params, owned, shared)` (flat leaf lists)."""
        if tx not in self._updates:
            def update(spec, params, owned_state, shared_state, grads, norm):
                state_def, owned, params_def = spec
                it_owned, it_shared = iter(owned_state), iter(shared_state)
                state = jax.tree.unflatten(state_def, [next(it_owned) if o else next(it_shared) for o in owned])
                params, grads = jax.tree.unflatten(params_def, params), jax.tree.unflatten(params_def, grads)
                max_norm = hyperparameter(state, "max_grad_norm")
                if max_norm is not None:  # optax.clip_by_global_norm's arithmetic, with the whole tree's norm
                    grads = jax.tree.map(
                        lambda t: jax.lax.select(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm), grads)
                updates, state = tx.update(grads, state, params)
                leaves = jax.tree.leaves(state)
                return (jax.tree.leaves(optax.apply_updates(params, updates)),
                        [x for x, o in zip(leaves, owned) if o], [x for x, o in zip(leaves, owned) if not o])
            self._updates[tx] = jax.jit(update, static_argnums=(0,), donate_argnums=(1, 2))
        return self._updates[tx]

    def plan(self, params, opt_state) -> list[GroupCall]:
        """Each group's call, from pure (`nnx.as_pure`) params and optimizer state; worked out once per tree
        structure (it walks every subtree of the optimizer state once per group)."""
        key = (jax.tree.structure(params), jax.tree.structure(opt_state))
        if key not in self._plans:
            self._plans[key] = self._group_calls(params, opt_state)
        return self._plans[key]

    @staticmethod
    def _group_calls(params, opt_state) -> list[GroupCall]:
        params_def = jax.tree.structure(params)
        is_params_like = lambda t: jax.tree.structure(t) == params_def  # noqa: E731
        params_index = jax.tree.unflatten(params_def, range(params_def.num_leaves))
        state_def = jax.tree.structure(opt_state)
        state_index = jax.tree.unflatten(state_def, range(state_def.num_leaves))
        calls = []
        for group in layer_groups(params):
            part = lambda tree: functools.reduce(lambda t, k: t[k], group, tree)  # noqa: E731
            cut = jax.tree.map(lambda t: part(t) if is_params_like(t) else t, state_index, is_leaf=is_params_like)
            owned = set(jax.tree.leaves(jax.tree.map(lambda t: part(t) if is_params_like(t) else None, state_index,
                                                     is_leaf=is_params_like)))
            cut_leaves = jax.tree.leaves(cut)
            spec = (jax.tree.structure(cut), tuple(i in owned for i in cut_leaves),
                    jax.tree.structure(part(params_index)))
            calls.append(GroupCall(group, spec, jax.tree.leaves(part(params_index)),
                                   [i for i in cut_leaves if i in owned], [i for i in cut_leaves if i not in owned]))
        return calls

    def pure_arrays(self, model, optimizer: nnx.Optimizer, grads):
        """(params, optimizer state, grads, the grads as `make_apply_step()` hands them to the optimizer) as
        pure trees: the accumulated grads, then cast to the params' dtype unless master weights take them."""
        opt_state = nnx.as_pure(optimizer.opt_state)
        if current_learning_rate(opt_state) is None:
            raise ConfigError("a per-layer optimizer update (learner_jax.MemoryConfig.update_by_layer) needs the "
                              "optimizer of learner_jax.make_optimizer; set update_by_layer=False for another one")
        params = nnx.as_pure(nnx.state(model, nnx.Param))
        grads = nnx.as_pure(nnx.state(grads, nnx.Param))
        handed = grads
        if not isinstance(optimizer.opt_state, MasterWeightsState) and any(
                g.dtype != p.dtype for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params))):
            handed = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        return params, opt_state, grads, handed

    def __call__(self, model, optimizer: nnx.Optimizer, grads) -> dict:
        params, opt_state, accumulated, grads = self.pure_arrays(model, optimizer, grads)
        grad_norm = self.norm(accumulated)  # reported: the f32 sum's norm, as the whole-tree step reports it
        # the clip's: of the grads the optimizer is handed, as its clip computes it (differs for bf16 params alone)
        norm = grad_norm if grads is accumulated else self.clip_norm(grads)
        fn = self.group_update(optimizer.tx)
        p, params_def = jax.tree.flatten(params)
        s, state_def = jax.tree.flatten(opt_state)
        g = jax.tree.leaves(grads)
        shared = {}
        for k, call in enumerate(self.plan(params, opt_state)):
            new_p, new_owned, new_shared = fn(call.spec, *call.arguments(p, s, g), norm)
            for i, x in zip(call.params, new_p):
                p[i] = x
            for i, x in zip(call.owned, new_owned):
                s[i] = x
            if k == 0:  # every call read the step count before this update; the first one's new value is kept
                shared = dict(zip(call.shared, new_shared))
        for i, x in shared.items():
            s[i] = x
        nnx.update(model, jax.tree.unflatten(params_def, p))
        nnx.update(optimizer.opt_state, nnx.state(jax.tree.unflatten(state_def, s)))
        optimizer.step[...] += 1
        metrics = {"grad_norm": grad_norm}
        lr = current_learning_rate(optimizer.opt_state)
        if lr is not None:
            metrics["learning_rate"] = lr
        return metrics
