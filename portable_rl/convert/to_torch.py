"""Flax params -> (HF name, torch.Tensor) pairs for rollout engines, lazily, one parameter at a time.

Each parameter is cast on the JAX side only if its dtype differs from the export dtype, then handed to
torch with DLPack: no host copy, the torch tensor shares the JAX buffer (same device, same data pointer)
and keeps it alive. Linear weights are stored [in, out] in NNX and [out, in] in HF: the transpose is a
torch *view* (`tensor.T`), not a copy; engines' weight loaders copy from strided sources anyway, so with
bf16 learner params the whole conversion moves no bytes (docs/experiments/cpu_rollouts.md, "Weight sync").
The values are exactly what `convert.hf.save_hf_model` writes for the same dtype.

Memory: `iter_hf_tensors` materialises one tensor at a time. The push is that flat iterator
(engines/base.py, "Push"): each engine buckets it for its own transport (`engines.buckets`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from portable_rl.convert.hf import export_arrays
from portable_rl.learner_jax.config import ModelConfig



def iter_hf_tensors(model, config: ModelConfig, *, dtype: str = "bfloat16", quantization: str | None = None,
                    smoothing=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, torch tensor in HF shape and `dtype`), one parameter at a time; with
    `quantization="int8_per_channel"` the projections as int8 + `weight_scale`, smoothed first with
    `smoothing` (`convert.hf.export_arrays`).

    Transposed weights are non-contiguous views; call `.contiguous()` if a consumer needs packed memory.
    """
    for name, array, transpose in export_arrays(model, config, dtype=dtype, quantization=quantization,
                                                   smoothing=smoothing):
        tensor = jax_to_torch(array)
        yield name, (tensor.T if transpose else tensor)


def jax_to_torch(array) -> torch.Tensor:
    """Zero-copy view of a JAX array as a torch tensor (DLPack); the tensor keeps the buffer alive.

    Do not donate `array` to a jitted function afterwards: that would free memory torch still reads.
    """
    return torch.from_dlpack(array)
