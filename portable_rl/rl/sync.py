"""Weight push (learner → engine) and the post-sync probe.

Push: `convert.to_torch.iter_hf_tensors` yields (HF name, bf16 torch tensor) one parameter at a time
(DLPack views of the JAX buffers), and that one flat iterator is the push (engines/base.py, "Push"): each
adapter buckets it for its own transport (SGLang keeps q/k/v and gate/up together, the Ray fleet sizes
object-store buckets, vLLM reloads everything at once); an FP8 engine re-quantizes.
Probe: the engine samples a fixed probe batch with a fixed seed; the learner scores the same tokens;
`engines.probe` reports kl / max_abs_diff / mean_abs_diff (and raises for a bf16 engine out of tolerance);
`rl.mismatch_split` splits that KL into quantization, kernels (and, async, staleness) with extra learner forwards.

Several learner processes (rl/multihost.py): the export's per-parameter gathers are collectives, so every
process runs them (`join_weight_export` on all but the driver, which alone hands tensors to torch), and
the learner's probe logprobs are a sharded computation, so the driver broadcasts the probe rows (`share`)
and the others score them too, the mismatch split's forwards included (`follow_probe`).
"""

from __future__ import annotations

import os
import time

from portable_rl.convert.hf import LEARNER_QUANTIZED, export_arrays
from portable_rl.convert.to_torch import iter_hf_tensors
from portable_rl.engines import probe as probe_lib
from portable_rl.rl.batching import pack_rollouts
from portable_rl.rl.mismatch_split import MismatchSplit, extra_forwards, response_slices

PROBE_SEED = 1234


def push_weights(engine, model, model_config, *, smoothing=None) -> None:
    """engine.update_weights(the model's (hf_name, tensor) pairs, one flat lazy iterator): bf16, or int8 +
    scales for an INT8 engine (`push_quantization`), rescaled first by `smoothing` (`convert.smoothing`,
    SmoothQuant factors) when given. Adapters bucket the pairs for their own transport."""
    engine.update_weights(iter_hf_tensors(model, model_config, dtype="bfloat16",
                                          quantization=push_quantization(engine.quantization), smoothing=smoothing))


def push_quantization(engine_quantization: str | None) -> str | None:
    """The scheme the learner quantizes to before the push (`convert.hf.LEARNER_QUANTIZED`: INT8, pushed as
    int8 + scales), or None: bf16, and a quantizing engine re-quantizes it itself (FP8)."""
    return engine_quantization if engine_quantization in LEARNER_QUANTIZED else None


SMOOTHQUANT_FILE = "smoothquant_factors.npz"
SMOOTHQUANT_PROMPTS = 8


def smoothquant_for_run(alpha: float | None, *, model, codec, task, run_dir: str, engine_quantization, procs):
    """The run's SmoothQuant factors (`convert.smoothing`), or None when `alpha` is None.

    Read from `run_dir` when an earlier start of this run wrote them, so a resumed run pushes exactly what
    the uninterrupted one would; else calibrated on the learner's current weights with the first training
    batch's `SMOOTHQUANT_PROMPTS` prompts (every process runs the sharded forward) and saved."""
    from portable_rl.convert.smoothing import Smoothing, calibrate
    from portable_rl.errors import ConfigError

    if alpha is None:
        return None
    if push_quantization(engine_quantization) is None:
        raise ConfigError(f"train.smoothquant_alpha={alpha}: SmoothQuant flattens the activations of W8A8 "
                          f"engines, and this engine serves {engine_quantization!r}; set QUANTIZATION = "
                          "'int8_per_channel' or train.smoothquant_alpha = None")
    path = os.path.join(run_dir, SMOOTHQUANT_FILE)
    saved = procs.broadcast(Smoothing.load(path).factors if procs.is_driver and os.path.exists(path) else None)
    if saved is not None:
        return Smoothing(saved)
    smoothing = calibrate(model, [codec.encode_prompt(e.prompt) for e in task.train_batch(0, 0, SMOOTHQUANT_PROMPTS)],
                          alpha)
    if procs.is_driver:
        smoothing.save(path)
    return smoothing


def join_weight_export(model, model_config, engine_quantization: str | None = None, *, smoothing=None) -> None:
    """A non-driver process's half of `push_weights`: the same casts, quantizers and per-parameter gathers in
    the same order (collectives across processes), and no torch tensors."""
    for _ in export_arrays(model, model_config, dtype="bfloat16",
                           quantization=push_quantization(engine_quantization), smoothing=smoothing):
        pass


def probe_rows(prompts, responses, pad_id: int) -> tuple[dict, list[tuple[int, int]]]:
    """The probe's (prompt, response) pairs as learner rows {"input_ids", "attention_mask"} [B, T], one
    sequence per row, and each row's response span (first position, length)."""
    rows = len(prompts)
    batch = pack_rollouts(prompts, responses, [[0.0] * len(r) for r in responses], [0.0] * rows,
                          pad_id=pad_id, row_multiple=max(rows, 1))
    spans = [(len(p), len(r)) for p, r in zip(prompts, responses)]
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, spans


def follow_probe(learner, share) -> None:
    """A non-driver process's half of `run_probe`: scores the rows the driver broadcasts, and runs the
    mismatch split's forwards when the driver's message plans them (rl/mismatch_split.py)."""
    message = share()
    learner.logprobs(message["input_ids"], message["attention_mask"])
    extra_forwards(learner, message)


def run_probe(engine, learner, prompts, *, temperature: float, max_tokens: int, pad_id: int, share=None,
              split: MismatchSplit | None = None, smoothing=None) -> dict:
    """probe/* (engines/probe.py) and time/probe; with `split`, also mismatch/* and time/mismatch_split
    (rl/mismatch_split.py). The split's forwards run before the bf16 check, so that every learner process
    joins the same collectives whatever the check decides. `smoothing`: the SmoothQuant factors the pushes
    carry (`convert.smoothing`), which the split's served view applies too."""
    t_probe = time.perf_counter()
    quantization = engine.quantization  # part of the engine contract (engines/base.py)
    rollouts = probe_lib.sample_probe(engine, prompts, temperature=temperature, max_tokens=max_tokens,
                                      seed=PROBE_SEED)
    prompt_ids, responses = [r.prompt_token_ids for r in rollouts], [r.response_token_ids for r in rollouts]
    message, spans = probe_rows(prompt_ids, responses, pad_id)
    if split is not None:
        message["mismatch"] = split.plan(quantization, smoothing)
    message = share(message) if share is not None else message
    reference = response_slices(learner.logprobs(message["input_ids"], message["attention_mask"]), spans)
    t_split = time.perf_counter()
    forwards = extra_forwards(learner, message)
    split_seconds = time.perf_counter() - t_split
    engine_logprobs = [r.response_logprobs for r in rollouts]
    result = probe_lib.check_probe(probe_lib.compare_logprobs(engine_logprobs, reference),
                                   quantized=quantization is not None)
    metrics = result.as_metrics("probe/")
    if split is not None:
        t_split = time.perf_counter()
        metrics.update(split.metrics(message, spans, engine_logprobs, reference, forwards, quantization))
        metrics["time/mismatch_split"] = split_seconds + time.perf_counter() - t_split
    metrics["time/probe"] = time.perf_counter() - t_probe
    return metrics
