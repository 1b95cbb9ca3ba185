"""A weight push across a process boundary through one POSIX shared-memory segment: no disk, no pickled bytes.

Used by the vLLM adapter when vLLM's workers live in other processes (tensor_parallel_size > 1, or the engine
core in its own process). Layout: the pushed tensors back to back in one segment under /dev/shm (RAM-backed,
never written to a disk), each at an offset aligned to ALIGN bytes:

    segment = [t_0 bytes | pad | t_1 bytes | pad | ...],   offset_i = align(offset_{i-1} + nbytes_{i-1})

What crosses the process boundary is only the manifest, plain data that vLLM's `collective_rpc` serializes in
a few dozen bytes per tensor: {"path": segment, "size": bytes, "tensors": [[hf_name, dtype, shape, offset], ...]}.

  writer (`shared_segment`, the trainer's process): one copy of each tensor into the segment (for a GPU tensor,
      the device-to-host copy); the segment's name is unlinked when the block exits, after every worker returned.
  reader (`shared_tensors`, each vLLM worker): maps the segment (MAP_SHARED) and views its bytes as tensors, no
      copy; vLLM's weight loaders copy from those views into the served parameters (a tensor-parallel worker
      reads only its shard). The mapping belongs to the views' storage: it is unmapped when the last view dies,
      so a view kept longer stays valid and the memory is freed only then.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from multiprocessing.shared_memory import SharedMemory
from typing import Iterator, Sequence

import torch

from portable_rl.errors import ConfigError

ALIGN = 64  # bytes: a cache line, and a multiple of every dtype's size, so each view is aligned
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory (shm_open names)


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _mapped(path: str, size: int) -> torch.Tensor:
    """The segment as one uint8 tensor over a shared mapping that lives as long as the tensor's storage."""
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def _views(buffer: torch.Tensor, entries: Sequence) -> list[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) views of `buffer` (uint8, the whole segment) at the manifest's entries."""
    views = []
    for name, dtype, shape, offset in entries:
        dtype = getattr(torch, dtype)
        size = torch.Size(shape).numel() * dtype.itemsize
        views.append((name, buffer[offset:offset + size].view(dtype).view(shape)))
    return views


@contextmanager
def shared_segment(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Iterator[dict]:
    """Copies `named_tensors` into a new shared-memory segment and yields its manifest; unlinks it on exit."""
    if not os.path.isdir(SHM_DIR):
        raise ConfigError(f"a push into a multi-process vLLM engine goes through POSIX shared memory in {SHM_DIR}, "
                          "which this system lacks (Linux only); start the engine in-process with one worker")
    entries, end = [], 0
    for name, tensor in named_tensors:
        offset = _align(end)
        entries.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset])
        end = offset + tensor.numel() * tensor.element_size()
    size = max(end, 1)
    stat = os.statvfs(SHM_DIR)
    if size > stat.f_bavail * stat.f_frsize:  # tmpfs allocates on write: past its limit the copy would SIGBUS
        raise ConfigError(f"a push into a multi-process vLLM engine needs {size / 2**30:.2f} GiB in {SHM_DIR}, "
                          f"which has {stat.f_bavail * stat.f_frsize / 2**30:.2f} GiB free; enlarge it (docker: "
                          "--shm-size or --ipc=host) or start the engine in-process with tensor_parallel_size=1")
    segment = SharedMemory(create=True, size=size)  # a unique name, sized, tracked for cleanup on a crash
    segment.close()  # its own mapping is not needed: the tensors below map the segment themselves
    try:
        path = os.path.join(SHM_DIR, segment.name.lstrip("/"))
        for (_, view), (_, tensor) in zip(_views(_mapped(path, size), entries), named_tensors):
            view.copy_(tensor)  # any layout, any device: the segment holds it contiguous, on the host
        yield {"path": path, "size": size, "tensors": entries}
    finally:
        segment.unlink()  # the memory itself goes with the last mapping


def shared_tensors(manifest: dict) -> list[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) views of the manifest's segment, in another process; no copy."""
    return _views(_mapped(manifest["path"], manifest["size"]), manifest["tensors"])
