"""The shared-memory transport of a multi-process vLLM push (engines/shared_weights.py), across a real process.

A spawned process (as vLLM spawns its workers) maps the segment from the manifest alone and returns what it
read: every dtype a push carries, strided views and 0-d tensors arrive bit for bit, and the segment's name is
gone once the writer's block exits. No vLLM needed.
"""

import multiprocessing
import os

import torch

from portable_rl.engines.shared_weights import ALIGN, shared_segment, shared_tensors


def read_in_other_process(manifest):
    """Runs in the spawned process: copies of the views (tensors pickled back to the test)."""
    return [(name, t.clone()) for name, t in shared_tensors(manifest)]


def as_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_segment_carries_every_tensor_bit_for_bit_to_another_process():
    g = torch.Generator().manual_seed(0)
    pairs = [("bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
             ("f32_transposed_view", torch.randn(6, 10, generator=g).T),  # learner DLPack views are often strided
             ("int8", torch.randint(-128, 127, (7,), generator=g, dtype=torch.int8)),
             ("fp8", torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn)),
             ("scale_0d", torch.tensor(0.25)),
             ("empty", torch.zeros(0, 3))]
    with shared_segment(pairs) as manifest:
        assert os.path.exists(manifest["path"]) and manifest["path"].startswith("/dev/shm/")
        assert all(offset % ALIGN == 0 for *_, offset in manifest["tensors"])
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            received = pool.apply(read_in_other_process, (manifest,))
    assert not os.path.exists(manifest["path"])  # unlinked by the writer
    assert [n for n, _ in received] == [n for n, _ in pairs]
    for (name, sent), (_, got) in zip(pairs, received):
        assert got.dtype == sent.dtype and got.shape == sent.shape, name
        assert torch.equal(as_bytes(got), as_bytes(sent)), name


def test_a_view_kept_past_the_push_stays_valid():
    """The mapping lives with the views' storage, so a reader that keeps one never reads freed memory."""
    weight = torch.arange(1000, dtype=torch.float32)
    with shared_segment([("w", weight)]) as manifest:
        ((_, kept),) = shared_tensors(manifest)
    assert not os.path.exists(manifest["path"])
    assert torch.equal(kept, weight)
