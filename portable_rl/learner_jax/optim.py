"""AdamW with global-norm clipping and a warmup + constant / cosine learning-rate schedule.

    lr(s) = learning_rate * min(1, (s + 1) / warmup_steps) * decay(s)
    decay(s) = 1                                              (constant)
             = 0.5 * (1 + cos(pi * clip((s - warmup) / (total - warmup), 0, 1)))   (cosine, to 0)

The first step already has a non-zero learning rate. Weight decay applies to matrices only
(ndim >= 2), not to norm gains or biases. The whole chain is wrapped in `optax.inject_hyperparams`,
so the learning rate used by the last update is readable with `current_learning_rate`.
`with_master_weights` wraps any optimizer for bf16 params with f32 master params in its state.
`moment1_dtype="bfloat16"` stores AdamW's first moment mu in bf16 (optax's `mu_dtype`), 2 of the state's
bytes per parameter instead of 4; the second moment stays in the master dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from portable_rl.errors import ConfigError


def make_schedule(learning_rate: float, warmup_steps: int = 0, total_steps: int | None = None,
                  schedule: str = "constant") -> optax.Schedule:
    if schedule not in ("constant", "cosine"):
        raise ConfigError(f"unknown schedule {schedule!r}; expected 'constant' or 'cosine'")
    if schedule == "cosine" and not total_steps:
        raise ConfigError("schedule='cosine' needs total_steps > 0")
    warmup = max(int(warmup_steps), 0)

    def lr(step):
        step = jnp.asarray(step, jnp.float32)
        factor = jnp.minimum(1.0, (step + 1.0) / max(warmup, 1))
        if schedule == "cosine":
            progress = jnp.clip((step - warmup) / max(total_steps - warmup, 1), 0.0, 1.0)
            factor = factor * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return learning_rate * factor

    return lr


def _decay_mask(params):
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(*, learning_rate: float, warmup_steps: int = 0, total_steps: int | None = None,
                   schedule: str = "constant", weight_decay: float = 0.0, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8, max_grad_norm: float | None = 1.0,
                   moment1_dtype: str | None = None) -> optax.GradientTransformation:
    """clip_by_global_norm(max_grad_norm) -> AdamW(lr schedule) (the schedule: module doc).

    Args:
      learning_rate: the peak learning rate, reached after the warmup.
      warmup_steps: optimizer updates of linear warmup (the first update already uses learning_rate /
        warmup_steps); 0: none.
      total_steps: optimizer updates over which "cosine" decays to 0 (required by it); unused by "constant".
      schedule: "constant" or "cosine", after the warmup.
      weight_decay: AdamW's decoupled weight decay, on matrices only (not norm gains or biases); 0: none.
      b1: Adam's first-moment decay.
      b2: Adam's second-moment decay.
      eps: Adam's epsilon, added to the root of the second moment.
      max_grad_norm: clip the gradient to this global L2 norm before AdamW; None or 0: no clipping.
      moment1_dtype: dtype of AdamW's first moment ("bfloat16" or "float32"); None: that of the params it
        steps (the f32 master under `with_master_weights`). Only the first moment: the second's EMA increment
        (1 - b2) * g^2 is below a bf16 ulp of itself at b2 = 0.999, so a bf16 second moment would stall.
    """
    if moment1_dtype not in (None, "bfloat16", "float32"):
        raise ConfigError(f"moment1_dtype={moment1_dtype!r}: use None, 'bfloat16' or 'float32'")

    def chain(learning_rate, max_grad_norm=None):
        clip = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm is not None else []
        return optax.chain(*clip, optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, mu_dtype=moment1_dtype,
                                              weight_decay=weight_decay, mask=_decay_mask))

    hyperparams = {"learning_rate": make_schedule(learning_rate, warmup_steps, total_steps, schedule)}
    if max_grad_norm:  # in the state, so a per-layer update (step.update_by_layer) clips by the global norm
        hyperparams["max_grad_norm"] = float(max_grad_norm)
    return optax.inject_hyperparams(chain)(**hyperparams)


def hyperparameter(opt_state, name: str):
    """A hyperparameter of the last update (`learning_rate`, `max_grad_norm`), read from the
    `inject_hyperparams` state that `make_optimizer` puts at the top of the optimizer state; None where the
    optimizer has none of that name (another optimizer, or no clipping)."""
    if isinstance(opt_state, MasterWeightsState):
        opt_state = opt_state.inner
    hyperparams = getattr(opt_state, "hyperparams", None)
    if not hyperparams or name not in hyperparams:
        return None
    value = hyperparams[name]
    return value[...] if hasattr(value, "get_value") else value


def current_learning_rate(opt_state):
    """The learning rate of the last update; None for optimizers not made by `make_optimizer`."""
    return hyperparameter(opt_state, "learning_rate")


class MasterWeightsState(NamedTuple):
    master: optax.Params     # full-precision copy of the params; the optimizer steps these
    inner: optax.OptState    # the wrapped optimizer's state (moments in the master dtype)


def with_master_weights(inner: optax.GradientTransformation, dtype=jnp.float32) -> optax.GradientTransformation:
    """Mixed precision: low-precision (bf16) model params, full-precision master params in the optimizer state.

        master ← master + inner_update(grads.astype(f32), master)      the optimizer only ever sees f32
        params ← round_bf16(master)                                      what the model (and engines) use

    Why: small AdamW steps vanish when added to bf16 params directly (|Δ| < half a bf16 ulp); the master
    keeps them. And the model itself is bf16, so the weight push hands engines the model's own buffers
    (DLPack, zero-copy) instead of casting every parameter at each sync (docs/experiments/cpu_rollouts.md,
    "Weight sync").
    The update returned to `optax.apply_updates` is round_bf16(master) − params computed in f32, which is
    exact (both are bf16 values), so the params equal round_bf16(master) bit for bit after every step.
    """

    def init(params):
        master = jax.tree.map(lambda p: jnp.asarray(p, dtype), params)
        return MasterWeightsState(master=master, inner=inner.init(master))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("with_master_weights needs params in update(); nnx.Optimizer passes them")
        grads = jax.tree.map(lambda g: jnp.asarray(g, dtype), grads)
        updates, inner_state = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        to_params = jax.tree.map(
            lambda m, p: m.astype(p.dtype).astype(dtype) - p.astype(dtype), master, params)
        return to_params, MasterWeightsState(master=master, inner=inner_state)

    return optax.GradientTransformation(init, update)
