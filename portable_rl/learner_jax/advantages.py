"""Group-relative advantages (GRPO, Dr. GRPO) and DAPO's overlong reward shaping.

Rewards arrive prompt-major, `group_size` samples per prompt: `rewards[p * n + i]` is sample i of
prompt p (the order `EngineAdapter.generate` returns). With r the rewards of one group:

    GRPO       A_i = (r_i − mean(r)) / (std(r) + ε)      std unbiased (ddof=1), ε = 1e-6
    Dr. GRPO   A_i =  r_i − mean(r)                      (no std division: no difficulty bias)

DAPO overlong shaping (L_max = max_len, L_buf = buffer_len, f = penalty_factor, |y| = length):

    R_len(y) =  0                              if |y| ≤ L_max − L_buf
             = −f · (|y| − (L_max − L_buf)) / L_buf   if L_max − L_buf < |y| ≤ L_max
             = −f                              if |y| > L_max
It is added to the task reward before the advantages are computed.

Pure jnp functions (jit-able; numpy arrays are accepted), float32 out.
"""

from __future__ import annotations

import jax.numpy as jnp


def _grouped(rewards, group_size: int):
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be flat [num_prompts * group_size], got shape {rewards.shape}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
    return rewards.reshape(-1, group_size)  # [P, n]


def grpo_advantages(rewards, group_size: int, eps: float = 1e-6, normalize_std: bool = True):
    """GRPO advantages `[P * n]`: reward minus group mean, divided by (unbiased group std + ε)."""
    groups = _grouped(rewards, group_size)  # [P, n]
    centred = groups - groups.mean(axis=-1, keepdims=True)
    if normalize_std:
        centred = centred / (groups.std(axis=-1, ddof=1, keepdims=True) + eps)
    return centred.reshape(-1)


def dr_grpo_advantages(rewards, group_size: int):
    """Dr. GRPO advantages `[P * n]`: reward minus group mean, no std normalisation."""
    return grpo_advantages(rewards, group_size, normalize_std=False)


def overlong_reward_shaping(lengths, max_len: int, buffer_len: int, penalty_factor: float = 1.0):
    """DAPO soft overlong punishment `[N]` (≤ 0) for response lengths `[N]`; add it to the reward."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0 (it is subtracted), got {penalty_factor}")
    lengths = jnp.asarray(lengths, jnp.float32)
    excess = (lengths - (max_len - buffer_len)) / buffer_len  # 0 at the buffer start, 1 at max_len
    return -penalty_factor * jnp.clip(excess, 0.0, 1.0)
