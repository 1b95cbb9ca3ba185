"""Pack prompt + response token ids into right-padded `[B, T]` arrays.

Row i holds `prompt_i + response_i` followed by padding. Position t carries the logprob of token t
(given tokens < t), the same convention as `learner_jax.logprobs.sequence_logprobs`, so:

    input_ids[i, t]        = (prompt_i + response_i)[t]             for t < len_i, pad after
    attention_mask[i, t]   = 1                                      for t < len_i
    response_mask[i, t]    = 1                                      for p_i <= t < len_i with a finite logprob
    rollout_logprobs[i, t] = engine logprob of input_ids[i, t]      where response_mask is 1, else 0
    advantages[i, t]       = A_i * response_mask[i, t]

A response token whose engine logprob is NaN or ±inf is dropped from the loss (mask 0, logprob 0), so
nothing non-finite reaches JAX; `rl.rollout.collect_groups` counts them (`rollout/nonfinite_*`).

T is rounded up to a bucket (next power of two, at least `min_len`) so jit sees few shapes;
B is padded with all-zero rows up to a multiple of `row_multiple` (fixed mini-batch shapes).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def bucket_length(length: int, min_len: int = 16) -> int:
    """Smallest power of two >= max(length, min_len)."""
    t = max(length, min_len, 1)
    return 1 << (t - 1).bit_length()


def pack_rollouts(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                  response_logprobs: Sequence[Sequence[float]], advantages: Sequence[float], *,
                  pad_id: int = 0, min_len: int = 16, row_multiple: int = 1) -> dict[str, np.ndarray]:
    """Returns the arrays above plus `num_rows` (real rows before padding) as a python int."""
    n = len(prompt_ids)
    if not (n == len(response_ids) == len(response_logprobs) == len(advantages)):
        raise ValueError("prompt_ids, response_ids, response_logprobs and advantages must have the same length")
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    t = bucket_length(max(lengths, default=1), min_len)
    b = max(-(-n // row_multiple) * row_multiple, row_multiple)
    input_ids = np.full((b, t), pad_id, np.int32)                       # [B, T]
    attention_mask = np.zeros((b, t), np.int32)                          # [B, T]
    response_mask = np.zeros((b, t), np.float32)                         # [B, T]
    rollout_logprobs = np.zeros((b, t), np.float32)                      # [B, T]
    adv = np.zeros((b, t), np.float32)                                   # [B, T]
    for i, (p, r, lp, a) in enumerate(zip(prompt_ids, response_ids, response_logprobs, advantages)):
        if len(lp) != len(r):
            raise ValueError(f"row {i}: {len(r)} response tokens but {len(lp)} logprobs")
        lp_, ln = len(p), len(p) + len(r)
        logp = np.asarray(lp, np.float32)                                # [len(r)]
        finite = np.isfinite(logp)                                       # [len(r)]
        input_ids[i, :lp_] = p
        input_ids[i, lp_:ln] = r
        attention_mask[i, :ln] = 1
        response_mask[i, lp_:ln] = finite
        rollout_logprobs[i, lp_:ln] = np.where(finite, logp, 0.0)
        adv[i, lp_:ln] = np.where(finite, a, 0.0)
    return dict(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                rollout_logprobs=rollout_logprobs, advantages=adv, num_rows=n)


def split_rows(arrays: dict[str, np.ndarray], rows_per_split: int):
    """Yields dicts of array slices, `rows_per_split` rows each (B must be a multiple of it)."""
    b = next(v.shape[0] for v in arrays.values() if isinstance(v, np.ndarray))
    if b % rows_per_split:
        raise ValueError(f"batch of {b} rows is not a multiple of rows_per_split={rows_per_split}")
    for s in range(0, b, rows_per_split):
        yield {k: v[s:s + rows_per_split] for k, v in arrays.items() if isinstance(v, np.ndarray)}
