"""What the RL step measures after each weight push: three diagnostics behind one small interface.

    update_survival   sync/*       how much of the learner's update the engine's (quantized) weights received
                                   (rl/update_survival.py)
    probe             probe/*      the engine samples a fixed batch of held-out prompts with a fixed seed, the
                                   learner scores the same tokens: kl (k3), max / mean |Δ logprob| (engines/probe.py;
                                   a bf16 engine past the bf16 bound stops the run)
    mismatch_split    mismatch/*   the probe's KL split into quantization, kernels and, async, staleness with
                                   extra learner forwards on the probe's rows (rl/mismatch_split.py)

A diagnostic has a `name` and `after_push() -> metrics`; the step (train.rl_step) calls each in this order after
the push and times it as time/<name>. All three are on by default; `DiagnosticsConfig.disabled` turns any of
them off by name (`rl.DiagnosticsConfig`, rl/config.py; the split needs the probe). Several JAX processes (rl/multihost.py): every process builds the
same diagnostics and calls them in the same order, because the learner's forwards and the gathers are
collectives; only the driver has the engine, and it broadcasts the probe's rows and the split's plan.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from portable_rl.engines import probe as probe_lib
from portable_rl.rl.batching import pack_rollouts
from portable_rl.rl.config import DiagnosticsConfig
from portable_rl.rl.mismatch_split import MismatchSplit, extra_forwards, response_slices
from portable_rl.rl.multihost import Processes
from portable_rl.rl.sync import Serving
from portable_rl.rl.update_survival import UpdateSurvival, learner_weights

class Diagnostic(Protocol):
    name: str

    def after_push(self) -> dict[str, float]:
        """Metrics of the weights just pushed; called on every process, in the same order."""


class UpdateSurvivalDiagnostic:
    """sync/*: `UpdateSurvival.measure` of the weights just pushed. Built when the engine already serves the run's
    first weights, which it records as the reference of the first push."""
    name = "update_survival"

    def __init__(self, survival: UpdateSurvival, model, optimizer, serving: Serving, procs: Processes):
        self.survival, self.model, self.optimizer = survival, model, optimizer
        survival.serving(serving.label)
        if survival.note and procs.is_driver:
            print(survival.note, flush=True)
        survival.measure(learner_weights(model, optimizer))

    def after_push(self) -> dict[str, float]:
        return self.survival.measure(learner_weights(self.model, self.optimizer))


def probe_rows(prompts, responses, pad_id: int) -> tuple[dict, list[tuple[int, int]]]:
    """The probe's (prompt, response) pairs as learner rows {"input_ids", "attention_mask"} [B, T], one
    sequence per row, and each row's response span (first position, length)."""
    rows = len(prompts)
    batch = pack_rollouts(prompts, responses, [[0.0] * len(r) for r in responses], [0.0] * rows,
                          pad_id=pad_id, row_multiple=max(rows, 1))
    spans = [(len(p), len(r)) for p, r in zip(prompts, responses)]
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, spans


@dataclasses.dataclass
class ProbeSample:
    """One probe's rows and logprobs (the split reads them): rows [B, T] as scored; per sequence, the engine's
    and the learner's response logprobs (the driver's only: empty on the other processes)."""
    rows: dict
    spans: list
    engine_logprobs: list
    learner_logprobs: list


class ProbeDiagnostic:
    """probe/*: the engine samples `prompts` (`engines.probe.PROBE_SEED`) and the learner scores the same tokens
    (`engines.probe.measure_probe`; `check_probe` raises for a bf16 engine out of tolerance). `engine` is
    None on the processes that follow the driver: they score the rows it broadcasts."""
    name = "probe"

    def __init__(self, *, engine, learner, prompts, temperature: float, max_tokens: int, pad_id: int,
                 procs: Processes = Processes()):
        self.engine, self.learner, self.prompts, self.procs = engine, learner, prompts, procs
        self.temperature, self.max_tokens, self.pad_id = temperature, max_tokens, pad_id
        self.last: ProbeSample | None = None

    def after_push(self) -> dict[str, float]:
        if self.engine is None:
            rows = self.procs.broadcast()
            self.learner.logprobs(rows["input_ids"], rows["attention_mask"])
            self.last = ProbeSample(rows, [], [], [])
            return {}
        scored = {}

        def score(prompts, responses):  # the learner's logprobs of the engine's tokens, on every process
            rows, spans = probe_rows(prompts, responses, self.pad_id)
            rows = self.procs.broadcast(rows)
            scored.update(rows=rows, spans=spans)
            return response_slices(self.learner.logprobs(rows["input_ids"], rows["attention_mask"]), spans)

        rollouts, reference, result = probe_lib.measure_probe(self.engine, self.prompts, score,
                                                              temperature=self.temperature, max_tokens=self.max_tokens)
        self.last = ProbeSample(scored["rows"], scored["spans"], [r.response_logprobs for r in rollouts], reference)
        return probe_lib.check_probe(result, quantized=self.engine.quantization is not None).as_metrics("probe/")


class MismatchSplitDiagnostic:
    """mismatch/*: the last probe's KL split by source (rl/mismatch_split.py). The driver plans the extra
    forwards (the engine's weight quantizer, the previous probe's rows when async) and broadcasts the plan;
    every process runs them on the probe's rows."""
    name = "mismatch_split"

    def __init__(self, *, probe: ProbeDiagnostic, serving: Serving, staleness: bool):
        self.probe, self.serving = probe, serving
        self.split = MismatchSplit(staleness=staleness) if probe.engine is not None else None

    def after_push(self) -> dict[str, float]:
        procs, sample = self.probe.procs, self.probe.last
        plan = procs.broadcast(self.split.plan(self.serving.quantization, self.serving.smoothing)
                               if self.split is not None else None)
        forwards = extra_forwards(self.probe.learner, {**sample.rows, "mismatch": plan})
        if self.split is None:
            return {}
        return self.split.metrics(sample.rows, sample.spans, sample.engine_logprobs, sample.learner_logprobs,
                                  forwards, self.serving.quantization)


def make_diagnostics(config: DiagnosticsConfig, *, engine, learner, model, optimizer, survival, serving: Serving,
                     probe_prompts, temperature: float, max_tokens: int, pad_id: int, staleness: bool,
                     procs: Processes) -> list[Diagnostic]:
    """The enabled diagnostics in the order the step runs them. `survival`: the `UpdateSurvival` whose reference
    (the starting checkpoint) was taken before a resume restored the learner; None when disabled."""
    out: list[Diagnostic] = []
    if config.enabled("update_survival"):
        out.append(UpdateSurvivalDiagnostic(survival, model, optimizer, serving, procs))
    if config.enabled("probe"):
        probe = ProbeDiagnostic(engine=engine, learner=learner, prompts=probe_prompts, temperature=temperature,
                                max_tokens=max_tokens, pad_id=pad_id, procs=procs)
        out.append(probe)
        if config.enabled("mismatch_split"):
            out.append(MismatchSplitDiagnostic(probe=probe, serving=serving, staleness=staleness))
    return out
