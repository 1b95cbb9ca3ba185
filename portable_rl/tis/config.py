"""`RolloutCorrectionConfig`: one frozen, keyword-only dataclass describing the whole correction.

Gin-free on purpose: entry points bind it (`RolloutCorrectionConfig.mode = "token"` or
`from_preset.name = "icepop"`). Every field is a plain Python value, so the config is hashable and
can be a static argument of `jax.jit`. See docs/tis.md for the formulas and the verl/SkyRL names.

    mode            IS weight: "none" | "token" | "sequence" | "geometric"
    clip            C, the truncation cap of the weight (None = untruncated IS)
    self_normalize  divide weights by their mean over kept tokens (or kept sequences)
    token_mask_*    IcePop token mask: keep lo ≤ ρ_t ≤ hi
    geo_mask_*      sequence mask on exp(mean_t log ρ_t)
    product_mask_*  sequence mask on exp(Σ_t log ρ_t)
    veto_*          drop a sequence if any token's ρ_t leaves [lo, hi]
    divergence      "<token|seq_sum|seq_mean|seq_max>_<k1|k2|k3>" with divergence_low / _high
A mask is active when at least one of its bounds is set; `None` means no bound on that side.
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
    """Function form of `RolloutCorrectionConfig.preset`, convenient to bind with gin."""
    return RolloutCorrectionConfig.preset(name, **overrides)
