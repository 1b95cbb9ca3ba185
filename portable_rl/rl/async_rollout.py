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


# ----------------------------------------------------------------------------- the loop's rollout source
class SyncRollouts:
    """The on-policy source: step k's rollouts are generated when the loop asks for them."""

    def __init__(self, generate: Callable):
        self._generate = generate

    def get(self, step: int, *, prefetch_next: bool):
        """→ (step's result, generation seconds); `prefetch_next` is ignored."""
        start = time.perf_counter()
        result = self._generate(step)
        return result, time.perf_counter() - start

    def drain(self) -> None:
        """Nothing is ever in flight."""

    def close(self) -> None:
        pass


class PrefetchingRollouts:
    """The one-step off-policy source (module doc): `get(k)` returns R_k and starts R_{k+1}."""

    def __init__(self, generate: Callable):
        self._prefetcher = RolloutPrefetcher(generate)
        self._ready = None  # (step, result, seconds) of a generation that finished before it was asked for

    def get(self, step: int, *, prefetch_next: bool):
        if self._ready is None:
            if self._prefetcher.pending_step is None:  # first step after (re)start: nothing to overlap with yet
                self._prefetcher.submit(step)
            self._ready = self._prefetcher.wait()
        (ready_step, result, seconds), self._ready = self._ready, None
        if ready_step != step:
            raise RuntimeError(f"rollouts of step {ready_step} were prefetched, step {step} was asked for")
        if prefetch_next:
            self._prefetcher.submit(step + 1)  # sampled with the engine's current weights, θ_{step-1}
        return result, seconds

    def drain(self) -> None:
        """Waits for an in-flight generation: the engine must be idle before its weights change."""
        if self._prefetcher.pending_step is not None:
            self._ready = self._prefetcher.wait()

    def close(self) -> None:
        self._prefetcher.close()


def rollout_source(generate: Callable, *, prefetch: bool):
    """The loop's one rollout interface: `get(step, prefetch_next=)`, `drain()`, `close()`."""
    return PrefetchingRollouts(generate) if prefetch else SyncRollouts(generate)
