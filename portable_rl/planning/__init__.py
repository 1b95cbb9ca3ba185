"""Dry-run planning: will a run fit its GPUs, before anything starts (`python -m portable_rl.plan`).

  learner_peak   the learner's per-device peak from XLA's compile of the real update on abstract shapes
  engine         the rollout engine's weights, KV cache and activation reserve from config.json's dimensions
  gpus           the accelerators the planner knows by name, with their memory
"""
