"""Held-out evaluation through a rollout engine: accuracy, pass@k, mean response length, mean turns.

pass@k uses the unbiased estimator of Chen et al. (2021) from n >= k samples with c correct:

    pass@k = 1 − C(n − c, k) / C(n, k)

averaged over problems. `accuracy` is the mean per-sample correctness (with greedy decoding and n = 1,
it is the fraction of problems solved).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from portable_rl.errors import ConfigError
from portable_rl.rl.config import EnvironmentConfig
from portable_rl.rl.scoring import generate_and_score


def pass_at_k(n: int, c: int, k: int) -> float:
    if k > n:
        raise ConfigError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(correct: np.ndarray, lengths: np.ndarray, ks: Sequence[int] = (1,)) -> dict:
    """correct, lengths: [P, n] per problem and sample -> accuracy, pass@k, mean_length."""
    p, n = correct.shape
    out = {"accuracy": float(correct.mean()), "mean_length": float(lengths.mean()), "num_problems": p,
           "samples_per_problem": n}
    for k in ks:
        if k <= n:
            out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct.sum(axis=1)]))
    return out


def evaluate_examples(engine, codec, examples, reward_fn: Callable[[str, str], float], sampling,
                      ks: Sequence[int] = (1,), batch_size: int = 256,
                      environment: EnvironmentConfig = EnvironmentConfig()) -> tuple[dict, list[dict]]:
    """Runs `sampling.n` trajectories per example in `environment` (the training loop's: the same code scores
    both); returns (summary, per-sample records)."""
    records, correct, lengths, turns = [], [], [], []
    for s in range(0, len(examples), batch_size):
        chunk = examples[s:s + batch_size]
        scored = generate_and_score(engine, codec, chunk, reward_fn, sampling, environment)
        for traj, text in zip(scored.trajectories, scored.texts):
            r, score = traj.rollout, traj.reward
            ex = chunk[r.prompt_index]
            records.append({"prompt": ex.prompt, "answer": ex.answer, "response": text, "reward": score,
                            "length": len(r.response_token_ids), "turns": traj.num_turns, "finish": traj.finish})
            correct.append(score >= 1.0)
            lengths.append(len(r.response_token_ids))
            turns.append(traj.num_turns)
    n = sampling.n
    summary = summarize(np.asarray(correct).reshape(-1, n), np.asarray(lengths).reshape(-1, n), ks)
    summary["mean_turns"] = float(np.mean(turns)) if turns else 0.0
    return summary, records
