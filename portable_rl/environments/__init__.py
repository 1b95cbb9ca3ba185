"""Environments: what a trajectory talks to between the model's turns (environments/base.py).

`Environment.reset(example) -> prompt`, `Environment.step(text) -> Step(observation, reward, done, info)`;
registered by name (`register_environment`) and selected with `rl.EnvironmentConfig.name`. `single_turn`
(the default) runs today's tasks: one turn, scored by the task's reward. This package never imports torch.
"""

from portable_rl.environments.base import (Environment, Step, UnknownEnvironmentError, available_environments,
                                           get_environment, register_environment)
from portable_rl.environments.single_turn import SingleTurnEnvironment

__all__ = ["Environment", "Step", "UnknownEnvironmentError", "available_environments", "get_environment",
           "register_environment", "SingleTurnEnvironment"]
