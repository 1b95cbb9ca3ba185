"""DAPO / GRPO settings and the batch they turn kept rollout groups into.

Per kept group (one prompt, n samples) with task rewards r and response lengths |y|:

    shaped_i = r_i + R_len(|y_i|)                        overlong shaping (if overlong_buffer > 0)
    A_i      = (shaped_i − mean) / (std + ε)             advantage="grpo"
             =  shaped_i − mean                          advantage="drgrpo"

then every token of response i gets A_i (`batching.pack_rollouts`). DAPO = dynamic sampling +
clip-higher (ε_low=0.2, ε_high=0.28) + token-mean aggregation + overlong shaping; GRPO = none of the
first two and seq-mean-token-mean (set `dynamic_sampling=False, clip_eps_high=0.2,
loss_aggregation="seq-mean-token-mean"`; see gin/grpo_bf16.gin).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from portable_rl.errors import ConfigError
from portable_rl.learner_jax import advantages as adv_lib
from portable_rl.rl.batching import pack_rollouts

ADVANTAGES = ("grpo", "drgrpo")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DapoConfig:
    prompt_batch_size: int = 32      # prompt groups per training step (after dynamic sampling)
    n_samples: int = 16              # responses per prompt
    dynamic_sampling: bool = True    # drop groups whose rewards are all equal
    max_gen_batches: int = 3         # generation batches drawn per step at most (dynamic sampling)
    temperature: float = 1.0
    max_response_tokens: int = 64
    overlong_buffer: int = 0         # L_buf; 0 disables overlong shaping
    overlong_penalty: float = 1.0
    advantage: str = "grpo"
    mini_batch_size: int = 32        # prompt groups per optimizer update
    ppo_epochs: int = 1
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    dual_clip_c: Optional[float] = None
    loss_aggregation: str = "token-mean"
    loss_norm_constant: Optional[int] = None  # L of seq-mean-token-sum-norm; None: max_response_tokens
    policy_loss_mode: str = "decoupled"   # "decoupled": old logprobs recomputed | "bypass": old := rollout
    min_seq_bucket: int = 16
    max_nonfinite_fraction: float = 0.01  # NaN/inf engine logprobs are masked; above this fraction the run stops

    def __post_init__(self):
        if self.advantage not in ADVANTAGES:
            raise ConfigError(f"advantage={self.advantage!r}; use one of {ADVANTAGES}")
        if self.n_samples < 2:
            raise ConfigError(f"n_samples={self.n_samples}: group advantages need at least 2 samples per prompt")
        if self.prompt_batch_size % self.mini_batch_size:
            raise ConfigError(f"prompt_batch_size={self.prompt_batch_size} must be a multiple of "
                              f"mini_batch_size={self.mini_batch_size}")
        if self.max_gen_batches < 1:
            raise ConfigError(f"max_gen_batches={self.max_gen_batches} must be >= 1")
        if not 0.0 <= self.max_nonfinite_fraction <= 1.0:
            raise ConfigError(f"max_nonfinite_fraction={self.max_nonfinite_fraction} must be in [0, 1]")

    @property
    def rows_per_minibatch(self) -> int:
        return self.mini_batch_size * self.n_samples

    @property
    def norm_constant(self) -> int:
        """L of seq-mean-token-sum-norm (Dr. GRPO): fixed across steps, the longest possible response."""
        return self.loss_norm_constant or self.max_response_tokens


def shaped_rewards(cfg: DapoConfig, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    if cfg.overlong_buffer <= 0:
        return rewards.astype(np.float32)
    penalty = adv_lib.overlong_reward_shaping(lengths, cfg.max_response_tokens, cfg.overlong_buffer,
                                              cfg.overlong_penalty)
    return rewards.astype(np.float32) + np.asarray(penalty)


def group_advantages(cfg: DapoConfig, shaped: np.ndarray) -> np.ndarray:
    fn = adv_lib.grpo_advantages if cfg.advantage == "grpo" else adv_lib.dr_grpo_advantages
    return np.asarray(fn(shaped, cfg.n_samples))


def build_batch(cfg: DapoConfig, groups, pad_id: int) -> tuple[dict, dict]:
    """groups: list of `ScoredGroup` (rl.rollout) → (the per-sequence view: one sequence per row, [B, T]
    with B a multiple of the mini-batch rows; `batching.pack_rollouts`), batch statistics).

    Sequence i is row i; mini-batch k is rows [k·rows_per_minibatch, (k+1)·rows_per_minibatch). The
    learner packs each mini-batch into its micro-batches (rl/learner.py)."""
    rollouts = [r for g in groups for r in g.rollouts]
    rewards = np.concatenate([g.rewards for g in groups]).astype(np.float32)      # [G*n]
    lengths = np.array([len(r.response_token_ids) for r in rollouts], np.float32)  # [G*n]
    shaped = shaped_rewards(cfg, rewards, lengths)
    adv = group_advantages(cfg, shaped)
    batch = pack_rollouts([r.prompt_token_ids for r in rollouts], [r.response_token_ids for r in rollouts],
                          [r.response_logprobs for r in rollouts], adv, pad_id=pad_id,
                          min_len=cfg.min_seq_bucket, row_multiple=cfg.rows_per_minibatch)
    stats = {"reward/shaped_mean": float(shaped.mean()), "advantage/abs_mean": float(np.abs(adv).mean()),
             "batch/sequences": len(rollouts), "batch/seq_len_bucket": batch["input_ids"].shape[1]}
    return batch, stats
