"""Verifiable tasks (prompts + ground truths, deterministic from a seed) and rewards registered by name.

A task yields `Example(prompt, answer)` text pairs; the entry points tokenize them. Rewards map
`(response_text, answer) -> float` and are looked up by name (`rewards.get_reward("exact_match")`).
This package never imports torch.
"""

from portable_rl.tasks.base import Example, Task, data_metrics
from portable_rl.tasks.arithmetic import ArithmeticTask
from portable_rl.tasks.math_dataset import DatasetError, MathDatasetTask, read_dataset, read_examples
from portable_rl.tasks.rewards import UnknownRewardError, available_rewards, get_reward, register_reward
from portable_rl.tasks.sql_data import SkyrlSqlTask, SqlTask, SqlTraceTask
from portable_rl.tasks.word_problems import WordProblemsTask, final_number

__all__ = ["Example", "Task", "data_metrics", "ArithmeticTask", "DatasetError", "MathDatasetTask", "read_dataset",
           "read_examples", "UnknownRewardError", "available_rewards", "get_reward", "register_reward",
           "WordProblemsTask", "final_number", "SkyrlSqlTask", "SqlTask", "SqlTraceTask"]
