"""DAPO / GRPO settings and the batch they turn kept rollout groups into.

Per kept group (one prompt, n samples) with task rewards r and response lengths |y|:

    shaped_i = r_i + R_len(|y_i|)                        overlong shaping (if overlong_buffer > 0)
    A_i      = (shaped_i − mean) / (std + ε)             advantage="grpo"
             =  shaped_i − mean                          advantage="drgrpo"

then every token of response i gets A_i (`batching.pack_rollouts`). DAPO = dynamic sampling +
clip-higher (ε_low=0.2, ε_high=0.28) + token-mean aggregation + overlong shaping; GRPO = none of the
first two and seq-mean-token-mean (set `dynamic_sampling=False, clip_eps_high=0.2,
loss_aggregation="seq-mean-token-mean"`; see gin/grpo_bf16.gin).

Settings: `DapoConfig` is the flat union of the per-concern configs of rl/config.py (generation, data,
shapes, loss, safety), which gin sets by their old names; the functions below read the parts they use.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from portable_rl.errors import ConfigError
from portable_rl.learner_jax import advantages as adv_lib
from portable_rl.rl.batching import pack_rollouts
from portable_rl.rl.config import (ADVANTAGES, PARTS, DataConfig, GenerationConfig,  # noqa: F401 (re-exported)
                                   LossConfig, SafetyConfig, ShapeConfig)


class _DapoConfigBase:
    """Methods of `DapoConfig` (below), whose fields are the flat union of rl/config.py's parts."""

    def __post_init__(self):
        # Each part validates its own fields; then the rules that tie concerns together.
        parts = {name: cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})
                 for name, cls in PARTS.items()}
        object.__setattr__(self, "_parts", parts)  # not a field: eq / hash / repr stay the flat fields'
        if self.prompt_batch_size % self.mini_batch_size:
            raise ConfigError(f"prompt_batch_size={self.prompt_batch_size} must be a multiple of "
                              f"mini_batch_size={self.mini_batch_size}")

    @classmethod
    def from_parts(cls, *, generation: GenerationConfig | None = None, data: DataConfig | None = None,
                   shapes: ShapeConfig | None = None, loss: LossConfig | None = None,
                   safety: SafetyConfig | None = None) -> "DapoConfig":
        """DapoConfig from its parts (each None: that part's defaults)."""
        given = dict(generation=generation, data=data, shapes=shapes, loss=loss, safety=safety)
        flat = {}
        for name, part in given.items():
            if part is not None:
                if not isinstance(part, PARTS[name]):
                    raise TypeError(f"{name}= takes a {PARTS[name].__name__}, got {type(part).__name__}")
                flat.update(dataclasses.asdict(part))
        return cls(**flat)

    @property
    def generation(self) -> GenerationConfig:
        return self._parts["generation"]

    @property
    def data(self) -> DataConfig:
        return self._parts["data"]

    @property
    def shapes(self) -> ShapeConfig:
        return self._parts["shapes"]

    @property
    def loss(self) -> LossConfig:
        return self._parts["loss"]

    @property
    def safety(self) -> SafetyConfig:
        return self._parts["safety"]

    @property
    def rows_per_minibatch(self) -> int:
        return self.mini_batch_size * self.n_samples

    @property
    def norm_constant(self) -> int:
        """L of seq-mean-token-sum-norm (Dr. GRPO): fixed across steps, the longest possible response."""
        return self.loss_norm_constant or self.max_response_tokens


def _flat_fields():
    fields = []
    for part in PARTS.values():
        for f in dataclasses.fields(part):
            fields.append((f.name, f.type, dataclasses.field(default=f.default)))
    return fields


# The gin surface: one keyword per setting, the names users set (`rl.DapoConfig.n_samples = 8`), exactly
# the parts' fields, so a setting is declared (with its default and comment) once, in rl/config.py.
DapoConfig = dataclasses.make_dataclass("DapoConfig", _flat_fields(), bases=(_DapoConfigBase,), frozen=True,
                                        kw_only=True)
DapoConfig.__module__ = __name__
DapoConfig.__doc__ = ("DAPO / GRPO settings: the flat union of GenerationConfig, DataConfig, ShapeConfig, "
                      "LossConfig and SafetyConfig (rl/config.py); `.generation`, `.data`, `.shapes`, `.loss`, "
                      "`.safety` are the parts.")


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
    lengths = np.array([len(r.response_token_ids) for r in rollouts], np.float32)  # [G*n]
    shaped = shaped_rewards(cfg, rewards, lengths)
    adv = group_advantages(cfg, shaped)
    supports = None
    if cfg.generation.truncated:  # top-k / top-p: the supports
        if any(r.sampling_support is None for r in rollouts):
            raise ValueError("top_p / top_k sampling but a rollout has no sampling_support: the engine must "
                             "return it (SamplingConfig.return_support)")
        supports = [r.sampling_support for r in rollouts]
    batch = pack_rollouts([r.prompt_token_ids for r in rollouts], [r.response_token_ids for r in rollouts],
                          [r.response_logprobs for r in rollouts], adv, pad_id=pad_id,
                          min_len=cfg.shapes.min_seq_bucket, row_multiple=cfg.rows_per_minibatch,
                          sampling_supports=supports, support_width=cfg.generation.top_k if supports else None)
    stats = {"reward/shaped_mean": float(shaped.mean()), "advantage/abs_mean": float(np.abs(adv).mean()),
             "batch/sequences": len(rollouts), "batch/seq_len_bucket": batch["input_ids"].shape[1]}
    return batch, stats
