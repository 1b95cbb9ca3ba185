"""`single_turn`: today's tasks as environments. The prompt is the example's, the first step scores the
model's answer with the task's reward and ends the trajectory:

    reset(example) = example.prompt        step(text) = Step(None, reward_fn(text, example.answer), True, {})
"""

from __future__ import annotations

from typing import Callable

from portable_rl.environments.base import Environment, Step, register_environment


@register_environment("single_turn")
class SingleTurnEnvironment(Environment):
    """`reward`: a registered reward's name (tasks/rewards.py) or a `(text, answer) -> float` function;
    the driver passes the task's when env_kwargs do not set it."""

    def __init__(self, reward: str | Callable[[str, str], float]):
        from portable_rl.tasks.rewards import get_reward

        self.reward_fn = get_reward(reward) if isinstance(reward, str) else reward
        self.example = None

    def reset(self, example) -> str:
        self.example = example
        return example.prompt

    def step(self, action_text: str) -> Step:
        return Step(None, self.reward_fn(action_text, self.example.answer), True, {})
