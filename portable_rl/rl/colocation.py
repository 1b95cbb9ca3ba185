"""Time-sharing one device between the learner and a sleeping engine (memory plan: portable_rl/memory_plan.py).

With `SLEEP_ENGINE=True` every training step runs

    generate          engine awake: weights + KV cache                         (rollouts, probe, held-out)
    sleep             engine.sleep(): weights offloaded, KV cache dropped      learner_phase()
    learner           old logprobs, rollout correction, PPO updates: the learner may use its peak
    wake(weights)     engine.wake_up(tags=["weights"]): weight memory back     push_phase()
    push              the new policy is loaded into it (the KV cache is still freed: the learner's
                      temporaries and the engine's weights only are on the device at this point)
    wake(kv_cache)    engine.wake_up(tags=["kv_cache"]): ready to generate     generate_phase()

so the KV cache is never allocated while the push's buckets are alive, and the learner's peak never meets
the engine's weights or KV cache. An adapter whose `wake_up` takes no `tags` (SGLang, out-of-tree) wakes
whole at push_phase(), and generate_phase() has nothing left to do.

Resume: the engine starts awake on the checkpoint, the loop pushes the restored policy, then every step is
the cycle above, so a resumed run has the same order as a fresh one.

Async rollouts (`async_rollouts=True`) generate step k+1 while the learner trains on step k: the engine is
busy during the learner phase and cannot sleep. That mode keeps the engine resident; the memory plan must
then be the resident one (SLEEP_ENGINE=False), and asking for both is a one-line error.

Only the process that owns the engine (process 0) sleeps and wakes it; the others hold no engine.
"""

from __future__ import annotations

import inspect
import time

from portable_rl.errors import ConfigError

WEIGHTS, KV_CACHE = "weights", "kv_cache"  # vLLM's wake_up tags (engines/base.py)


def takes_tags(engine) -> bool:
    """Whether `engine.wake_up` accepts `tags` (partial wake-up)."""
    try:
        return "tags" in inspect.signature(engine.wake_up).parameters
    except (TypeError, ValueError):
        return False


class TimeSharing:
    """The loop's three hooks. Disabled, or no engine in this process: every hook does nothing."""

    def __init__(self, *, enabled: bool, async_rollouts: bool = False):
        if enabled and async_rollouts:  # checked before anything loads
            raise ConfigError("SLEEP_ENGINE=True with async_rollouts=True: async rollouts generate during the "
                              "learner phase, so the engine cannot sleep then; set SLEEP_ENGINE=False (resident "
                              "memory plan) or rl.RunConfig.async_rollouts=False")
        self.enabled = enabled
        self.engine = None
        self.state = "awake"  # awake | asleep | weights (weights back, KV cache not yet)
        self._seconds = 0.0   # spent sleeping and waking this step

    def attach(self, engine) -> None:
        """The engine this process owns (None on processes that own none). It starts awake."""
        self.engine = engine if self.enabled else None
        self._partial = self.engine is not None and takes_tags(self.engine)

    def learner_phase(self) -> None:
        """Before old logprobs and the update: free the engine's device memory."""
        if self.engine is None:
            return
        self._timed(self.engine.sleep)
        self.state = "asleep"

    def push_phase(self) -> None:
        """Before the weight push: weight memory back (the push overwrites its contents)."""
        if self.engine is None or self.state != "asleep":
            return
        if self._partial:
            self._timed(self.engine.wake_up, tags=[WEIGHTS])
            self.state = "weights"
        else:
            self._timed(self.engine.wake_up)
            self.state = "awake"

    def generate_phase(self) -> None:
        """After the push, before the next generation (probe, held-out, next step): the KV cache back."""
        if self.engine is None or self.state == "awake":
            return
        if self.state == "asleep":  # no push since the sleep: wake everything
            self._timed(self.engine.wake_up)
        else:
            self._timed(self.engine.wake_up, tags=[KV_CACHE])
        self.state = "awake"

    def metrics(self) -> dict:
        """{"time/sleep_wake": seconds this step} when time-sharing, else {}; resets the clock."""
        if self.engine is None:
            return {}
        seconds, self._seconds = self._seconds, 0.0
        return {"time/sleep_wake": seconds}

    def _timed(self, fn, **kwargs) -> None:
        start = time.perf_counter()
        fn(**kwargs)
        self._seconds += time.perf_counter() - start
