"""Environments: `reset(example)` gives the first prompt, `step(turn_text)` gives (observation, reward, done, info)."""

from portable_rl.environments.base import (Environment, Step, available_environments, get_environment,
                                           register_environment)

__all__ = ["Environment", "Step", "available_environments", "get_environment", "register_environment"]
