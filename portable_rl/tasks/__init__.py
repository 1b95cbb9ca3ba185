"""Verifiable tasks (prompts + ground truths, deterministic from a seed) and rewards registered by name.

A task yields `Example(prompt, answer)` text pairs; the entry points tokenize them. Rewards map
`(response_text, answer) -> float` and are looked up by name (`rewards.get_reward("exact_match")`).
This package never imports torch.
"""

from portable_rl.tasks.base import Example, Task
from portable_rl.tasks.arithmetic import ArithmeticTask
from portable_rl.tasks.math_dataset import MathDatasetTask, read_examples
from portable_rl.tasks.rewards import available_rewards, get_reward, register_reward

__all__ = ["Example", "Task", "ArithmeticTask", "MathDatasetTask", "read_examples",
           "available_rewards", "get_reward", "register_reward"]
