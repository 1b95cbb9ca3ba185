"""The learner side of one RL step: old logprobs, rollout correction, mini-batch updates, weight push.

    old_t          = log_softmax(π_θ_old(x_<t) / T)[x_t]        recomputed by the Flax policy (fp32)
    w_t, keep_t    = tis.apply_rollout_correction(cfg, old, rollout, response_mask)
    loss           = policy_loss(new, old, A, response_mask · keep, correction_weights=w)   per mini-batch

All jitted functions see fixed shapes: rows = mini_batch_size · n, T from a few length buckets.

With a `mesh` (learner_jax/sharding.py) the model and optimizer state are sharded over it once, and
every batch the jitted functions see is split by rows over ("data", "fsdp"); the jitted functions are
the same, GSPMD partitions them. Batches come in and metrics / logprobs go out as host numpy arrays.
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
from portable_rl.learner_jax.sharding import batch_shards, pad_rows, shard_batch, shard_model_and_optimizer, to_host
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
    def __init__(self, model, optimizer: nnx.Optimizer, cfg, correction: tis.RolloutCorrectionConfig, *,
                 mesh: jax.sharding.Mesh | None = None):
        """`mesh`: shard model + optimizer over it (in place) and run every step sharded; None: as is."""
        self.model, self.optimizer, self.cfg, self.correction = model, optimizer, cfg, correction
        self.mesh = mesh
        if mesh is not None:
            shard_model_and_optimizer(model, optimizer, mesh)
            if cfg.rows_per_minibatch % batch_shards(mesh):
                raise ValueError(f"rows_per_minibatch={cfg.rows_per_minibatch} (mini_batch_size × n_samples) is not "
                                 f"a multiple of the mesh's {batch_shards(mesh)} batch shards (data × fsdp)")
        temperature = cfg.temperature
        self._logprobs = nnx.jit(lambda m, ids, am: sequence_logprobs(m, ids, am, temperature)[0])
        self._correct = jax.jit(functools.partial(tis.apply_rollout_correction, correction))
        self._train_step = make_train_step(make_loss_fn(cfg, temperature))

    def logprobs(self, input_ids, attention_mask) -> np.ndarray:
        """[B, T] logprobs of the current policy at the rollout temperature (entry t: token t given < t)."""
        if self.mesh is None:
            return np.asarray(self._logprobs(self.model, input_ids, attention_mask))
        rows = len(input_ids)  # any B (e.g. the probe): pad with empty rows to a multiple of the shards
        ways = batch_shards(self.mesh)
        batch = shard_batch({"input_ids": pad_rows(np.asarray(input_ids), ways),
                             "attention_mask": pad_rows(np.asarray(attention_mask), ways)}, self.mesh)
        return to_host(self._logprobs(self.model, batch["input_ids"], batch["attention_mask"]))[:rows]

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
                if self.mesh is not None:
                    mb = shard_batch(mb, self.mesh)
                history.append({k: float(v) for k, v in self._train_step(self.model, self.optimizer, mb).items()})
        if not history:
            return {}
        return {f"train/{k}": float(np.mean([h[k] for h in history])) for k in history[0]}
