"""Multi-digit arithmetic, generated deterministically from a seed.

Prompt "37+48=", answer "85". The held-out set is drawn first from its own stream and its (a, op, b)
triples are excluded from training draws, so held-out accuracy measures generalisation.
Training batch for (step, draw) comes from `np.random.default_rng([seed, step, draw])`.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from portable_rl.errors import ConfigError
from portable_rl.tasks.base import Example, GeneratedTask
from portable_rl.tasks.rewards import get_reward

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_EVAL_STREAM = 2**31 - 1  # rng stream id for the held-out set (train streams use step >= 0)


@dataclasses.dataclass
class ArithmeticTask(GeneratedTask):
    """"a<op>b=" → the exact result, operands uniform in [0, 10**num_digits).

    Attributes:
      num_digits: the difficulty: each operand has at most this many digits (>= 1).
      ops: the operators drawn from, uniformly per problem: a non-empty subset of "+-*" ("-" may give
        negative answers).
      seed: the seed of the held-out set and of every training batch.
      num_eval: held-out problems (at most a quarter of the distinct problems); training never draws them.
      reward: the registered reward that scores a response (`tasks.rewards`: "exact_match", "math_verify",
        "final_number").
      name: the task's name in evaluation reports (and their default file name).
    """
    num_digits: int = 2
    ops: str = "+"
    seed: int = 0
    num_eval: int = 200
    reward: str = "exact_match"
    name: str = "arithmetic"

    def __post_init__(self):
        get_reward(self.reward)  # an unknown reward name fails here, before any model is loaded
        bad = set(self.ops) - set(_OPS)
        if not self.ops or bad:
            raise ConfigError(f"ops={self.ops!r} has unsupported operators {sorted(bad)}; use a subset of '+-*'")
        if self.num_digits < 1:
            raise ConfigError(f"num_digits={self.num_digits} must be >= 1")
        space = len(self.ops) * (10 ** self.num_digits) ** 2
        if self.num_eval > space // 4:
            raise ConfigError(f"num_eval={self.num_eval} is too large for {space} distinct problems; "
                              f"lower num_eval or raise num_digits")
        self._init_held_out(self.seed, _EVAL_STREAM, self.num_eval)

    def _problem(self, rng: np.random.Generator) -> Example:
        hi = 10 ** self.num_digits
        a, b = (int(x) for x in rng.integers(0, hi, size=2))
        op = self.ops[int(rng.integers(0, len(self.ops)))]
        return Example(prompt=f"{a}{op}{b}=", answer=str(_OPS[op](a, b)))
