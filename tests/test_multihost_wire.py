"""What crosses processes in a multi-host run (rl/multihost.py), checked in one process: the byte codec
round-trips dtypes, shapes and non-finite floats exactly, and every process builds the driver's batch from
the compact rollouts it broadcasts (`pytest -k multihost` selects these too)."""

import numpy as np
import pytest

from portable_rl.engines.base import Rollout
from portable_rl.rl.dapo import build_batch
from portable_rl.rl.dapo import dapo_config
from portable_rl.rl.multihost import Processes, decode, encode, groups_from_wire, groups_to_wire, wire_bytes
from portable_rl.rl.rollout import ScoredGroup


def _groups(rng, n_groups=3, n=4):
    groups = []
    for g in range(n_groups):
        prompt = rng.integers(3, 90, rng.integers(1, 7)).tolist()
        rollouts = []
        for i in range(n):
            length = int(rng.integers(0, 9))
            logprobs = (-rng.random(length) * 3).tolist()
            if g == 1 and i == 2 and length:
                logprobs[0] = float("nan")  # a broken engine token: masked by packing, must survive the wire
            rollouts.append(Rollout(prompt_index=g, prompt_token_ids=prompt,
                                    response_token_ids=rng.integers(3, 90, length).tolist(),
                                    response_logprobs=logprobs, finish_reason="length" if length == 8 else "stop"))
        groups.append(ScoredGroup(f"example {g}", rollouts, rng.integers(0, 2, n).astype(np.float32)))
    return groups


def test_multihost_codec_round_trips_exactly():
    tree = ({"ids": np.arange(12, dtype=np.int64).reshape(3, 4), "mask": np.array([True, False]),
             "empty": np.zeros((0, 5), np.float32), "n": 7, "name": "x", "none": None},
            {"reward/mean": np.float32(0.25), "nan": float("nan"), "inf": -float("inf"), "list": [1, 2.5]})
    back = decode(encode(tree))
    for key, x in tree[0].items():
        if isinstance(x, np.ndarray):
            assert back[0][key].dtype == x.dtype and back[0][key].shape == x.shape
            np.testing.assert_array_equal(back[0][key], x)
        else:
            assert back[0][key] == x
    assert back[1]["reward/mean"] == 0.25 and np.isnan(back[1]["nan"]) and back[1]["inf"] == -np.inf
    assert back[1]["list"] == [1, 2.5] and isinstance(back, tuple)
    with pytest.raises(TypeError, match="cannot broadcast a object"):
        encode({"x": object()})


def test_multihost_one_process_broadcast_is_the_identity():
    procs = Processes.current()
    assert procs.is_driver and not procs.multiple
    tree = {"a": np.ones(3)}
    assert procs.broadcast(tree) is tree and procs.any(True) and not procs.any(False)
    procs.barrier("nothing to wait for")


def test_multihost_wire_rollouts_build_the_drivers_batch():
    cfg = dapo_config(prompt_batch_size=4, mini_batch_size=2, n_samples=4, max_response_tokens=8, overlong_buffer=2)
    groups = _groups(np.random.default_rng(0))
    wire = decode(encode(groups_to_wire(groups)))  # through the bytes, as a follower receives it
    assert wire_bytes(wire) == sum(4 * len(r.prompt_token_ids) + 8 * len(r.response_token_ids) + 13
                                   for g in groups for r in g.rollouts) + 4 * len(groups)
    want, want_stats = build_batch(cfg, groups, pad_id=0)
    got, got_stats = build_batch(cfg, groups_from_wire(wire), pad_id=0)
    assert got_stats == want_stats and got.keys() == want.keys()
    for key, x in want.items():
        np.testing.assert_array_equal(got[key], x, err_msg=key)  # bit for bit, advantages included


def test_multihost_broadcast_buffers_come_in_few_sizes():
    """The per-step broadcast pads its buffer (>= 1 KiB, <= 12.5 % more), so a run compiles few shapes."""
    from portable_rl.rl.multihost import padded_size

    assert [padded_size(n) for n in (0, 1, 1024, 1025, 3000)] == [1024, 1024, 1024, 1152, 3072]
    for n in range(1025, 3_000_000, 997):
        assert n <= padded_size(n) <= 1.125 * n
    assert len({padded_size(n) for n in range(2**20 + 1, 2**21 + 1, 101)}) == 8  # per octave
