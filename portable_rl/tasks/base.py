"""The task contract: text examples, drawn deterministically from (seed, step, draw).

`train_batch(step, draw, batch_size)` must return the same prompts for the same arguments in any
process, so a resumed run sees exactly the data an uninterrupted run would (no iterator state to save).
`draw` counts the generation batches inside one step (dynamic sampling may draw several).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str   # text given to the policy, e.g. "37+48="
    answer: str   # ground truth the reward compares against, e.g. "85"
    metadata: dict = dataclasses.field(default_factory=dict)  # task-specific fields an environment reads (e.g. the SQL task's db_id)


class Task(Protocol):
    name: str
    reward: str | None  # name of a registered reward (portable_rl.tasks.rewards); None: its environment scores it

    def train_batch(self, step: int, draw: int, batch_size: int) -> list[Example]: ...

    def eval_examples(self) -> Sequence[Example]: ...


class GeneratedTask:
    """Train / held-out plumbing for tasks that generate problems with `self._problem(rng) -> Example`.

    The held-out set is `count` distinct problems drawn from the stream `[seed, eval_stream]`; training
    batch (step, draw) comes from `np.random.default_rng([seed, step, draw])` and skips held-out prompts
    (duplicates inside a batch are fine)."""

    def _init_held_out(self, seed: int, eval_stream: int, count: int) -> None:
        rng = np.random.default_rng([seed, eval_stream])
        self._eval, seen = [], set()
        while len(self._eval) < count:
            ex = self._problem(rng)
            if ex.prompt not in seen:
                seen.add(ex.prompt)
                self._eval.append(ex)
        self._held_out = seen

    def train_batch(self, step: int, draw: int, batch_size: int) -> list[Example]:
        rng = np.random.default_rng([self.seed, step, draw])
        out = []
        while len(out) < batch_size:
            ex = self._problem(rng)
            if ex.prompt not in self._held_out:
                out.append(ex)
        return out

    def eval_examples(self) -> list[Example]:
        return list(self._eval)


class DatasetTask:
    """Train / held-out plumbing for tasks read from files into `self._train` / `self._eval` (lists of
    `Example`): training batch (step, draw) is `batch_size` rows drawn by `np.random.default_rng([seed, step,
    draw])`, with replacement only when the file has fewer rows."""

    def train_batch(self, step: int, draw: int, batch_size: int) -> list[Example]:
        rng = np.random.default_rng([self.seed, step, draw])
        idx = rng.choice(len(self._train), size=batch_size, replace=batch_size > len(self._train))
        return [self._train[i] for i in idx]

    def eval_examples(self) -> list[Example]:
        return list(self._eval)


def data_metrics(task) -> dict[str, int]:
    """Metrics-row entries for the malformed rows a task skipped while reading its files:
    `data/skipped_rows` and `data/skipped/<reason>`; {} for tasks that generate their data."""
    if not hasattr(task, "skipped_rows"):
        return {}
    return {"data/skipped_rows": int(task.skipped_rows),
            **{f"data/skipped/{reason}": int(n) for reason, n in getattr(task, "skipped_reasons", {}).items()}}
