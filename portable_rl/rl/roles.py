"""The two roles a process plays in the training loop (train.py): the engine side, or a follower.

    EngineSide: the only process, or process 0 (the driver)      FollowerSide: processes 1 .. N-1
    ───────────────────────────────────────────────────────      ────────────────────────────────
    rollouts(step): task draws → environments ⇄ engine          rollouts(step): the driver's broadcast
        (turns, rl/turns.py) → rewards → dynamic sampling (a
        rollout source: sync, or prefetching step + 1 during
        training; rl/async_rollout.py) → broadcast (kept           → the same batch
        rollouts, step metrics)
        → batch + advantages (dapo.build_batch)
    wait_rollouts(): async: the in-flight generation               (nothing)
    push(): weight export (gathers) → torch → engine reload        push(): the same export, gathers only
    heldout(): greedy held-out accuracy through the engine         heldout(): {}
    write(step, m): metrics.jsonl + TensorBoard; plots()           write: the row, nothing written

train.py asks once which role this process has and then calls the same methods in the same order on
every process, so every collective (rl/multihost.py) is joined by all of them. With one process the engine
side broadcasts nothing and the loop is the single-process loop. Both push for the same `Serving` (the
engine's quantization and the push's SmoothQuant factors, rl/sync.py); the diagnostics after the push
have their own driver and follower halves (rl/diagnostics.py).
"""

from __future__ import annotations

import time

from portable_rl.rl.async_rollout import rollout_source
from portable_rl.rl.config import EnvironmentConfig
from portable_rl.rl.dapo import build_batch
from portable_rl.rl.evaluation import evaluate_examples
from portable_rl.rl.multihost import Processes, groups_from_wire, groups_to_wire, wire_bytes
from portable_rl.rl.rollout import collect_groups
from portable_rl.rl.sync import Serving, join_weight_export, push_weights


def batch_of(dapo, groups, pad_id: int, metrics: dict):
    """The step's batch (`dapo.build_batch`, adding its stats to `metrics`), or None when no group was kept
    (every group had equal rewards in every draw: nothing to learn from this step)."""
    if not groups:
        return None
    batch, batch_stats = build_batch(dapo, groups, pad_id)
    metrics.update(batch_stats)
    return batch


class EngineSide:
    """Owns the engine, the task draws, evaluation and the run directory's logs."""

    def __init__(self, *, engine, serving: Serving, writer, codec, task, reward_fn, dapo, seed: int, held_out,
                 greedy, async_rollouts: bool, procs: Processes = Processes(),
                 environment: EnvironmentConfig = EnvironmentConfig(), return_routed_experts: bool = False):
        self.engine, self.serving, self.writer, self.codec, self.procs = engine, serving, writer, codec, procs
        self.task, self.reward_fn, self.dapo, self.seed, self.environment = task, reward_fn, dapo, seed, environment
        self.held_out, self.greedy = held_out, greedy
        self.return_routed_experts = return_routed_experts  # routing replay (rl.PrecisionConfig.engine_routing)
        self.source = rollout_source(self._generate, prefetch=async_rollouts)  # sync, or one step ahead

    def _generate(self, step):  # data and sampling seeds depend only on (seed, step, draw): resumable
        return collect_groups(self.engine, self.codec, self.task, self.reward_fn, self.dapo, step=step,
                              seed=self.seed, environment=self.environment,
                              return_routed_experts=self.return_routed_experts)

    def rollouts(self, step: int, *, prefetch_next: bool):
        """→ (batch or None when no group was kept, step metrics, generation seconds). The kept rollouts and
        the metrics are broadcast to the other processes, which build the same batch. `prefetch_next`
        (async): start generating step + 1."""
        from portable_rl.tasks import data_metrics

        (groups, stats), seconds = self.source.get(step, prefetch_next=prefetch_next)
        metrics = {**stats, **data_metrics(self.task)}  # data/skipped_*: malformed dataset rows so far
        if self.procs.multiple:  # every process builds the batch from the same compact rollouts
            t_broadcast = time.perf_counter()
            wire, metrics = self.procs.broadcast((groups_to_wire(groups) if groups else None, metrics))
            groups = groups_from_wire(wire) if wire else []
            metrics.update({"time/broadcast": time.perf_counter() - t_broadcast,
                            "multihost/broadcast_bytes": wire_bytes(wire)})
        return batch_of(self.dapo, groups, self.codec.pad_id, metrics), metrics, seconds

    def wait_rollouts(self) -> None:
        """The engine must be idle before its weights change: wait for an in-flight generation."""
        self.source.drain()

    def push(self, model, model_config) -> None:
        self.procs.barrier("weight push")  # others wait here, not in a gather (async: generation runs on)
        push_weights(self.engine, model, model_config, smoothing=self.serving.smoothing)

    def heldout(self) -> dict:
        summary, _ = evaluate_examples(self.engine, self.codec, self.held_out, self.reward_fn, self.greedy,
                                       environment=self.environment)
        out = {"accuracy/heldout": summary["accuracy"], "eval/mean_length": summary["mean_length"]}
        if self.environment.max_turns > 1:
            out["eval/mean_turns"] = summary["mean_turns"]
        return out

    def write(self, step: int, metrics: dict) -> dict:
        return self.writer.write(step, metrics)

    def plots(self, run_dir) -> None:
        from portable_rl.rl.plots import write_plots

        write_plots(run_dir)

    def close(self) -> None:
        try:
            self.source.close()
            self.writer.close()
        finally:
            self.engine.close()


class FollowerSide:
    """Any process but the driver: receives what the driver broadcasts and joins every collective."""

    def __init__(self, procs: Processes, *, serving: Serving, dapo, pad_id: int):
        # serving: what the driver's engine serves
        self.procs, self.serving, self.dapo, self.pad_id = procs, serving, dapo, pad_id

    def rollouts(self, step: int, *, prefetch_next: bool):
        wire, metrics = self.procs.broadcast()
        return batch_of(self.dapo, groups_from_wire(wire) if wire else [], self.pad_id, metrics), metrics, 0.0

    def wait_rollouts(self) -> None:
        pass

    def push(self, model, model_config) -> None:
        self.procs.barrier("weight push")
        join_weight_export(model, model_config, self.serving.quantization, smoothing=self.serving.smoothing)

    def heldout(self) -> dict:
        return {}

    def write(self, step: int, metrics: dict) -> dict:
        return {"step": int(step), **metrics}

    def plots(self, run_dir) -> None:
        pass

    def close(self) -> None:
        pass
