"""Did the update survive the push? How much of a step's weight update the engine's weights really receive.

The engine does not serve the learner's fp32 master weights W but Q(W): the push rounds them to bf16 and a
quantized engine re-quantizes that. Between two pushes k-1 and k, over the tracked entries:

    Δ   = W_k − W_{k−1}                 the learner's update
    Δ_q = Q(W_k) − Q(W_{k−1})           the update the engine serves

    sync/quantized_changed_frac = mean[ Q(W_k) ≠ Q(W_{k−1}) ]      0: the engine's weights did not move
    sync/update_lost_frac       = 1 − ⟨Δ_q, Δ⟩ / ‖Δ‖²              the share of the update the engine lacks,
                                                                    measured along the update: 0 delivered,
                                                                    1 nothing delivered (0 when Δ = 0)

and the same since the starting checkpoint (W_0): how much of everything the learner moved the engine now
serves,

    sync/cumulative_update_lost_frac = 1 − ⟨Q(W_k) − Q(W_0), W_k − W_0⟩ / ‖W_k − W_0‖²

Measured along Δ, not as ‖Δ_q − Δ‖: an entry whose update crosses a rounding boundary jumps by a whole ulp,
so ‖Δ_q − Δ‖ is dominated by rounding noise that averages out over entries and steps. The projection
counts only what moves the served weights the learner's way. A weight that starts on the bf16 grid (every
weight of a bf16 checkpoint) must move half an ulp before its served value changes at all, so small
steps are lost until they add up; weights in the middle of a cell deliver them on average.

Q, per engine `quantization` (what the adapter reports):

    None (bf16 engine)     Q(W) = bf16(W)
    "fp8_per_channel"      per output channel e4m3 of bf16(W)     (learner_jax/quantize.py has each formula,
    "int8_per_channel"     per output channel int8 of bf16(W)      checked against the engine side's)

The bf16 stage alone is always reported too (`sync/bf16_changed_frac`, `sync/bf16_update_lost_frac`; for a
bf16 engine the same numbers): what the push's rounding loses before any quantizer. Other schemes (per-tensor
or blockwise FP8, fake quantization) get the bf16 stage only: their scales span fused or tiled groups that
this tracker does not model.

W is what the optimizer steps: the model's params, or, with bf16 params and fp32 masters
(`optim.with_master_weights`), the masters (`learner_weights`); the bf16 params are already Q's first stage.

Tracked entries: every `channel_stride`-th output channel of each decoder projection (q/k/v/o, gate/up/down)
and of each MoE expert's (the matrices engines quantize; the routers stay float). A per-channel scale needs only its own channel, so the subset is exact for
those channels; the tracker keeps their previous and starting fp32 values (8 / channel_stride bytes per
projection parameter, sharded like the params; the starting ones also after a resume). Every process runs
it: the subset copies (stacked by shape), then one jitted function of them.

Why: at RL learning rates most Adam steps are smaller than half a bf16 ulp of the weight they move (for
|w| ≈ 0.5 the bf16 spacing is 2^-8 ≈ 0.004 against lr-sized steps of 1e-5..1e-4), so the served policy can
lag the learner's without any error anywhere (QuRL, arXiv 2602.13953; docs/training.md "SmolLM2").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from portable_rl.convert.hf import get_param
from portable_rl.rl.served_view import projection_paths
from portable_rl.learner_jax.quantize import SERVED_WEIGHTS, served_bf16
from portable_rl.learner_jax.optim import MasterWeightsState

# the quantizers whose served column depends on that column alone: the tracker sees every stride-th channel,
# which would change a per-tensor scale (fake nvfp4, fake fp8_e4m3_tensor)
TRACKED_SCHEMES = (None, "fp8_per_channel", "int8_per_channel", "fake_mxfp4")


def learner_weights(model, optimizer=None):
    """W of the module doc: the optimizer's full-precision masters when it keeps them (bf16 params,
    `optim.with_master_weights`), else the model. Either is read by NNX path (`get_param`)."""
    state = getattr(optimizer, "opt_state", None)
    return state.master if isinstance(state, MasterWeightsState) else model


def _stage_metrics(served, new, old):
    """(fraction of changed served entries, 1 − ⟨Δ_q, Δ⟩ / ‖Δ‖²), both over all the matrices together
    (`new`, `old`: lists of [n, in, C] stacks)."""
    changed = total = along = delta_sq = 0.0
    for w_new, w_old in zip(new, old):
        q_new, q_old = served(w_new), served(w_old)
        delta = w_new - w_old
        changed += jnp.sum(q_new != q_old)
        total += q_new.size
        along += jnp.sum((q_new - q_old) * delta)
        delta_sq += jnp.sum(jnp.square(delta))
    lost = jnp.where(delta_sq > 0, 1.0 - along / jnp.where(delta_sq > 0, delta_sq, 1.0), 0.0)
    return changed / total, lost  # the same weights: (0, 0)


@functools.partial(jax.jit, static_argnames=("quantization",))
def _metrics(new, old, first, quantization):
    """The bf16 stage always; the engine's whole quantizer when it is modelled (TRACKED_SCHEMES)."""
    bf16_changed, bf16_lost = _stage_metrics(served_bf16, new, old)
    out = {"sync/bf16_changed_frac": bf16_changed, "sync/bf16_update_lost_frac": bf16_lost}
    if quantization in TRACKED_SCHEMES:
        served = SERVED_WEIGHTS[quantization]
        changed, lost = (bf16_changed, bf16_lost) if quantization is None else _stage_metrics(served, new, old)
        out.update({"sync/quantized_changed_frac": changed, "sync/update_lost_frac": lost,
                    "sync/cumulative_update_lost_frac": _stage_metrics(served, new, first)[1]})
    return out


