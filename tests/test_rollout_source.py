"""The loop's rollout source (rl/async_rollout.py): the same interface, on-policy or one step ahead."""

import threading

import pytest

from portable_rl.rl.async_rollout import PrefetchingRollouts, SyncRollouts, rollout_source


class Recorder:
    """generate(step) that records which thread asked for which step, and the weights version it saw."""

    def __init__(self):
        self.calls, self.weights = [], 0

    def __call__(self, step):
        self.calls.append((step, threading.current_thread().name.startswith("rollouts")))
        return f"R{step}@θ{self.weights}"


def run_loop(source, gen, steps):
    """train.py's order: get → (learner) → drain → push (weights += 1)."""
    seen = []
    for step in range(1, steps + 1):
        result, seconds = source.get(step, prefetch_next=step < steps)
        assert seconds >= 0
        seen.append(result)
        source.drain()
        gen.weights += 1  # the push: only after drain, never during a generation
    source.close()
    return seen


def test_sync_source_is_on_policy():
    gen = Recorder()
    source = rollout_source(gen, prefetch=False)
    assert isinstance(source, SyncRollouts)
    assert run_loop(source, gen, 3) == ["R1@θ0", "R2@θ1", "R3@θ2"]  # step k sampled with θ_{k-1}
    assert all(not in_thread for _, in_thread in gen.calls)


def test_prefetching_source_is_one_step_off_policy_and_generates_in_the_background():
    gen = Recorder()
    source = rollout_source(gen, prefetch=True)
    assert isinstance(source, PrefetchingRollouts)
    # step 1 is generated synchronously (nothing to overlap yet); step k+1 starts before θ_k is pushed
    assert run_loop(source, gen, 4) == ["R1@θ0", "R2@θ0", "R3@θ1", "R4@θ2"]
    assert [s for s, _ in gen.calls] == [1, 2, 3, 4] and all(t for _, t in gen.calls)
    assert len(gen.calls) == 4  # nothing generated past the last step


def test_prefetching_source_refuses_a_step_it_did_not_prefetch():
    gen = Recorder()
    source = PrefetchingRollouts(gen)
    source.get(1, prefetch_next=True)
    source.drain()
    with pytest.raises(RuntimeError, match="rollouts of step 2 were prefetched, step 5 was asked for"):
        source.get(5, prefetch_next=False)
    source.close()
