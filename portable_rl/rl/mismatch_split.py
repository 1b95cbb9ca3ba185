"""The engine/learner mismatch of the post-sync probe, split by its source: quantization, kernels, staleness.

The probe (rl/sync.py, engines/probe.py) samples a fixed batch from the engine right after a push of θ_k and
compares, per response token y_t ~ π_engine,

    a_t = log π_θk(y_t)                the learner: its own weights and dtypes
    e_t = log π_engine(y_t)            the engine: Q(bf16(θ_k)) in its own kernels
    probe/kl = K(a − e),    K(d) = mean_t (exp(d_t) − 1 − d_t)    (the probe's k3 estimator, `compare_logprobs`)

The split scores the same rows once more with the learner, its decoder projections (q/k/v/o, gate/up/down)
and MoE experts (the matrices the engine quantizes) replaced by the engine's weight quantizer applied to them;
embeddings, lm_head, norms, biases and MoE routers stay as the learner has them, as the engine keeps them in bf16:

    q_t = log π_θk[W ← Q(W) for every projection and expert W](y_t)

    mismatch/quantization = K(a − q)    what the engine's weight quantization changes, alone
    mismatch/kernels      = K(q − e)    the rest, with the same weights: bf16 vs the learner's compute dtype,
                                        other kernels and reduction orders, and what is not emulated (the
                                        engine's activation and KV-cache quantization, its sampler)
    mismatch/interaction  = mean_t (exp(a_t − q_t) − 1)(exp(q_t − e_t) − 1)
    mismatch/quantization_max_abs_diff = max_t |a_t − q_t|,  mismatch/kernels_max_abs_diff = max_t |q_t − e_t|

Per token a − e = (a − q) + (q − e), and k3(x + y) = k3(x) + k3(y) + (e^x − 1)(e^y − 1), so

    probe/kl = mismatch/quantization + mismatch/kernels + mismatch/interaction    (exactly, up to float rounding)

The interaction is second order (≈ mean_t (a_t − q_t)(q_t − e_t)) and small when the two differences are
uncorrelated across tokens; it is not a KL and can be negative.

Q, per the engine's `quantization` (engines/base.py):
    None                 identity: no extra forward; quantization = 0 exactly, kernels = probe/kl
    "fp8_per_channel"    vLLM's online per-output-channel e4m3         (learner_jax/quantize.py, each checked
    "int8_per_channel"   INT8 W8A8's per-output-channel int8 weights     against the engine's own values),
                         after the push's SmoothQuant factors when it carries them (`convert.smoothing`)
    anything else        not modelled: no quantization / kernels parts (a warning, once); probe/kl as before
The quantized copy is `served_view.serve_as_engine`'s, the served view the learner trains on with
`rl.PrecisionConfig.learner_precision = 'engine'`; such a learner's own forward already is q, so the split runs no
extra forward for it: q = a, mismatch/quantization = 0 and mismatch/kernels = probe/kl exactly
(tests/test_learner_precision.py checks that its logprobs equal `quantized_learner`'s bit for bit).

Staleness (async rollouts, rl/async_rollout.py: step k+1's batch was sampled by the engine serving θ_{k−1}
while the learner holds θ_k). The previous probe's rows y ~ π_engine(θ_{k−1}) and their learner logprobs
a^{k−1} are kept; after the push of θ_k the learner scores those rows again:

    mismatch/staleness = K(a^k − a^{k−1})    on the previous probe's tokens: ≈ KL(π_θ(k−1) ‖ π_θk), the
                                             one-step lag of an async batch (from the second probe of a
                                             process on; not in synchronous runs, where it is 0 by construction)

Cost: one learner forward on the probe rows (and one on the previous rows in async mode), and while it runs
a quantized copy of the projection kernels. Several learner processes (rl/multihost.py): the forwards are
sharded collectives, so the driver broadcasts the plan (which forwards, the previous rows) with the probe
rows, and every process runs `extra_forwards` on what it received.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from portable_rl.convert.hf import get_param
from portable_rl.engines.probe import compare_logprobs
from portable_rl.learner_jax.quantize import SERVED_WEIGHTS
from portable_rl.rl.served_view import projection_paths, quantized_kernels, serve_as_engine

# engine `quantization` → its weight quantizer on an NNX kernel [in, out] (output channels are columns)
WEIGHT_QUANTIZERS = {k: v for k, v in SERVED_WEIGHTS.items() if k is not None}
MODELLED = (None, *WEIGHT_QUANTIZERS)


def with_quantized_projections(model, quantization: str):
    """A copy of `model` whose decoder projection and expert kernels are Q(W), in their own dtype and sharding;
    every other parameter is the model's own array (shared, not copied). `model` is not changed."""
    paths = projection_paths(model.config)
    graphdef, state = nnx.split(model)
    quantized_model = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # new Variables, the same arrays
    kernels = [get_param(model, p)[...] for p in paths]
    for path, kernel, q in zip(paths, kernels, quantized_kernels(kernels, quantization)):
        get_param(quantized_model, path)[...] = jax.device_put(q, kernel.sharding)  # a no-op when it matches
    return quantized_model


