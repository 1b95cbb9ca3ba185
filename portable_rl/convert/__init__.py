"""HF checkpoints <-> Flax NNX params, and Flax params -> torch tensors for rollout engines.

The only package that knows both JAX and torch: the JAX → HF bridge. Imports are lazy (PEP 562): a
process that only reads checkpoints does not pull in torch. The torch-only quantizers and the bucketing
helpers, which only engines use, live in `engines.quantize` / `engines.buckets`.
"""

import importlib

_EXPORTS = {
    "copy_tokenizer_files": "portable_rl.convert.hf",
    "load_hf_model": "portable_rl.convert.hf",
    "save_hf_model": "portable_rl.convert.hf",
    "param_mappings": "portable_rl.convert.mapping",
    "iter_hf_tensors": "portable_rl.convert.to_torch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'portable_rl.convert' has no attribute {name!r}")
