"""Weight push (learner → engine).

Push: `convert.to_torch.iter_hf_tensors` yields (HF name, bf16 torch tensor) one parameter at a time
(DLPack views of the JAX buffers), and that one flat iterator is the push (engines/base.py, "Push"): each
adapter buckets it for its own transport (SGLang keeps q/k/v and gate/up together, the Ray fleet sizes
object-store buckets, vLLM reloads everything at once); an FP8 engine re-quantizes.
What the step measures after the push (the probe, the mismatch split, update survival): rl/diagnostics.py.

Several learner processes (rl/multihost.py): the export's per-parameter gathers are collectives, so every
process runs them (`join_weight_export` on all but the driver, which alone hands tensors to torch).
"""

from __future__ import annotations

import dataclasses
import os

from portable_rl.convert.hf import LEARNER_QUANTIZED, export_arrays
from portable_rl.convert.to_torch import iter_hf_tensors


@dataclasses.dataclass(frozen=True)
class Serving:
    """What the engine serves: its `quantization` (engines/base.py) and the push's SmoothQuant factors (or None),
    known on every process."""
    quantization: str | None
    smoothing: object = None

    @property
    def label(self) -> str | None:
        return self.quantization if self.smoothing is None else f"{self.quantization}+smoothquant"


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
        raise ConfigError(f"rl.PrecisionConfig.smoothquant_alpha={alpha}: SmoothQuant flattens the activations of W8A8 "
                          f"engines, and this engine serves {engine_quantization!r}; set QUANTIZATION = "
                          "'int8_per_channel' or rl.PrecisionConfig.smoothquant_alpha = None")
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
