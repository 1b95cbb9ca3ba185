"""Examples → environments → scored trajectories: the one path from task examples to rewards.

    trajectories = turns.run_trajectories(engine, codec, examples, environment, sampling, config)
                   prompt-major: trajectory p·n + j is sample j of examples[p], n = sampling.n
    texts_i      = decode_response(rollouts_i.response_token_ids)      (observations included, multi-turn)
    scores_i     = trajectory i's reward, the sum of its environment steps' rewards

With the default environment (`single_turn`) that is one generate call and `reward_fn(text, answer)` per
sample. Training (`rl.rollout.collect_groups`, per draw of dynamic sampling) and held-out evaluation
(`rl.evaluation.evaluate_examples`, per chunk) both go through `generate_and_score`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from portable_rl.rl.config import EnvironmentConfig
from portable_rl.rl.turns import Trajectory, environment_factory, run_trajectories


@dataclasses.dataclass
class ScoredRollouts:
    trajectories: list[Trajectory]   # prompt-major (n per example)
    texts: list                      # decoded responses, one per trajectory
    env_seconds: float               # spent in the environments' reset / step / close

    @property
    def rollouts(self) -> list:
        """engines.base.Rollout per trajectory (multi-turn: with its response mask and turn indices)."""
        return [t.rollout for t in self.trajectories]

    @property
    def scores(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def rewards(self) -> np.ndarray:
        """The scores as a float32 array `[len(rollouts)]`."""
        return np.array(self.scores, np.float32)


def generate_and_score(engine, codec, examples: Sequence, reward_fn: Callable[[str, str], float], sampling,
                       environment: EnvironmentConfig = EnvironmentConfig()) -> ScoredRollouts:
    """Runs `sampling.n` trajectories per example in `environment` (its reward: the task's `reward_fn`)."""
    trajectories, env_seconds = run_trajectories(engine, codec, examples, environment_factory(environment, reward_fn),
                                                 sampling, environment)
    texts = [codec.decode_response(t.rollout.response_token_ids) for t in trajectories]
    return ScoredRollouts(trajectories, texts, env_seconds)
