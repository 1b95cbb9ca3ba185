"""Post-sync probe: does the engine sample from the policy the learner just pushed?

After `update_weights`, the engine generates a fixed probe batch with a fixed seed; the caller scores the
same (prompt, response) pairs with the learner (`learner_jax.logprobs`, outside this JAX-free package) and
`compare_logprobs` reduces the per-token difference

    d_t = log π_learner(y_t) − log π_engine(y_t),        y_t ~ π_engine

to a `ProbeResult`:
    kl             = mean_t (exp(d_t) − 1 − d_t)   (the k3 estimator of KL(π_engine ‖ π_learner): unbiased
                                                    for samples from the engine, ≥ 0 term by term)
    max_abs_diff   = max_t |d_t|,   mean_abs_diff = mean_t |d_t|,   n_tokens.

In bf16 mode the two sides run the same weights in different kernels, so |d_t| stays at bf16 rounding level
(docs/engines.md gives the bound); a value above `threshold` means the weights the engine serves are not the
learner's — `check_probe` raises then. FP8 engines differ by design, so their mismatch is reported, not raised
(truncated importance sampling corrects for it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from portable_rl.engines.base import EngineAdapter, SamplingConfig

DEFAULT_BF16_THRESHOLD = 0.5  # max |Δ logprob| (nats); see docs/engines.md for the measured bf16 level


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    kl: float
    max_abs_diff: float
    mean_abs_diff: float
    n_tokens: int

    def as_metrics(self, prefix: str = "probe/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in dataclasses.asdict(self).items()}


class ProbeMismatchError(RuntimeError):
    """Engine and learner disagree on the probe batch beyond the bf16 tolerance."""


def compare_logprobs(engine_logprobs: Sequence[Sequence[float]],
                     reference_logprobs: Sequence[Sequence[float]]) -> ProbeResult:
    """Per-sequence lists of the same tokens' logprobs (engine, learner) → ProbeResult."""
    if len(engine_logprobs) != len(reference_logprobs):
        raise ValueError(f"{len(engine_logprobs)} engine sequences but {len(reference_logprobs)} reference ones")
    diffs = []
    for i, (eng, ref) in enumerate(zip(engine_logprobs, reference_logprobs)):
        eng, ref = list(map(float, eng)), list(map(float, ref))
        if len(eng) != len(ref):
            raise ValueError(f"sequence {i}: {len(eng)} engine logprobs but {len(ref)} reference logprobs")
        diffs.extend(r - e for e, r in zip(eng, ref))
    if not diffs:
        raise ValueError("the probe batch has no response tokens")
    if not all(math.isfinite(d) for d in diffs):
        return ProbeResult(kl=math.inf, max_abs_diff=math.inf, mean_abs_diff=math.inf, n_tokens=len(diffs))
    n = len(diffs)
    return ProbeResult(kl=sum(math.expm1(d) - d for d in diffs) / n, max_abs_diff=max(abs(d) for d in diffs),
                       mean_abs_diff=sum(abs(d) for d in diffs) / n, n_tokens=n)


def check_probe(result: ProbeResult, *, threshold: float = DEFAULT_BF16_THRESHOLD,
                quantized: bool = False) -> ProbeResult:
    """Raises ProbeMismatchError for a bf16 engine whose max |Δ logprob| exceeds `threshold`."""
    if not quantized and not result.max_abs_diff <= threshold:  # `not <=` also catches NaN
        raise ProbeMismatchError(
            f"post-sync probe: engine vs learner max |Δ logprob| = {result.max_abs_diff:.4g} nats "
            f"(mean {result.mean_abs_diff:.4g}, KL {result.kl:.4g}, {result.n_tokens} tokens) exceeds the bf16 "
            f"threshold {threshold}. The engine is not serving the learner's weights: likely a wrong HF name "
            "mapping or transpose in convert/mapping.py, weights that were not pushed (stale engine), a dtype "
            "mismatch, or a tokenizer/config that differs between learner and engine checkpoint.")
    return result


PROBE_SEED = 1234  # the probe batch's sampling seed: the same batch after every push


def sample_probe(engine: EngineAdapter, prompts: Sequence[Sequence[int]], *, temperature: float = 1.0,
                 max_tokens: int = 16, seed: int = PROBE_SEED) -> list:
    """The probe batch: one seeded response per prompt, with the engine's logprobs (`Rollout`s)."""
    return engine.generate(prompts, SamplingConfig(temperature=temperature, max_tokens=max_tokens, seed=seed))


def measure_probe(engine: EngineAdapter, prompts: Sequence[Sequence[int]],
                  reference_fn: Callable[[list[list[int]], list[list[int]]], Sequence[Sequence[float]]], *,
                  temperature: float = 1.0, max_tokens: int = 16, seed: int = PROBE_SEED
                  ) -> tuple[list, Sequence[Sequence[float]], ProbeResult]:
    """Generates the probe batch, scores it with `reference_fn(prompts, responses) -> per-token logprobs`
    (the learner's, at the same temperature) and compares: (the rollouts, the reference, the result)."""
    rollouts = sample_probe(engine, prompts, temperature=temperature, max_tokens=max_tokens, seed=seed)
    reference = reference_fn([r.prompt_token_ids for r in rollouts], [r.response_token_ids for r in rollouts])
    return rollouts, reference, compare_logprobs([r.response_logprobs for r in rollouts], reference)


def run_probe(engine: EngineAdapter, prompts: Sequence[Sequence[int]],
              reference_fn: Callable[[list[list[int]], list[list[int]]], Sequence[Sequence[float]]], *,
              temperature: float = 1.0, max_tokens: int = 16, seed: int = PROBE_SEED,
              threshold: float = DEFAULT_BF16_THRESHOLD, quantized: bool = False) -> ProbeResult:
    """`measure_probe`, then `check_probe` (raises for bf16 above `threshold`)."""
    _, _, result = measure_probe(engine, prompts, reference_fn, temperature=temperature, max_tokens=max_tokens,
                                 seed=seed)
    return check_probe(result, threshold=threshold, quantized=quantized)
