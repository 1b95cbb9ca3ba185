"""SmoothQuant for INT8 W8A8 rollouts: move activation outliers into the weights before the engine quantizes.

A W8A8 engine quantizes each token's activation vector with one scale (its max |x| / 127), so a few
channels with large activations cost every other channel its precision. For a projection group that reads
the same input X [tokens, in] (q/k/v after the input norm, gate/up after the post-attention norm, down after
silu(gate)·up), one factor per input channel j

    s_j = max_t |X_tj|^α / max_{W in group, o} |W_oj|^(1−α)        (α = 0.5: SmoothQuant's default)

is divided out of the input and multiplied into the weights, exactly (in real arithmetic):

    norm gain g → g / s,              q/k/v (gate/up) kernels K [in, out] → diag(s) K
    up kernel U → U diag(1/s_down),   down kernel D → diag(s_down) D         (silu(gate)·up is linear in up)

so the engine computes the same function while its activations are flatter and its weights a little
less so. o_proj keeps its input (under GQA it mixes value heads; FlashRL leaves it too).

The factors are computed once, from the learner's forward on a few calibration prompts at the start of a
run (`calibrate`), and applied to every push (`convert.hf.export_arrays(smoothing=...)`): the learner's
own weights stay unsmoothed, and what the engine serves is always smooth(θ_k) quantized. FlashRL instead
reads fixed factors (and fixed weight scales) from an llm-compressor checkpoint; here the weight scales
follow every push.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from portable_rl.convert.hf import get_param
from portable_rl.convert.mapping import param_mappings

DEFAULT_ALPHA = 0.5
_CLAMP = (1e-5, 1e5)

# (HF name of the projection that reads the group's input, the group's projections, the norm or the
# projection whose output channels feed that input, how that producer is divided: "gain" or "columns")
GROUPS = (
    ("self_attn.q_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm", "gain"),
    ("mlp.gate_proj", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm", "gain"),
    ("mlp.down_proj", ("mlp.down_proj",), "mlp.up_proj", "columns"),
)


@dataclasses.dataclass(frozen=True)
class Smoothing:
    """SmoothQuant factors: {HF name of the projection that reads a group's input (`GROUPS`, e.g.
    "model.layers.3.self_attn.q_proj"): s [in]}, and how each pushed tensor is rescaled by them."""

    factors: dict

    @functools.cached_property
    def transforms(self) -> dict:
        """{HF name: [(s, axis, power)]}: value · s^power broadcast along `axis` of the NNX layout."""
        out: dict[str, list] = {}
        for reader, s in self.factors.items():
            prefix = reader[: -len(reader.split(".", 3)[-1])]           # "model.layers.{i}."
            _, members, producer, how = next(g for g in GROUPS if prefix + g[0] == reader)
            s = jnp.asarray(s, jnp.float32)
            for m in members:
                out.setdefault(prefix + m + ".weight", []).append((s, 0, +1))                 # rows × s
            out.setdefault(prefix + producer + ".weight", []).append((s, 0 if how == "gain" else 1, -1))
        return out

    def apply(self, hf_name: str, value):
        for factors, axis, power in self.transforms.get(hf_name, ()):
            shape = [1] * value.ndim
            shape[axis] = -1
            value = _rescale(value, factors.reshape(shape), power)
        return value

    def save(self, path: str) -> None:
        """To `path` (.npz), written to a temporary name and renamed: never half-written."""
        tmp = path + ".tmp.npz"
        np.savez(tmp, **{k: np.asarray(v) for k, v in self.factors.items()})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "Smoothing":
        with np.load(path) as f:
            return cls({k: f[k] for k in f.files})


@jax.jit
def _times(value, factors):
    return (value.astype(jnp.float32) * factors).astype(value.dtype)


@jax.jit
def _divide(value, factors):
    return (value.astype(jnp.float32) / factors).astype(value.dtype)


def _rescale(value, factors, power):
    return _times(value, factors) if power > 0 else _divide(value, factors)


def input_absmax(model, prompts) -> dict[str, np.ndarray]:
    """{HF name of each decoder projection: max |input| per input channel [in]} over every position of
    `prompts` (lists of token ids, each run alone: no padding enters the maxima). Eager, no remat."""
    from portable_rl.engines.quantize import is_quantized_projection  # the projections engines quantize

    names = {m.nnx_path[:-1]: m.hf_name.removesuffix(".weight") for m in param_mappings(model.config)
             if is_quantized_projection(m.hf_name)}
    modules = {path: get_param(model, path) for path in names}  # the Linear modules
    remat, model.remat = model.remat, "none"  # a remat layer runs on a split copy, which would drop the sown maxima
    maxima: dict[str, np.ndarray] = {}
    try:
        for module in modules.values():
            module.record_input_absmax = True
        forward = nnx.capture(model.hidden_states, nnx.Intermediate)
        for prompt in prompts:
            _, sown = forward(jnp.asarray([list(prompt)], jnp.int32))
            for path, variable in nnx.to_flat_state(sown):  # path: (*module path, "input_absmax")
                name, value = names[path[:-1]], np.asarray(jax.tree.leaves(variable.get_value())[0])
                maxima[name] = value if name not in maxima else np.maximum(maxima[name], value)
    finally:
        for module in modules.values():
            module.record_input_absmax = False
        model.remat = remat
    return maxima


def smoothing_factors(model, maxima: dict[str, np.ndarray], alpha: float = DEFAULT_ALPHA) -> Smoothing:
    """The `Smoothing` of the module doc from `input_absmax`'s maxima and the model's current weights."""

    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha={alpha}: use a value in [0, 1] (0.5 is SmoothQuant's default)")
    paths = {m.hf_name.removesuffix(".weight"): m.nnx_path for m in param_mappings(model.config)}
    factors = {}
    for i in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for reader, members, _, _ in GROUPS:
            act = jnp.asarray(maxima[prefix + reader], jnp.float32)                            # [in]
            weight = jnp.max(jnp.stack([jnp.max(jnp.abs(get_param(model, paths[prefix + m])[...].astype(jnp.float32)),
                                                axis=1) for m in members]), axis=0)             # [in]
            factors[prefix + reader] = np.asarray(
                jnp.where((act > 0) & (weight > 0), jnp.clip(act ** alpha / weight ** (1.0 - alpha), *_CLAMP), 1.0))
    return Smoothing(factors)


def calibrate(model, prompts, alpha: float = DEFAULT_ALPHA) -> Smoothing:
    """`smoothing_factors` from the learner's own forward on `prompts` (a few of the task's prompts)."""
    if not prompts:
        raise ValueError("SmoothQuant calibration needs at least one prompt")
    return smoothing_factors(model, input_absmax(model, prompts), alpha)
