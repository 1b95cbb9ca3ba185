"""Encode → generate → decode → reward: the one path from task examples to scored rollouts.

    rollouts   = engine.generate([encode_prompt(e.prompt) for e in examples], sampling)
                 prompt-major: rollouts[p·n + j] is sample j of examples[p], n = sampling.n
    texts_i    = decode_response(rollouts_i.response_token_ids)
    scores_i   = reward_fn(texts_i, examples[rollouts_i.prompt_index].answer)          in [0, 1]

Training (`rl.rollout.collect_groups`, per draw of dynamic sampling) and held-out evaluation
(`rl.evaluation.evaluate_examples`, per chunk) both go through `generate_and_score`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np


@dataclasses.dataclass
class ScoredRollouts:
    rollouts: list         # engines.base.Rollout, prompt-major (n per example)
    texts: list            # decoded responses, one per rollout
    scores: list           # reward_fn's value per rollout, as returned

    @property
    def rewards(self) -> np.ndarray:
        """The scores as a float32 array `[len(rollouts)]`."""
        return np.array(self.scores, np.float32)


def generate_and_score(engine, codec, examples: Sequence, reward_fn: Callable[[str, str], float],
                       sampling) -> ScoredRollouts:
    """Samples `sampling.n` responses per example and scores each against its example's answer."""
    rollouts = engine.generate([codec.encode_prompt(e.prompt) for e in examples], sampling)
    texts = [codec.decode_response(r.response_token_ids) for r in rollouts]
    scores = [reward_fn(text, examples[r.prompt_index].answer) for r, text in zip(rollouts, texts)]
    return ScoredRollouts(rollouts, texts, scores)
