"""Group (name, tensor) pairs into buckets of bounded byte size, lazily; optionally never splitting a group.

Pure Python (no JAX, no torch import): the learner side (`convert.to_torch`) and engine adapters that
re-bucket for their own transport (`engines.sglang_adapter`) share it.

Fused groups. An engine that stores q/k/v as one `qkv_proj` matrix (and gate/up as `gate_up_proj`) may
need every part of it in the same load call: SGLang 0.5.23's flash_rl reload with per-tensor FP8 refuses a
partial update, and inside the engine that refusal kills the process. `fused_group` names the destination
of each HF name, and `bucketed_groups` keeps each destination's pairs in one bucket:

    model.layers.3.self_attn.{q,k,v}_proj.weight   →  model.layers.3.self_attn.qkv_proj.weight
    model.layers.3.mlp.{gate,up}_proj.weight       →  model.layers.3.mlp.gate_up_proj.weight
    anything else (and its own `_scale_inv`)        →  itself
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any  # a torch.Tensor (anything with numel() and element_size())

_FUSED_PARTS = re.compile(r"\.(?:(q|k|v)_proj|(gate|up)_proj)\.(weight|bias)(_scale_inv)?$")


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucketed(pairs: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Groups consecutive pairs into lists of at most `bucket_bytes` (a larger tensor gets its own list)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket, size = [], 0
    for name, tensor in pairs:
        nbytes = _nbytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def fused_group(name: str) -> str:
    """The fused engine parameter an HF name loads into (module doc); the name itself if it is not fused."""
    m = _FUSED_PARTS.search(name)
    if m is None:
        return name
    fused = "qkv_proj" if m.group(1) else "gate_up_proj"
    return f"{name[:m.start()]}.{fused}.{m.group(3)}{m.group(4) or ''}"


def bucketed_groups(pairs: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Like `bucketed`, but all pairs of one `fused_group` land in the same bucket.

    Reads all of `pairs` first (only references: nothing is copied); groups keep the order of their first
    member. A group larger than `bucket_bytes` gets a bucket of its own.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    groups: dict[str, list[tuple[str, Any]]] = {}
    for name, tensor in pairs:
        groups.setdefault(fused_group(name), []).append((name, tensor))
    bucket, size = [], 0
    for group in groups.values():
        nbytes = sum(_nbytes(t) for _, t in group)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(group)
        size += nbytes
    if bucket:
        yield bucket
