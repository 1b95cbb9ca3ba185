"""The loop's settings, one small frozen config per concern; `dapo.DapoConfig` composes them.

    GenerationConfig   what the engine samples per prompt        n_samples, temperature, max_response_tokens,
                                                                   top_p, top_k
    DataConfig         how prompts become a step's groups          prompt_batch_size, dynamic_sampling,
                                                                   max_gen_batches
    ShapeConfig        the padded shapes the learner compiles for  min_seq_bucket
    LossConfig         advantages → PPO loss → optimizer updates    advantage, overlong_*, mini_batch_size,
                                                                   ppo_epochs, clip_*, dual_clip_c,
                                                                   loss_aggregation, loss_norm_constant,
                                                                   policy_loss_mode
    SafetyConfig       when a broken engine stops the run          max_nonfinite_fraction

Each validates its own fields (a one-line `ConfigError`); rules that tie two concerns together (e.g.
prompt_batch_size a multiple of mini_batch_size) are `DapoConfig`'s. Library code reads the part it needs
(`cfg.loss`, `cfg.generation`, ...). Gin users keep setting the flat names (`rl.DapoConfig.n_samples`):
`DapoConfig`'s fields are exactly these configs' fields, so no gin name changed.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from portable_rl.errors import ConfigError

ADVANTAGES = ("grpo", "drgrpo")
POLICY_LOSS_MODES = ("decoupled", "bypass")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    n_samples: int = 16              # responses per prompt
    temperature: float = 1.0
    max_response_tokens: int = 64
    # Truncated sampling: the engine returns each token's support and the learner renormalises over it,
    # so rollout and learner logprobs stay the same quantity (docs/tis.md). top_p < 1 needs top_k >= 1.
    top_p: float = 1.0
    top_k: int = -1                  # -1: off

    def __post_init__(self):
        if self.n_samples < 2:
            raise ConfigError(f"n_samples={self.n_samples}: group advantages need at least 2 samples per prompt")
        if self.max_response_tokens < 1:
            raise ConfigError(f"max_response_tokens={self.max_response_tokens} must be >= 1")
        if self.top_p != 1.0 and self.top_k == -1:  # the top_k-bound message, before SamplingConfig's
            raise ConfigError(f"top_p={self.top_p} needs top_k >= 1 too (e.g. rl.DapoConfig.top_k = 64): the engine "
                              "returns each token's sampling support, and top_k bounds its size")
        try:
            self.sampling()
        except ValueError as e:
            raise ConfigError(f"rl.DapoConfig: {e}") from None

    @property
    def truncated(self) -> bool:
        """True for top-k / top-p sampling: rollouts carry their sampling support."""
        return self.top_p != 1.0 or self.top_k != -1

    def sampling(self, *, seed=None, stop_token_ids=()):
        """The engines.base.SamplingConfig of a training rollout (truncated: with the support returned)."""
        from portable_rl.engines.base import SamplingConfig

        return SamplingConfig(temperature=self.temperature, max_tokens=self.max_response_tokens, n=self.n_samples,
                              seed=seed, stop_token_ids=stop_token_ids, top_p=self.top_p, top_k=self.top_k,
                              return_support=self.truncated)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    prompt_batch_size: int = 32      # prompt groups per training step (after dynamic sampling)
    dynamic_sampling: bool = True    # drop groups whose rewards are all equal
    max_gen_batches: int = 3         # generation batches drawn per step at most (dynamic sampling)

    def __post_init__(self):
        if self.max_gen_batches < 1:
            raise ConfigError(f"max_gen_batches={self.max_gen_batches} must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapeConfig:
    min_seq_bucket: int = 16         # shortest padded row: powers of two >= it (multiples of 64 past 64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
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
    # "decoupled": old logprobs recomputed, rollout correction applied | "bypass": old := rollout, no recompute,
    # no correction weights (rl/learner.py)
    policy_loss_mode: str = "decoupled"
    # decoupled: the first mini-batch's old logprobs are its own update's forward pass (stop-gradient; the
    # policy has not moved yet), one forward pass fewer per step; only with a token-local correction (token or
    # no TIS, no masks, no self-normalization), else recomputed like the others (rl/learner.py)
    old_logprobs_from_update: bool = True

    def __post_init__(self):
        from portable_rl.learner_jax.losses import AGGREGATIONS  # the loss owns the list; checked here, at config time

        if self.advantage not in ADVANTAGES:
            raise ConfigError(f"advantage={self.advantage!r}; use one of {ADVANTAGES}")
        if self.policy_loss_mode not in POLICY_LOSS_MODES:
            raise ConfigError(f"policy_loss_mode={self.policy_loss_mode!r}; use one of {POLICY_LOSS_MODES}")
        if self.loss_aggregation not in AGGREGATIONS:
            raise ConfigError(f"loss_aggregation={self.loss_aggregation!r}; use one of {AGGREGATIONS}")
        for name in ("mini_batch_size", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.overlong_buffer < 0:
            raise ConfigError(f"overlong_buffer={self.overlong_buffer} must be >= 0 (0 disables overlong shaping)")
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ConfigError(f"clip_eps_low={self.clip_eps_low}, clip_eps_high={self.clip_eps_high} must be >= 0")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ConfigError(f"dual_clip_c={self.dual_clip_c} must be > 1 (or None to disable dual clip)")
        if self.loss_norm_constant is not None and self.loss_norm_constant < 1:
            raise ConfigError(f"loss_norm_constant={self.loss_norm_constant} must be >= 1 (or None: max_response_tokens)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SafetyConfig:
    max_nonfinite_fraction: float = 0.01  # NaN/inf engine logprobs are masked; above this fraction the run stops

    def __post_init__(self):
        if not 0.0 <= self.max_nonfinite_fraction <= 1.0:
            raise ConfigError(f"max_nonfinite_fraction={self.max_nonfinite_fraction} must be in [0, 1]")


PARTS = {"generation": GenerationConfig, "data": DataConfig, "shapes": ShapeConfig, "loss": LossConfig,
         "safety": SafetyConfig}
