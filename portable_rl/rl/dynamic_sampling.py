"""DAPO dynamic sampling: keep only prompt groups whose n rewards are not all equal.

A group with identical rewards has zero group-normalised advantage everywhere, so it adds no gradient
but dilutes the batch. The loop keeps drawing generation batches (up to `max_gen_batches`) until
`target_groups` informative groups are collected, then truncates to exactly that many.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def informative_groups(rewards: Sequence[float], n: int) -> np.ndarray:
    """rewards [G*n] (prompt-major) -> bool [G]: True where the group's rewards are not all equal."""
    r = np.asarray(rewards, np.float64).reshape(-1, n)      # [G, n]
    return r.max(axis=1) > r.min(axis=1)


class GroupCollector:
    """Accumulates kept groups across generation batches; `done` once `target_groups` are in."""

    def __init__(self, target_groups: int, filter_groups: bool = True):
        self.target_groups = target_groups
        self.filter_groups = filter_groups
        self.groups: list = []      # opaque per-group records, in arrival order
        self.seen = 0               # groups generated so far
        self.draws = 0              # generation batches drawn so far

    def add(self, groups: Sequence, rewards: Sequence[float], n: int) -> None:
        keep = informative_groups(rewards, n) if self.filter_groups else np.ones(len(groups), bool)
        self.groups.extend(g for g, k in zip(groups, keep) if k)
        self.seen += len(groups)
        self.draws += 1

    @property
    def done(self) -> bool:
        return len(self.groups) >= self.target_groups

    def take(self) -> list:
        return self.groups[: self.target_groups]
