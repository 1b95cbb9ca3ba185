"""One-step off-policy rollouts: generate step k+1's batch while the learner trains on step k's.

    iteration k:   R_k ← result of the previous submit (sampled with θ_{k-2})
                   submit: engine samples R_{k+1} with the weights it holds, θ_{k-1}     [background thread]
                   learner trains on R_k: θ_{k-1} → θ_k                                 [main thread, JAX]
                   wait for R_{k+1}, then push θ_k (the engine never changes weights mid-generation)

So every batch is trained one update after the policy that sampled it. The staleness needs no new
machinery: the learner recomputes old logprobs with θ_{k-1} and rollout correction (tis/) weights
π_θ_{k-1} / π_rollout, which now covers both the quantization gap and the one-step lag.
The first batch (nothing to overlap yet) is generated synchronously; it is on-policy.

Only one generation is ever in flight, and everything else that touches the engine (push, probe,
held-out eval) happens after `wait()`, so the engine is used by one thread at a time.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Callable


class RolloutPrefetcher:
    """Runs `generate(step)` in one background thread; `submit(step)` then `wait()` → (result, seconds)."""

    def __init__(self, generate: Callable):
        self._generate = generate
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
        self._pending = None  # (step, future)

    def _timed(self, step):
        start = time.perf_counter()
        result = self._generate(step)
        return result, time.perf_counter() - start

    def submit(self, step: int) -> None:
        if self._pending is not None:
            raise RuntimeError("a rollout batch is already in flight; wait() for it first")
        self._pending = (step, self._pool.submit(self._timed, step))

    @property
    def pending_step(self):
        return None if self._pending is None else self._pending[0]

    def wait(self):
        """Blocks until the in-flight batch is done; → (step, result, generation seconds). Re-raises its error."""
        if self._pending is None:
            raise RuntimeError("no rollout batch in flight")
        step, future = self._pending
        self._pending = None
        result, seconds = future.result()
        return step, result, seconds

    def close(self) -> None:
        if self._pending is not None:  # let an in-flight generation finish before the engine closes
            try:
                self._pending[1].result()
            except Exception:
                pass
            self._pending = None
        self._pool.shutdown(wait=True)