@functools.partial(jax.jit, static_argnames=("graphdef", "quantization", "forward"))
def _forward_of_state(state, input_ids, attention_mask, smoothing_factors=None, *, graphdef, quantization, forward):
    """`forward(model, input_ids, attention_mask)` of the model (`graphdef`, `state`), served as the engine
    serves it (`served_view.serve_as_engine`) unless `quantization` is None, in one XLA program: the quantized kernels
    are temporaries of it (no model copy to build), and the call costs one jit dispatch on the state, not an
    `nnx.jit`'s."""
    model = nnx.merge(graphdef, state)  # a copy inside the trace: the caller's model is not changed
    if quantization is not None:
        serve_as_engine(model, quantization, smoothing_factors)
    return forward(model, input_ids, attention_mask)


def scoring_learner(learner, quantization: str | None = None, smoothing_factors=None):
    """`learner` whose `logprobs` runs its forward through `_forward_of_state` (`Learner.scoring_view`: the
    jitted forward `Learner.logprobs` calls, within its row padding and mesh, wrapped), quantizing the
    projections first when `quantization` is set.
    Everything else (the forward itself, the mesh, the layout) is the learner's own; with a quantization the
    same logprobs as the learner on `with_quantized_projections` (tests/test_mismatch_split.py), without the
    Python cost of building that copy."""
    def wrap(forward):
        def forward_of_state(model, input_ids, attention_mask):
            graphdef, state = nnx.split(model)
            return _forward_of_state(state, input_ids, attention_mask, smoothing_factors, graphdef=graphdef,
                                     quantization=quantization, forward=forward)
        return forward_of_state

    return learner.scoring_view(wrap)


def quantized_learner(learner, quantization: str, smoothing_factors=None):
    """`learner` scoring as the engine serves it: its decoder projections quantized by the engine's
    `quantization`, after the push's SmoothQuant factors if any (weights only: activations are the engine's)."""
    return scoring_learner(learner, quantization, smoothing_factors)


@functools.partial(jax.jit, static_argnames=("graphdef", "quantization", "forward", "split"))
def _quantized_then_current_of_state(state, input_ids, attention_mask, smoothing_factors=None, *, graphdef,
                                     quantization, forward, split):
    """Rows [:split] under quantized projections, rows [split:] under the model's own: async mode's two
    forwards in one XLA program and one dispatch (the state is flattened once)."""
    quantized = _forward_of_state(state, input_ids[:split], attention_mask[:split], smoothing_factors,
                                  graphdef=graphdef, quantization=quantization, forward=forward)
    current = _forward_of_state(state, input_ids[split:], attention_mask[split:], graphdef=graphdef,
                                quantization=None, forward=forward)
    return jnp.concatenate([quantized, current], axis=0)


def _stack_rows(a: dict, b: dict) -> dict:
    """Two {"input_ids", "attention_mask"} row sets as one, right-padded (mask 0) to the longer width."""
    width = max(a["input_ids"].shape[1], b["input_ids"].shape[1])
    pad = lambda x: np.pad(np.asarray(x), [(0, 0), (0, width - np.shape(x)[1])])
    return {k: np.concatenate([pad(a[k]), pad(b[k])]) for k in ("input_ids", "attention_mask")}


