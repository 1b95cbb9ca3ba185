"""HF checkpoints <-> Flax NNX params, and Flax params -> torch tensors for rollout engines.

The only package that knows both JAX and torch. Imports are lazy (PEP 562): an engine process that only
needs the torch-side quantizer (`convert.quantize`) does not pull in JAX, and one that only reads
checkpoints does not pull in torch.
"""

import importlib

_EXPORTS = {
    "copy_tokenizer_files": "portable_rl.convert.hf",
    "load_hf_model": "portable_rl.convert.hf",
    "save_hf_model": "portable_rl.convert.hf",
    "param_mappings": "portable_rl.convert.mapping",
    "iter_hf_tensors": "portable_rl.convert.to_torch",
    "bucketed": "portable_rl.convert.to_torch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'portable_rl.convert' has no attribute {name!r}")
