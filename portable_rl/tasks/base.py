"""The task contract: text examples, drawn deterministically from (seed, step, draw).

`train_batch(step, draw, batch_size)` must return the same prompts for the same arguments in any
process, so a resumed run sees exactly the data an uninterrupted run would (no iterator state to save).
`draw` counts the generation batches inside one step (dynamic sampling may draw several).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str   # text given to the policy, e.g. "37+48="
    answer: str   # ground truth the reward compares against, e.g. "85"


class Task(Protocol):
    name: str
    reward: str  # name of a registered reward (portable_rl.tasks.rewards)

    def train_batch(self, step: int, draw: int, batch_size: int) -> list[Example]: ...

    def eval_examples(self) -> Sequence[Example]: ...


def data_metrics(task) -> dict[str, int]:
    """Metrics-row entries for the malformed rows a task skipped while reading its files:
    `data/skipped_rows` and `data/skipped/<reason>`; {} for tasks that generate their data."""
    if not hasattr(task, "skipped_rows"):
        return {}
    return {"data/skipped_rows": int(task.skipped_rows),
            **{f"data/skipped/{reason}": int(n) for reason, n in getattr(task, "skipped_reasons", {}).items()}}
