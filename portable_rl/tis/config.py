"""`RolloutCorrectionConfig`: one frozen, keyword-only dataclass describing the whole correction.

Gin-free on purpose: entry points bind it (`RolloutCorrectionConfig.mode = "token"` or
`from_preset.name = "icepop"`). Every field is a plain Python value, so the config is hashable and
can be a static argument of `jax.jit`. The fields are listed in the class's `Attributes:`; docs/tis.md
has the formulas and the verl/SkyRL names.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from portable_rl.errors import ConfigError
from portable_rl.tis.masks import check_bounds, parse_divergence

MODES = ("none", "token", "sequence", "geometric")

# name → field overrides; defaults follow verl's presets (RolloutCorrectionConfig.decoupled_*, as of 0.9.1).
PRESETS: dict[str, dict] = {
    "none": {},
    "token_tis": dict(mode="token", clip=2.0),
    "sequence_tis": dict(mode="sequence", clip=2.0),
    "geometric_tis": dict(mode="geometric", clip=2.0),
    "icepop": dict(mode="token", clip=5.0, token_mask_low=0.5, token_mask_high=5.0),
    "seq_mis": dict(mode="sequence", clip=2.0, product_mask_low=0.5, product_mask_high=2.0),
    "geo_rs": dict(mode="none", geo_mask_low=0.999, geo_mask_high=1.001),
    "geo_rs_token_tis": dict(mode="token", clip=2.0, geo_mask_low=0.999, geo_mask_high=1.001),
    "k3_rs": dict(mode="none", divergence="seq_mean_k3", divergence_high=0.01),
}
_ALIASES = {"off": "none", "tis": "token_tis"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """The rollout correction: an importance-sampling weight and rejection masks on ρ_t = π_train / π_rollout.

    A mask is active when at least one of its bounds is set; None means no bound on that side. Bounds are
    inclusive, and the ratio bounds (token_mask, geo_mask, product_mask, veto) must be >= 0.

    Attributes:
      mode: the IS weight: "none" (weight 1), "token" (min(ρ_t, C)), "sequence" (min(Π_t ρ_t, C) on every
        token of the sequence) or "geometric" (min(exp(mean_t log ρ_t), C) on every token of the sequence).
      clip: C, the truncation cap of the weight (> 0; unused with mode "none"); None: untruncated IS.
      self_normalize: divide the weights by their mean over kept tokens (over kept sequences with modes
        "sequence" and "geometric"), so their average is 1.
      token_mask_low: IcePop token mask: drop tokens with ρ_t below this; None: no lower bound.
      token_mask_high: IcePop token mask: drop tokens with ρ_t above this; None: no upper bound.
      geo_mask_low: drop whole sequences whose exp(mean_t log ρ_t) is below this; None: no lower bound.
      geo_mask_high: drop whole sequences whose exp(mean_t log ρ_t) is above this; None: no upper bound.
      product_mask_low: drop whole sequences whose Π_t ρ_t is below this; None: no lower bound.
      product_mask_high: drop whole sequences whose Π_t ρ_t is above this; None: no upper bound.
      veto_low: drop a whole sequence if any of its tokens has ρ_t below this; None: no lower bound.
      veto_high: drop a whole sequence if any of its tokens has ρ_t above this; None: no upper bound.
      divergence: a divergence mask "<token|seq_sum|seq_mean|seq_max>_<k1|k2|k3>" (k1 = −log ρ,
        k2 = ½ (log ρ)², k3 = ρ − 1 − log ρ; "token" masks tokens, seq_* whole sequences), bounded by
        divergence_low / divergence_high (at least one must be set); None: off.
      divergence_low: drop where the divergence statistic is below this (in its own units); None: no lower
        bound.
      divergence_high: drop where the divergence statistic is above this (in its own units); None: no upper
        bound.
    """
    mode: str = "none"
    clip: Optional[float] = 2.0
    self_normalize: bool = False
    token_mask_low: Optional[float] = None
    token_mask_high: Optional[float] = None
    geo_mask_low: Optional[float] = None
    geo_mask_high: Optional[float] = None
    product_mask_low: Optional[float] = None
    product_mask_high: Optional[float] = None
    veto_low: Optional[float] = None
    veto_high: Optional[float] = None
    divergence: Optional[str] = None
    divergence_low: Optional[float] = None
    divergence_high: Optional[float] = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"unknown rollout-correction mode {self.mode!r}; use one of {MODES}")
        if self.clip is not None and not (self.clip > 0):  # also rejects NaN
            raise ConfigError(f"clip must be > 0 (or None for untruncated IS), got {self.clip}")
        for name in ("token_mask", "geo_mask", "product_mask", "veto"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            check_bounds(low, high, f"RolloutCorrectionConfig.{name}_low/_high")
            for bound in (low, high):
                if bound is not None and (bound < 0 or math.isnan(bound)):
                    raise ConfigError(f"RolloutCorrectionConfig.{name}_*: a ratio bound must be >= 0, got {bound}")
        check_bounds(self.divergence_low, self.divergence_high, "RolloutCorrectionConfig.divergence_low/_high")
        if self.divergence is not None:
            parse_divergence(self.divergence)
            if self.divergence_low is None and self.divergence_high is None:
                raise ConfigError(f"divergence={self.divergence!r} needs divergence_high (and/or divergence_low)")
        elif self.divergence_low is not None or self.divergence_high is not None:
            raise ConfigError("divergence_low/_high are set but divergence is None; set e.g. divergence='seq_mean_k3'")

    @classmethod
    def preset(cls, name: str, **overrides) -> "RolloutCorrectionConfig":
        """A named preset (see `PRESETS`) with any field overridden, e.g. preset('token_tis', clip=3.0)."""
        key = _ALIASES.get(name, name)
        if key not in PRESETS:
            raise ConfigError(f"unknown rollout-correction preset {name!r}; use one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[key], **overrides})

    def mask_enabled(self, name: str) -> bool:
        return getattr(self, f"{name}_low") is not None or getattr(self, f"{name}_high") is not None

    @property
    def any_mask(self) -> bool:
        """True when some mask or veto can reject tokens or sequences."""
        return any(self.mask_enabled(n) for n in ("token_mask", "geo_mask", "product_mask", "veto"))

    @property
    def enabled(self) -> bool:
        """False when the correction is a no-op (weights 1, nothing rejected)."""
        return self.mode != "none" or self.any_mask or self.divergence is not None

    @property
    def token_local(self) -> bool:
        """True when a token's weight is a function of its own log-ratio alone and nothing is rejected (token or
        no TIS, no mask, no self-normalization): the correction can then run on any rows, packed or not,
        inside the update (rl/learner.py, LossConfig.old_logprobs_from_update)."""
        return (self.mode in ("none", "token") and not self.any_mask and self.divergence is None
                and not self.self_normalize)


def from_preset(name: str = "none", **overrides) -> RolloutCorrectionConfig:
    """Function form of `RolloutCorrectionConfig.preset`, convenient to bind with gin.

    Args:
      name: the preset: "none", "token_tis", "sequence_tis", "geometric_tis", "icepop", "seq_mis", "geo_rs",
        "geo_rs_token_tis" or "k3_rs" (`PRESETS`; "off" and "tis" are aliases of "none" and "token_tis"); any
        other keyword overrides that field of the preset.
    """
    return RolloutCorrectionConfig.preset(name, **overrides)
