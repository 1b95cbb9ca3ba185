"""Rollout engines behind one small interface (see docs/engines.md). Never imports JAX."""

import os
import sys

# Before torch loads its OpenMP runtime (read once, at load): idle OpenMP threads sleep instead of
# spin-waiting. On a CPU shared with other processes the spinning threads starve the working ones
# (measured: docs/experiments/cpu_rollouts.md). OMP_WAIT_POLICY=ACTIVE restores the spinning.
OMP_WAIT_POLICY_TOO_LATE = "OMP_WAIT_POLICY" not in os.environ and "torch" in sys.modules
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from portable_rl.engines.base import EngineAdapter, Rollout, SamplingConfig
from portable_rl.engines.registry import available_engines, create_engine, register

__all__ = ["EngineAdapter", "Rollout", "SamplingConfig", "available_engines", "create_engine", "register"]
