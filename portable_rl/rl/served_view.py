"""The model as the engine serves it, built inside a trace: the one served view of the mismatch split's scoring
(rl/mismatch_split.py) and of the matched-precision learner (`rl.PrecisionConfig.learner_precision = 'engine'`,
rl/learner.py).

The engine serves, for every decoder projection kernel W (q/k/v/o, gate/up/down) and every MoE expert's (the
stacked [E, in, out] arrays; per-channel scales never mix experts), Q(S(W)): the push's SmoothQuant
rescaling S when it carries factors (`convert.smoothing`; norms are rescaled too), then the engine's weight
quantizer Q (`learner_jax.quantize.SERVED_WEIGHTS`: its `quantization` → Q; None: the bf16 rounding of the push).
Embeddings, lm_head, norms, biases and MoE routers stay as the learner has them.

    straight_through=False   W ← Q(S(W))                                           (scoring; no gradient)
    straight_through=True    W ← S(W) + stop_gradient(Q(S(W)) − S(W))              (the learner's loss)

The straight-through form is written stop_gradient(Q) + (V − stop_gradient(V)) with V = S(W): the same gradient
(dW_served/dV = 1, so the masters get the gradient taken at the served weights) and a forward value of Q
exactly (V − V = 0), where V + (Q − V) could round away from Q.

Not emulated: the engine's activation quantization (W8A8) and its kernels.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from portable_rl.convert.hf import get_param
from portable_rl.convert.mapping import param_mappings
from portable_rl.convert.smoothing import Smoothing
from portable_rl.engines.quantize import is_quantized_weight
from portable_rl.learner_jax.quantize import SERVED_WEIGHTS


def projection_paths(model_config) -> list[tuple]:
    """NNX paths of the matrices engines quantize (`engines.quantize.is_quantized_weight`): the decoder
    projections (q/k/v/o, gate/up/down kernels [in, out]) and, in MoE layers, the stacked experts [E, in, out]
    (one path for all E experts; the routers are not among them)."""
    paths = [m.nnx_path for m in param_mappings(model_config) if is_quantized_weight(m.hf_name)]
    return list(dict.fromkeys(paths))


@functools.partial(jax.jit, static_argnames=("quantization",))
def quantized_kernels(kernels, quantization):
    """[Q(W) in W's dtype for W in `kernels`], Q = SERVED_WEIGHTS[quantization]."""
    quantize = SERVED_WEIGHTS[quantization]
    return [quantize(k).astype(k.dtype) for k in kernels]


def serve_as_engine(model, quantization: str | None, smoothing_factors=None, *, straight_through: bool = False):
    """Turns `model` (a copy inside a trace; changed in place) into the weights the engine serves (module doc)."""
    if smoothing_factors is not None:
        smoothing = Smoothing(smoothing_factors)
        for m in param_mappings(model.config):
            if m.hf_name in smoothing.transforms:
                param = get_param(model, m.nnx_path)
                param[...] = smoothing.apply(m.hf_name, param[...])
    params = [get_param(model, p) for p in projection_paths(model.config)]
    values = [p[...] for p in params]
    frozen = [jax.lax.stop_gradient(v) for v in values]
    for param, v, fv, q in zip(params, values, frozen, quantized_kernels(frozen, quantization)):
        param[...] = q + (v - fv) if straight_through else q


def served_view(model, quantization: str | None, smoothing_factors=None, *, straight_through: bool = False):
    """A copy of `model` (new Variables, the same arrays; `model` is not changed) served as the engine serves it
    (`serve_as_engine`). Inside a trace: the served kernels are temporaries of the program."""
    graphdef, state = nnx.split(model)
    view = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    serve_as_engine(view, quantization, smoothing_factors, straight_through=straight_through)
    return view
