"""The environment contract: one instance per trajectory, `reset(example)` once, then `step(turn_text)` per model turn.

A trajectory's reward is the sum of its turns' rewards. Environments are registered by name
(`register_environment`) and constructed as `cls(**env_kwargs)`.
"""

from __future__ import annotations

import abc
from typing import NamedTuple

from portable_rl.errors import UnknownNameError


class Step(NamedTuple):
    observation: str | None   # text of the next tool/user turn; None when done
    reward: float             # this turn's reward (a trajectory's reward = the sum over its turns)
    done: bool
    info: dict


class Environment(abc.ABC):    # one instance per trajectory, constructed as cls(**env_kwargs)
    @abc.abstractmethod
    def reset(self, example) -> str | list[dict]: ...   # first prompt: text or chat messages

    @abc.abstractmethod
    def step(self, action_text: str) -> Step: ...

    def close(self) -> None: ...


_ENVIRONMENTS: dict[str, type[Environment]] = {}


def register_environment(name: str):
    def wrap(cls: type[Environment]) -> type[Environment]:
        if name in _ENVIRONMENTS:
            raise ValueError(f"environment {name!r} is already registered")
        _ENVIRONMENTS[name] = cls
        return cls
    return wrap


def get_environment(name: str) -> type[Environment]:
    if name not in _ENVIRONMENTS:
        raise UnknownNameError(f"unknown environment {name!r}; use one of "
                               f"{', '.join(available_environments())} (or register_environment a new one)")
    return _ENVIRONMENTS[name]


def available_environments() -> list[str]:
    return sorted(_ENVIRONMENTS)
