"""DAPO / GRPO settings and the batch they turn kept rollout groups into.

Per kept group (one prompt, n samples) with task rewards r and response lengths |y|:

    shaped_i = r_i + R_len(|y_i|)                        overlong shaping (if overlong_buffer > 0); |y_i|: the
                                                         model's tokens (multi-turn: all its turns together)
    A_i      = (shaped_i − mean) / (std + ε)             advantage="grpo"
             =  shaped_i − mean                          advantage="drgrpo"

then every token of response i gets A_i (`batching.pack_rollouts`). A multi-turn trajectory is one response:
r_i is its summed reward, and A_i reaches only the tokens the engine sampled (response_mask 0 on
observations). DAPO = dynamic sampling + clip-higher (ε_low=0.2, ε_high=0.28) + token-mean aggregation +
overlong shaping; GRPO = none of the first two and seq-mean-token-mean (set `dynamic_sampling=False,
clip_eps_high=0.2, loss_aggregation="seq-mean-token-mean"`; see gin/grpo_bf16.gin).

`DapoConfig` holds the five parts of rl/config.py (generation, data, shapes, loss, safety); each setting is
read one way, through its part (`cfg.loss.clip_eps_high`), and gin binds it there
(`rl.LossConfig.clip_eps_high = 0.28`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from portable_rl.errors import ConfigError
from portable_rl.learner_jax import advantages as adv_lib
from portable_rl.rl.batching import pack_rollouts
from portable_rl.rl.config import DataConfig, GenerationConfig, LossConfig, SafetyConfig, ShapeConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class DapoConfig:
    """DAPO / GRPO: what is sampled, which groups are kept, how they are padded, the loss, and when to stop.

    Attributes:
      generation: what the engine samples per prompt (`rl.GenerationConfig`).
      data: how prompts become a step's groups (`rl.DataConfig`).
      shapes: the learner's padded shapes (`rl.ShapeConfig`).
      loss: advantages, PPO loss and updates (`rl.LossConfig`).
      safety: when a broken engine stops the run (`rl.SafetyConfig`).
    """
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    shapes: ShapeConfig = dataclasses.field(default_factory=ShapeConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    safety: SafetyConfig = dataclasses.field(default_factory=SafetyConfig)

    def __post_init__(self):
        if self.data.prompt_batch_size % self.loss.mini_batch_size:
            raise ConfigError(f"prompt_batch_size={self.data.prompt_batch_size} must be a multiple of "
                              f"mini_batch_size={self.loss.mini_batch_size}")

    @property
    def rows_per_minibatch(self) -> int:
        return self.loss.mini_batch_size * self.generation.n_samples

    @property
    def norm_constant(self) -> int:
        """L of seq-mean-token-sum-norm (Dr. GRPO): fixed across steps, the longest possible response."""
        return self.loss.loss_norm_constant or self.generation.max_response_tokens


def dapo_config(**fields) -> DapoConfig:
    """A `DapoConfig` from flat field names, each sorted into the part that owns it (`dapo_config(n_samples=4,
    mini_batch_size=2)`: GenerationConfig's and LossConfig's); the other fields keep their defaults. For
    tests, benchmarks and the planner, which set a handful of fields across several parts."""
    parts = {f.name: f.default_factory for f in dataclasses.fields(DapoConfig)}
    owner = {name: part for part, cls in parts.items() for name in (f.name for f in dataclasses.fields(cls))}
    unknown = sorted(set(fields) - set(owner))
    if unknown:
        raise TypeError(f"dapo_config: no part of DapoConfig has the fields {unknown}")
    kwargs = {part: cls(**{k: v for k, v in fields.items() if owner[k] == part}) for part, cls in parts.items()}
    return DapoConfig(**kwargs)


def shaped_rewards(cfg: DapoConfig, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    loss = cfg.loss
    if loss.overlong_buffer <= 0:
        return rewards.astype(np.float32)
    penalty = adv_lib.overlong_reward_shaping(lengths, cfg.generation.max_response_tokens, loss.overlong_buffer,
                                              loss.overlong_penalty)
    return rewards.astype(np.float32) + np.asarray(penalty)


def group_advantages(cfg: DapoConfig, shaped: np.ndarray) -> np.ndarray:
    fn = adv_lib.grpo_advantages if cfg.loss.advantage == "grpo" else adv_lib.dr_grpo_advantages
    return np.asarray(fn(shaped, cfg.generation.n_samples))


def build_batch(cfg: DapoConfig, groups, pad_id: int) -> tuple[dict, dict]:
    """groups: list of `ScoredGroup` (rl.rollout) → (the per-sequence view: one sequence per row, [B, T]
    with B a multiple of the mini-batch rows; `batching.pack_rollouts`), batch statistics).

    Sequence i is row i; mini-batch k is rows [k·rows_per_minibatch, (k+1)·rows_per_minibatch). The
    learner packs each mini-batch into its micro-batches (rl/learner.py)."""
    rollouts = [r for g in groups for r in g.rollouts]
    rewards = np.concatenate([g.rewards for g in groups]).astype(np.float32)      # [G*n]
    lengths = np.array([len(r.response_token_ids) if r.response_mask is None else sum(r.response_mask)
                        for r in rollouts], np.float32)                              # [G*n] model tokens
    shaped = shaped_rewards(cfg, rewards, lengths)
    adv = group_advantages(cfg, shaped)
    supports = None
    if cfg.generation.truncated:  # top-k / top-p: the supports
        if any(r.sampling_support is None for r in rollouts):
            raise ValueError("top_p / top_k sampling but a rollout has no sampling_support: the engine must "
                             "return it (SamplingConfig.return_support)")
        supports = [r.sampling_support for r in rollouts]
    multi_turn = any(r.response_mask is not None for r in rollouts)  # else: every response token was sampled
    routed = any(r.routed_experts is not None for r in rollouts)  # routing replay (rl.PrecisionConfig.routing)
    batch = pack_rollouts([r.prompt_token_ids for r in rollouts], [r.response_token_ids for r in rollouts],
                          [r.response_logprobs for r in rollouts], adv, pad_id=pad_id,
                          min_len=cfg.shapes.min_seq_bucket, row_multiple=cfg.rows_per_minibatch,
                          sampling_supports=supports, support_width=cfg.generation.top_k if supports else None,
                          response_masks=[r.response_mask for r in rollouts] if multi_turn else None,
                          turn_indices=[r.turn_index for r in rollouts] if multi_turn else None,
                          routed_experts=[r.routed_experts for r in rollouts] if routed else None)
    stats = {"reward/shaped_mean": float(shaped.mean()), "advantage/abs_mean": float(np.abs(adv).mean()),
             "batch/sequences": len(rollouts), "batch/seq_len_bucket": batch["input_ids"].shape[1]}
    return batch, stats
