"""Generation + scoring + dynamic sampling for one training step.

For draw d = 0, 1, ... (at most `max_gen_batches`): take the task's prompts for (step, d), run n
trajectories each in the configured environment (rl/turns.py; sampling seed hash(seed, step, d)), score
them with their summed rewards, and keep the informative groups, until `prompt_batch_size` groups are
kept. The data and the sampling seed depend only on (seed, step, draw), so a resumed run regenerates
exactly what an uninterrupted one would.

Non-finite engine logprobs (NaN / ±inf: a broken kernel, an overflowing FP8 scale) are counted over every
token generated this step, `rollout/nonfinite_logprobs` and `rollout/nonfinite_fraction`; packing drops
those tokens from the loss (`batching.pack_rollouts`). `check_nonfinite_fraction` stops the run when their
fraction passes `rl.SafetyConfig.max_nonfinite_fraction`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from portable_rl.errors import UserError
from portable_rl.rl.config import EnvironmentConfig
from portable_rl.rl.dynamic_sampling import GroupCollector
from portable_rl.rl.scoring import generate_and_score
from portable_rl.rl.turns import FINISH_REASONS


class NonFiniteLogprobsError(UserError, RuntimeError):
    """The engine returned too many NaN / inf logprobs for training to go on."""


@dataclasses.dataclass
class ScoredGroup:
    example: object        # tasks.Example
    rollouts: list         # n engines.base.Rollout (multi-turn: the whole trajectory, with its response mask)
    rewards: np.ndarray    # [n] trajectory rewards (single-turn: the task reward in [0, 1])


def sampling_seed(seed: int, step: int, draw: int) -> int:
    return int(np.random.default_rng([seed, step, draw, 7]).integers(0, 2**31 - 1))


def collect_groups(engine, codec, task, reward_fn, cfg, *, step: int, seed: int,
                   environment: EnvironmentConfig = EnvironmentConfig(), return_routed_experts: bool = False):
    """→ (kept groups (≤ prompt_batch_size), stats over everything generated this step).
    `cfg`: a `DapoConfig`; only its generation and data parts are read (rl/config.py). `environment`: what each
    trajectory runs in (default: the task's prompt, one turn, its reward). `return_routed_experts`: rollouts carry
    the engine's routing (routing replay)."""
    gen, data = cfg.generation, cfg.data
    n = gen.n_samples
    collector = GroupCollector(data.prompt_batch_size, filter_groups=data.dynamic_sampling)
    all_rewards, all_lengths, truncated, nonfinite, turns, finishes, env_seconds = [], [], 0, 0, [], [], 0.0
    for draw in range(data.max_gen_batches):
        examples = task.train_batch(step, draw, data.prompt_batch_size)
        sampling = gen.sampling(seed=sampling_seed(seed, step, draw), stop_token_ids=(codec.eos_id,),
                                return_routed_experts=return_routed_experts)
        scored = generate_and_score(engine, codec, examples, reward_fn, sampling, environment)
        rollouts, rewards = scored.rollouts, scored.rewards
        groups = [ScoredGroup(examples[p], rollouts[p * n:(p + 1) * n], rewards[p * n:(p + 1) * n])
                  for p in range(len(examples))]
        collector.add(groups, rewards, n)
        all_rewards.append(rewards)
        all_lengths += [len(r.response_token_ids) for r in rollouts]
        truncated += sum(r.finish_reason == "length" for r in rollouts)
        nonfinite += sum(count_nonfinite(r.response_logprobs) for r in rollouts)
        turns += [t.num_turns for t in scored.trajectories]
        finishes += [t.finish for t in scored.trajectories]
        env_seconds += scored.env_seconds
        if collector.done:
            break
    rewards = np.concatenate(all_rewards)
    kept = collector.take()
    stats = {
        "reward/mean": float(rewards.mean()),
        "accuracy/train": float((rewards >= 1.0).mean()),
        "response_length/mean": float(np.mean(all_lengths)),
        "response_length/max": float(np.max(all_lengths)),
        "response_length/clip_ratio": truncated / len(all_lengths),
        "dynamic_sampling/gen_batches": collector.draws,
        "dynamic_sampling/kept_groups": len(kept),
        "dynamic_sampling/kept_fraction": len(collector.groups) / max(collector.seen, 1),
        "rollout/nonfinite_logprobs": nonfinite,
        "rollout/nonfinite_fraction": nonfinite / max(sum(all_lengths), 1),
        "turns/mean": float(np.mean(turns)),
        "turns/max": int(np.max(turns)),
        **{f"finish/{reason}": finishes.count(reason) / len(finishes) for reason in FINISH_REASONS},
        "time/env": env_seconds,
    }
    return kept, stats


def count_nonfinite(logprobs) -> int:
    return int(np.count_nonzero(~np.isfinite(np.asarray(logprobs, np.float64))))


def check_nonfinite_fraction(stats: dict, max_fraction: float) -> None:
    """Raises `NonFiniteLogprobsError` when this step's non-finite logprob fraction exceeds `max_fraction`."""
    fraction = stats["rollout/nonfinite_fraction"]
    if fraction > max_fraction:
        raise NonFiniteLogprobsError(
            f"the engine returned {stats['rollout/nonfinite_logprobs']} non-finite logprobs ({100 * fraction:.2f}% "
            f"of the step's response tokens) > max_nonfinite_fraction={max_fraction}: check the engine's "
            f"dtype / quantization (try --gin.QUANTIZATION=None) or raise rl.SafetyConfig.max_nonfinite_fraction")
