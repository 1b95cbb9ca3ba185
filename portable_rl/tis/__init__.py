"""Rollout correction in JAX: truncated importance sampling (TIS), rejection masks, diagnostics.

All functions are pure, jit-able, take `[batch, seq]` arrays and a 0/1 `response_mask`, compute in
float32 (bf16 inputs are upcast), and never let padding influence any output.
`log_ratio = log π_train − log π_rollout`. See docs/tis.md.
"""

from portable_rl.tis.config import PRESETS, RolloutCorrectionConfig, from_preset
from portable_rl.tis.correction import apply_rollout_correction
from portable_rl.tis.masks import (divergence_mask, divergence_statistic, geometric_sequence_mask,
                                   icepop_token_mask, k1_bounds_from_verl, outlier_veto_mask,
                                   product_sequence_mask)
from portable_rl.tis.metrics import mismatch_metrics
from portable_rl.tis.ratios import SAFETY_BOUND, log_ratio
from portable_rl.tis.weights import (geometric_sequence_weights, self_normalize,
                                     sequence_tis_weights, token_tis_weights)

__all__ = [
    "PRESETS", "RolloutCorrectionConfig", "SAFETY_BOUND", "apply_rollout_correction",
    "divergence_mask", "divergence_statistic", "from_preset", "geometric_sequence_mask",
    "geometric_sequence_weights", "icepop_token_mask", "k1_bounds_from_verl", "log_ratio",
    "mismatch_metrics", "outlier_veto_mask", "product_sequence_mask", "self_normalize",
    "sequence_tis_weights", "token_tis_weights",
]
