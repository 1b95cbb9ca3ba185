"""Weight push (learner → engine) and the post-sync probe.

Push: `convert.to_torch.iter_hf_tensors` yields (HF name, bf16 torch tensor) one parameter at a time
(DLPack views of the JAX buffers), and that one flat iterator is the push (engines/base.py, "Push"): each
adapter buckets it for its own transport (SGLang keeps q/k/v and gate/up together, the Ray fleet sizes
object-store buckets, vLLM reloads everything at once); an FP8 engine re-quantizes.
Probe: the engine samples a fixed probe batch with a fixed seed; the learner scores the same tokens;
`engines.probe` reports kl / max_abs_diff / mean_abs_diff (and raises for a bf16 engine out of tolerance).

Several learner processes (rl/multihost.py): the export's per-parameter gathers are collectives, so every
process runs them (`join_weight_export` on all but the driver, which alone hands tensors to torch), and
the learner's probe logprobs are a sharded computation, so the driver broadcasts the probe rows (`share`)
and the others score them too (`follow_probe`).
"""

from __future__ import annotations

import warnings

from portable_rl.convert.hf import cast_params
from portable_rl.convert.to_torch import iter_hf_tensors
from portable_rl.engines import probe as probe_lib
from portable_rl.rl.batching import pack_rollouts

PROBE_SEED = 1234


_BUCKET_MB_WARNED = False


def push_weights(engine, model, model_config, bucket_mb: int | None = None) -> None:
    """engine.update_weights(the model's bf16 (hf_name, tensor) pairs, one flat lazy iterator).

    `bucket_mb` is deprecated and ignored (kept one release): adapters bucket for their own transport
    (`SGLangEngine(bucket_bytes=...)`, `RayEngineFleet(bucket_bytes=...)`), and the learner-side buckets it
    sized were flattened again by every in-tree adapter."""
    global _BUCKET_MB_WARNED
    if bucket_mb is not None and not _BUCKET_MB_WARNED:
        _BUCKET_MB_WARNED = True
        warnings.warn(f"bucket_mb={bucket_mb} (train.sync_bucket_mb) is ignored: engines bucket the flat push "
                      "for their own transport; set the adapter's bucket_bytes instead", FutureWarning,
                      stacklevel=2)
    engine.update_weights(iter_hf_tensors(model, model_config, dtype="bfloat16"))


def join_weight_export(model, model_config) -> None:
    """A non-driver process's half of `push_weights`: the same casts and per-parameter gathers in the same
    order (collectives across processes), and no torch."""
    for _ in cast_params(model, model_config, "bfloat16"):
        pass


def learner_reference_fn(learner, pad_id: int, share=None):
    """(prompts, responses) → the learner's per-token logprobs of the responses at the rollout temperature.
    `share`: broadcasts the packed rows to the other learner processes first (`Processes.broadcast`)."""
    def reference(prompts, responses):
        rows = len(prompts)
        batch = pack_rollouts(prompts, responses, [[0.0] * len(r) for r in responses], [0.0] * rows,
                              pad_id=pad_id, row_multiple=max(rows, 1))
        arrays = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        arrays = share(arrays) if share is not None else arrays
        logp = learner.logprobs(arrays["input_ids"], arrays["attention_mask"])
        return [logp[i, len(p):len(p) + len(r)].tolist() for i, (p, r) in enumerate(zip(prompts, responses))]
    return reference


def follow_probe(learner, share) -> None:
    """A non-driver process's half of `run_probe`: scores the rows the driver's reference broadcasts."""
    arrays = share()
    learner.logprobs(arrays["input_ids"], arrays["attention_mask"])


def run_probe(engine, learner, prompts, *, temperature: float, max_tokens: int, pad_id: int, share=None) -> dict:
    quantized = engine.quantization is not None  # part of the engine contract (engines/base.py)
    result = probe_lib.run_probe(engine, prompts, learner_reference_fn(learner, pad_id, share),
                                 temperature=temperature, max_tokens=max_tokens, seed=PROBE_SEED,
                                 quantized=quantized)
    return result.as_metrics("probe/")