def extra_forwards(learner, message: dict) -> dict:
    """The split's learner forwards on a probe message (`MismatchSplit.plan` under "mismatch"; none without
    it): {"quantized": [B, T] logprobs of the quantized learner, "current_on_previous": the learner's on the
    previous probe's rows}, each present when planned. Every learner process runs it on the same message."""
    plan = message.get("mismatch")
    out = {}
    if plan is None:
        return out
    if learner.serves_engine_weights:  # its own forward is the quantized one (q = a): no extra forward
        plan = dict(plan, quantizer=None)
    rows = plan["previous_rows"]
    if plan["quantizer"] is not None and rows is not None:  # async: both forwards in one call
        probe_rows = len(message["input_ids"])
        both = _stack_rows(message, rows)

        def wrap(forward):
            def forward_of_state(model, input_ids, attention_mask):
                graphdef, state = nnx.split(model)
                return _quantized_then_current_of_state(state, input_ids, attention_mask, plan.get("smoothing"),
                                                        graphdef=graphdef, quantization=plan["quantizer"],
                                                        forward=forward, split=probe_rows)
            return forward_of_state
        logp = learner.scoring_view(wrap).logprobs(both["input_ids"], both["attention_mask"])
        width = lambda x: np.shape(x)[1]
        return {"quantized": logp[:probe_rows, :width(message["input_ids"])],
                "current_on_previous": logp[probe_rows:probe_rows + len(rows["input_ids"]), :width(rows["input_ids"])]}
    if plan["quantizer"] is not None:
        out["quantized"] = quantized_learner(learner, plan["quantizer"], plan.get("smoothing")).logprobs(
            message["input_ids"], message["attention_mask"])
    if rows is not None:
        out["current_on_previous"] = scoring_learner(learner).logprobs(rows["input_ids"], rows["attention_mask"])
    return out


def response_slices(logprobs, spans) -> list[list[float]]:
    """[B, T] logprobs → per row i the entries spans[i] = (first response position, response length)."""
    logprobs = np.asarray(logprobs)
    return [logprobs[i, start:start + length].tolist() for i, (start, length) in enumerate(spans)]


class MismatchSplit:
    """Driver-side state of the split: the plan of each probe and its metrics (module doc).

    `plan(quantization)` → the "mismatch" entry of the probe message; `metrics(...)` after `extra_forwards`.
    `staleness`: keep each probe's rows for `mismatch/staleness` at the next one (async rollouts)."""

    def __init__(self, *, staleness: bool = False):
        self.staleness = staleness
        self._previous = None  # (rows {"input_ids", "attention_mask"}, spans, learner logprobs per sequence)
        self._warned = False

    def plan(self, quantization: str | None, smoothing=None) -> dict:
        """`smoothing`: the `convert.smoothing.Smoothing` the engine's pushes carry (INT8), or None."""
        if quantization not in MODELLED and not self._warned:
            self._warned = True
            warnings.warn(f"mismatch/quantization and mismatch/kernels: the engine's quantization {quantization!r} "
                          f"is not modelled (modelled: {', '.join(map(str, MODELLED))}); only probe/kl "
                          "and mismatch/staleness are reported", stacklevel=2)
        previous = self._previous[0] if self._previous is not None else None
        quantizer = quantization if quantization in WEIGHT_QUANTIZERS else None
        return {"quantizer": quantizer, "previous_rows": previous,
                "smoothing": smoothing.factors if smoothing is not None and quantizer is not None else None}

    def metrics(self, message: dict, spans, engine_logprobs, learner_logprobs, forwards: dict,
                quantization: str | None) -> dict[str, float]:
        """`engine_logprobs` / `learner_logprobs`: per sequence, the probe's; `forwards`: `extra_forwards`'s."""
        out = {}
        if quantization in MODELLED:
            quantized = (response_slices(forwards["quantized"], spans) if "quantized" in forwards
                         else learner_logprobs)  # no quantizer: the learner's own logprobs, q = a
            quant = compare_logprobs(quantized, learner_logprobs)   # d = a − q
            kernels = compare_logprobs(engine_logprobs, quantized)  # d = q − e
            pairs = [(a - q, q - e) for la, lq, le in zip(learner_logprobs, quantized, engine_logprobs)
                     for a, q, e in zip(map(float, la), map(float, lq), map(float, le))]
            interaction = sum(np.expm1(x) * np.expm1(y) for x, y in pairs) / max(len(pairs), 1)
            out.update({"mismatch/quantization": quant.kl, "mismatch/kernels": kernels.kl,
                        "mismatch/interaction": float(interaction),
                        "mismatch/quantization_max_abs_diff": quant.max_abs_diff,
                        "mismatch/kernels_max_abs_diff": kernels.max_abs_diff})
        if "current_on_previous" in forwards:
            _, previous_spans, previous_logprobs = self._previous
            current = response_slices(forwards["current_on_previous"], previous_spans)
            out["mismatch/staleness"] = compare_logprobs(previous_logprobs, current).kl  # d = a^k − a^(k−1)
        if self.staleness:
            rows = {k: np.asarray(message[k]) for k in ("input_ids", "attention_mask")}
            self._previous = (rows, list(spans), [list(map(float, s)) for s in learner_logprobs])
        return out
