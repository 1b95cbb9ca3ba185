"""Rewards registered by name: `fn(response_text, answer) -> float` in [0, 1] (1 = correct).

- `exact_match`: the response, stripped, equals the answer (arithmetic).
- `math_verify`: math-verify parses both sides (LaTeX, \\boxed{}, plain numbers) and checks equivalence
  (DAPO-Math). The ground truth is wrapped in $...$ so a bare "34" or "\\frac{1}{2}" parses.
Accuracy is `reward >= 1`. Overlong shaping is applied later, on top of these, by the loop.
"""

from __future__ import annotations

from typing import Callable

from portable_rl.errors import UnknownNameError

RewardFn = Callable[[str, str], float]
_REWARDS: dict[str, RewardFn] = {}


class UnknownRewardError(UnknownNameError):
    """A reward name nobody registered."""


def register_reward(name: str):
    def wrap(fn: RewardFn) -> RewardFn:
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        _REWARDS[name] = fn
        return fn
    return wrap


def get_reward(name: str) -> RewardFn:
    if name not in _REWARDS:
        raise UnknownRewardError(f"unknown reward {name!r}; set the task's reward to one of "
                                 f"{', '.join(available_rewards())} (or register_reward a new one)")
    return _REWARDS[name]


def available_rewards() -> list[str]:
    return sorted(_REWARDS)


@register_reward("exact_match")
def exact_match(response: str, answer: str) -> float:
    return float(response.strip() == answer.strip())


@register_reward("math_verify")
def math_verify_reward(response: str, answer: str) -> float:
    from math_verify import parse, verify

    # No math-verify timeouts: they use SIGALRM, which works in the main thread only, and rewards run in the
    # rollout driver's worker threads under its own time limit (rl.EnvironmentConfig.step_timeout_s).
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=None)
    if not gold:
        return 0.0
    try:
        return float(verify(gold, parse(response, parsing_timeout=None), timeout_seconds=None))
    except Exception:  # math-verify may raise on pathological model output; that output is wrong
        return 0.0
