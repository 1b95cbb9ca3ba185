"""Group (name, tensor) pairs into buckets of bounded byte size, lazily.

Pure Python (no JAX, no torch import): the learner side (`convert.to_torch`) and engine adapters that
re-bucket for their own transport (`engines.sglang_adapter`) share it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any  # a torch.Tensor (anything with numel() and element_size())


def bucketed(pairs: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Groups consecutive pairs into lists of at most `bucket_bytes` (a larger tensor gets its own list)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket, size = [], 0
    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
