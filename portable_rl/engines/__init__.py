"""Rollout engines behind one small interface (see docs/engines.md). Never imports JAX."""

from portable_rl.engines.base import EngineAdapter, Rollout, SamplingConfig
from portable_rl.engines.registry import available_engines, create_engine, register

__all__ = ["EngineAdapter", "Rollout", "SamplingConfig", "available_engines", "create_engine", "register"]
