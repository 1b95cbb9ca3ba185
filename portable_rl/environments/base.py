"""The environment contract: one instance per trajectory, text in and text out.

    env = get_environment(name)(**env_kwargs)     one per trajectory (kwargs from rl.EnvironmentConfig)
    prompt = env.reset(example)                   text, or chat messages [{"role": ..., "content": ...}]
    step = env.step(action_text)                  the model's decoded turn → Step(observation, reward, done, info)
    ... until step.done (or the driver's max_turns / token budget / time limit), then env.close()

A trajectory's reward is the sum of its steps' rewards. The driver (rl/turns.py) owns the token ids: it
tokenizes `reset`'s prompt and every observation once and never re-tokenizes the model's text, so an
environment only ever sees and returns text. A single-turn task is the environment whose first step is done
(`single_turn`, environments/single_turn.py).
"""

from __future__ import annotations

import abc
from typing import NamedTuple

from portable_rl.errors import UnknownNameError


class Step(NamedTuple):
    observation: str | None   # text of the next tool/user turn; None when done
    reward: float             # this turn's reward (a trajectory's reward = the sum over its turns)
    done: bool
    info: dict                # free-form (e.g. {"error": ...})


class Environment(abc.ABC):
    """One trajectory's environment. `step` may run in a worker thread (one thread per call, never two
    calls of one instance at once), under the driver's time limit.

    `stop_strings`: where the engine ends a turn besides EOS (e.g. a tool call's closing tag); the driver adds
    them to the sampling's `stop`, and the turn's text keeps the string (engines/base.py, "Stop strings")."""

    stop_strings: tuple[str, ...] = ()

    @abc.abstractmethod
    def reset(self, example) -> str | list[dict]:
        """The first prompt of the trajectory for `example` (a `tasks.Example`): text, or chat messages."""

    @abc.abstractmethod
    def step(self, action_text: str) -> Step:
        """The model's decoded turn → the observation that follows it, this turn's reward, done, info."""

    def close(self) -> None:
        """Frees what the trajectory held (a connection, a sandbox); called once it ended, however it ended."""


class UnknownEnvironmentError(UnknownNameError):
    """An environment name nobody registered."""


_ENVIRONMENTS: dict[str, type[Environment]] = {}


def register_environment(name: str):
    """Class decorator: `@register_environment("calculator") class Calculator(Environment): ...`."""
    def wrap(cls: type[Environment]) -> type[Environment]:
        if name in _ENVIRONMENTS:
            raise ValueError(f"environment {name!r} is already registered")
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise TypeError(f"register_environment({name!r}) decorates an Environment subclass, got {cls!r}")
        _ENVIRONMENTS[name] = cls
        return cls
    return wrap


def get_environment(name: str) -> type[Environment]:
    if name not in _ENVIRONMENTS:
        raise UnknownEnvironmentError(
            f"unknown environment {name!r}; set rl.EnvironmentConfig.name to one of "
            f"{', '.join(available_environments())} (or register_environment a new one)")
    return _ENVIRONMENTS[name]


def available_environments() -> list[str]:
    return sorted(_ENVIRONMENTS)
