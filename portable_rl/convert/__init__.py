"""HF checkpoints <-> Flax NNX params, and Flax params -> torch tensors for rollout engines.

The only package that knows both JAX and torch (torch is imported lazily, in `to_torch`).
"""

from portable_rl.convert.hf import copy_tokenizer_files, load_hf_model, save_hf_model
from portable_rl.convert.mapping import param_mappings

__all__ = ["copy_tokenizer_files", "load_hf_model", "param_mappings", "save_hf_model"]