def _subset(kernels, stride: int):
    """The tracked channels, stacked by shape: [n, (E,) in, C/stride] per distinct kernel shape (SmolLM2's 210
    projections are 4 stacks), so the jitted metrics are a few large ops (its compile: 15-17 s for one op per
    matrix). Always a copy: the learner's step donates the params' buffers."""
    by_shape: dict[tuple, list] = {}
    for k in kernels:
        by_shape.setdefault(tuple(k.shape), []).append(k)
    return [jnp.stack([jnp.asarray(k[..., ::stride], jnp.float32) for k in group]) for group in by_shape.values()]


class UpdateSurvival:
    """`measure(weights)` at each push: {} the first time, then the metrics of the module doc. `weights` is
    `learner_weights(model, optimizer)` (or the model itself when the params are what the optimizer steps).

    `reference(weights)` sets W_0 of the cumulative metric; train.py calls it on the starting checkpoint
    before a resume restores the run's weights, so a resumed run reports what an uninterrupted one does.
    Without it W_0 is the first measured push. `serving(quantization)` names the engine's scheme once the
    engine has started (before it: None, a bf16 engine)."""

    def __init__(self, model_config, quantization: str | None = None, *, channel_stride: int = 16):
        if channel_stride < 1:
            raise ValueError(f"update_survival_stride={channel_stride} must be >= 1; disable the tracker with "
                             "rl.DiagnosticsConfig.disabled = ['update_survival']")
        self.paths = projection_paths(model_config)
        self.stride = channel_stride
        self._previous = self._first = None
        self.serving(quantization)

    def serving(self, quantization: str | None) -> None:
        """The engine's reported `quantization`; unmodelled schemes get the bf16 stage only (`note` says so)."""
        self.quantization = quantization if quantization in TRACKED_SCHEMES else "unmodelled"
        self.note = (None if quantization in TRACKED_SCHEMES else
                     f"[train] sync/quantized_*: quantization {quantization!r} is not modelled "
                     f"(tracked: {', '.join(str(s) for s in TRACKED_SCHEMES)}); the metrics are its bf16 stage")

    def _tracked(self, weights):
        return _subset([get_param(weights, p)[...] for p in self.paths], self.stride)

    def reference(self, weights) -> None:
        self._first = self._tracked(weights)

    def measure(self, weights) -> dict[str, float]:
        current = self._tracked(weights)
        previous, self._previous = self._previous, current
        if self._first is None:
            self._first = current
        if previous is None:
            return {}
        return {k: float(np.asarray(v)) for k, v in
                _metrics(current, previous, self._first, self.quantization).items()}
