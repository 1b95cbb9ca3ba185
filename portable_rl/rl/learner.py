"""The learner side of one RL step: old logprobs, rollout correction, mini-batch updates, weight push.

    old_t          = log_softmax(π_θ_old(x_<t) / T)[x_t]        recomputed by the Flax policy (fp32)
    w_t, keep_t    = tis.apply_rollout_correction(cfg, old, rollout, response_mask)
    loss           = policy_loss(new, old, A, response_mask · keep, correction_weights=w)   per mini-batch

All jitted functions see fixed shapes: rows = mini_batch_size · n, T from a few length buckets.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from portable_rl import tis
from portable_rl.learner_jax.logprobs import sequence_logprobs
from portable_rl.learner_jax.losses import policy_loss
from portable_rl.learner_jax.step import make_train_step
from portable_rl.rl.batching import split_rows


def make_loss_fn(cfg, temperature: float):
    def loss_fn(model, batch):
        new_logp, entropy = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], temperature)
        mask = batch["response_mask"] * batch["keep_mask"]                          # [B, T]
        loss, metrics = policy_loss(
            new_logp, batch["old_logprobs"], batch["advantages"], mask,
            rollout_logprobs=batch["rollout_logprobs"], correction_weights=batch["tis_weights"],
            clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high, dual_clip_c=cfg.dual_clip_c,
            aggregation=cfg.loss_aggregation, mode=cfg.policy_loss_mode)
        valid = batch["response_mask"] > 0
        metrics["entropy"] = jnp.where(valid, entropy, 0.0).sum() / jnp.maximum(valid.sum(), 1)
        return loss, metrics
    return loss_fn


class Learner:
    def __init__(self, model, optimizer: nnx.Optimizer, cfg, correction: tis.RolloutCorrectionConfig):
        self.model, self.optimizer, self.cfg, self.correction = model, optimizer, cfg, correction
        temperature = cfg.temperature
        self._logprobs = nnx.jit(lambda m, ids, am: sequence_logprobs(m, ids, am, temperature)[0])
        self._correct = jax.jit(functools.partial(tis.apply_rollout_correction, correction))
        self._train_step = make_train_step(make_loss_fn(cfg, temperature))

    def logprobs(self, input_ids, attention_mask) -> np.ndarray:
        """[B, T] logprobs of the current policy at the rollout temperature (entry t: token t given < t)."""
        return np.asarray(self._logprobs(self.model, input_ids, attention_mask))

    def old_logprobs(self, batch: dict) -> np.ndarray:
        """[B, T] logprobs of the current (pre-update) policy, computed mini-batch by mini-batch."""
        parts = [self.logprobs(mb["input_ids"], mb["attention_mask"])
                 for mb in split_rows(batch, self.cfg.rows_per_minibatch)]
        return np.concatenate(parts) * batch["response_mask"]

    def correct(self, batch: dict) -> dict:
        """Adds old_logprobs, tis_weights, keep_mask to `batch`; returns the `tis/*` diagnostics."""
        old = self.old_logprobs(batch)
        weights, keep, metrics = self._correct(old, batch["rollout_logprobs"], batch["response_mask"])
        batch.update(old_logprobs=old, tis_weights=np.asarray(weights), keep_mask=np.asarray(keep))
        return {f"tis/{k}": float(v) for k, v in metrics.items()}

    def update(self, batch: dict) -> dict:
        """ppo_epochs passes of mini-batch updates; returns metrics averaged over updates."""
        history = []
        for _ in range(self.cfg.ppo_epochs):
            for mb in split_rows(batch, self.cfg.rows_per_minibatch):
                if not mb["response_mask"].any():   # all-padding mini-batch (short dynamic-sampling step)
                    continue
                history.append({k: float(v) for k, v in self._train_step(self.model, self.optimizer, mb).items()})
        if not history:
            return {}
        return {f"train/{k}": float(np.mean([h[k] for h in history])) for k in history[0]}
