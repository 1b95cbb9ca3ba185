"""portable_rl: RL for LLMs with a JAX/Flax NNX learner and torch rollout engines (vLLM, SGLang).

Quantized (FP8) rollouts are corrected with truncated importance sampling (`portable_rl.tis`).
Module boundaries (see docs/architecture.md): `learner_jax`, `tis`, `tasks` never import torch;
`engines` never imports JAX; `convert` is the only package that knows both worlds.
"""

__version__ = "0.1.0"
