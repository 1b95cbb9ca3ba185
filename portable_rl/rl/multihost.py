"""Several JAX processes, one program: the collectives that keep the learner's processes in step.

A multi-host learner (a TPU slice, several GPU nodes, or `python -m portable_rl.launch` on one box) runs
the same program on every process; each addresses only its own devices of the mesh. Only process 0, the
*driver*, talks to the engines, so what it learns from them must reach the others:

    driver (process 0)                                     every process, the driver too
    ──────────────────                                     ─────────────────────────────
    task draws, engine.generate, rewards, advantages  ──►  broadcast(batch, step metrics)   one copy of the bytes
                                                           the same sharded learner step (GSPMD collectives)
    hands the gathered tensors to torch, engine reload ◄── weight export: one all-gather per parameter
    engine samples the probe batch                    ──►  broadcast(probe tokens) → learner.logprobs
    held-out eval, metrics.jsonl, TensorBoard, plots
                                                           any(stop requested): one int per process
                                                           checkpoint: each process writes its shards,
                                                           the driver writes COMMITTED after a barrier

With one process every method returns its input and runs no collective, so the single-process run is
unchanged. With several, every process must make the same calls in the same order (they are collectives).

`broadcast` sends a tree of dicts holding numpy arrays and JSON scalars as one byte buffer: a header
(names, dtypes, shapes, scalars; JSON) and the arrays' raw bytes, so dtypes survive exactly (JAX without
x64 would turn int64 into int32) and the whole step is two collectives (the length, then the bytes).

What a step broadcasts is the kept rollouts in their compact form (`groups_to_wire`: the token ids and
logprobs of every prompt and response, concatenated, and the rewards), 4·|prompt| + 8·|response| bytes
per sequence (multi-turn trajectories: 5 more per response token, their mask and turn indices); every process
then builds the same padded batch and advantages from them (pure numpy,
`dapo.build_batch`). Broadcasting the padded batch instead would send 28 bytes per token slot of
[rows, longest sequence] (e.g. 0.47 GB for the Qwen3-8B recipe's 512 × 32 768 view, against ~35 MB).
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np

BARRIER_TIMEOUT_S = 3600  # a barrier may wait for the driver's engine start or warm start
_barriers = 0


@dataclasses.dataclass(frozen=True)
class Processes:
    """This process's place among the learner's JAX processes (`jax.process_index()` / `process_count()`)."""
    index: int = 0
    count: int = 1

    @classmethod
    def current(cls) -> "Processes":
        return cls(jax.process_index(), jax.process_count())

    @property
    def is_driver(self) -> bool:
        """Process 0: the one that owns the engines, the task draws and the run directory's logs."""
        return self.index == 0

    @property
    def multiple(self) -> bool:
        return self.count > 1

    def broadcast(self, tree=None):
        """The driver's `tree` (dicts / lists of numpy arrays, numbers, strings, None) on every process;
        other processes pass anything (ignored)."""
        if not self.multiple:
            return tree
        from jax.experimental import multihost_utils

        self.barrier("broadcast")  # the others may wait minutes (generation, eval): see `barrier`
        payload = encode(tree) if self.is_driver else b""
        if len(payload) >= 2**31:
            raise ValueError(f"broadcast of {len(payload)} bytes: more than 2 GiB in one step's batch")
        size = int(multihost_utils.broadcast_one_to_all(np.array([len(payload)], np.int32))[0])
        # Sent in a bucketed buffer: every new shape compiles a new jitted sum, and the batch's size
        # changes every step; with buckets a run compiles a few shapes once.
        buffer = np.zeros(padded_size(size), np.uint8)
        if self.is_driver:
            buffer[:size] = np.frombuffer(payload, np.uint8)
        return decode(np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:size].tobytes())

    def any(self, flag: bool) -> bool:
        """True on every process when `flag` is True on any one (e.g. a SIGTERM that reached one host)."""
        if not self.multiple:
            return bool(flag)
        from jax.experimental import multihost_utils

        self.barrier("any")  # the driver may arrive late (held-out eval)
        return bool(np.asarray(multihost_utils.process_allgather(np.int32(bool(flag)))).any())

    def barrier(self, name: str, timeout_s: int = BARRIER_TIMEOUT_S) -> None:
        """Waits until every process has reached the barrier `name` (the coordination service's barrier:
        no device collective, so it may wait long). Every process makes the same barrier calls in the same
        order, so a call counter gives each barrier the same unique id everywhere.

        Why before every broadcast: a process waiting inside a gloo collective for a late peer fails after
        30 s ("Gloo context initialization failed: DEADLINE_EXCEEDED", measured with jax 0.10.2), and the
        driver is routinely that late (engine start, generation, held-out eval); the coordination service's
        barrier waits up to `timeout_s`, then the collective starts with everyone there."""
        global _barriers
        if not self.multiple:
            return
        from jax._src import distributed

        _barriers += 1
        client = distributed.global_state.client
        if client is None:  # processes without jax.distributed (not expected): a device collective
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(name)
            return
        client.wait_at_barrier(f"{name} #{_barriers}", timeout_in_ms=timeout_s * 1000)


def padded_size(size: int, minimum: int = 1024) -> int:
    """The broadcast buffer for `size` bytes: at least `minimum`, else `size` rounded up to a sixteenth of
    its next power of two (8 sizes per octave, at most 12.5 % padding)."""
    if size <= minimum:
        return minimum
    step = max((1 << (size - 1).bit_length()) // 16, 1)
    return -(-size // step) * step


# --------------------------------------------------------------------------- rollouts on the wire
def groups_to_wire(groups) -> dict:
    """Kept `rollout.ScoredGroup`s → flat arrays: everything `dapo.build_batch` reads, nothing more."""
    rollouts = [r for g in groups for r in g.rollouts]
    wire = {
        "group_sizes": np.array([len(g.rollouts) for g in groups], np.int32),                  # [G]
        "rewards": np.concatenate([np.asarray(g.rewards, np.float32) for g in groups]),         # [N]
        "prompt_lengths": np.array([len(r.prompt_token_ids) for r in rollouts], np.int32),      # [N]
        "prompt_ids": np.array([t for r in rollouts for t in r.prompt_token_ids], np.int32),   # [Σ|p|]
        "response_lengths": np.array([len(r.response_token_ids) for r in rollouts], np.int32),  # [N]
        "response_ids": np.array([t for r in rollouts for t in r.response_token_ids], np.int32),  # [Σ|r|]
        # float32 is what packing keeps of them (batching.pack_rollouts), NaN / inf included
        "response_logprobs": np.array([x for r in rollouts for x in r.response_logprobs], np.float32),
        "truncated": np.array([r.finish_reason == "length" for r in rollouts], bool),           # [N]
    }
    if rollouts and rollouts[0].sampling_support is not None:  # truncated sampling: every rollout has one
        supports = [s for r in rollouts for s in r.sampling_support]
        wire["support_sizes"] = np.array([len(s) for s in supports], np.int32)                 # [Σ|r|]
        wire["support_ids"] = np.array([v for s in supports for v in s], np.int32)            # [Σ|S_t|]
    if any(r.response_mask is not None for r in rollouts):  # multi-turn trajectories: which tokens are the model's
        n = [len(r.response_token_ids) for r in rollouts]
        wire["response_mask"] = np.array([m for r, k in zip(rollouts, n) for m in (r.response_mask or [1] * k)],
                                         np.int8)                                              # [Σ|r|]
        wire["turn_index"] = np.array([m for r, k in zip(rollouts, n) for m in (r.turn_index or [0] * k)],
                                      np.int32)                                                # [Σ|r|]
    if rollouts and rollouts[0].routed_experts is not None:  # routing replay: every rollout has them
        wire["routed_experts"] = np.concatenate([r.routed_experts for r in rollouts])          # [Σ(|p|+|r|-1), S, K]
    return wire


def groups_from_wire(wire: dict) -> list:
    """Inverse of `groups_to_wire` (the groups' `example` is None: the batch does not need it)."""
    from portable_rl.engines.base import Rollout
    from portable_rl.rl.rollout import ScoredGroup

    p_end, r_end = np.cumsum(wire["prompt_lengths"]), np.cumsum(wire["response_lengths"])
    supports = None
    if "support_sizes" in wire:  # per response token, its sampling support
        s_end = np.cumsum(wire["support_sizes"])
        supports = [wire["support_ids"][e - n:e].tolist() for e, n in zip(s_end, wire["support_sizes"])]
    turns = "response_mask" in wire
    routed = None
    if "routed_experts" in wire:  # sequence i's rows: its length - 1
        counts = wire["prompt_lengths"] + wire["response_lengths"] - 1                          # [N]
        routed = np.split(wire["routed_experts"], np.cumsum(counts)[:-1])
    rollouts = [Rollout(prompt_index=i, prompt_token_ids=wire["prompt_ids"][p_end[i] - pl:p_end[i]].tolist(),
                        response_token_ids=wire["response_ids"][r_end[i] - rl:r_end[i]].tolist(),
                        response_logprobs=wire["response_logprobs"][r_end[i] - rl:r_end[i]].tolist(),
                        finish_reason="length" if wire["truncated"][i] else "stop",
                        sampling_support=None if supports is None else supports[r_end[i] - rl:r_end[i]],
                        response_mask=wire["response_mask"][r_end[i] - rl:r_end[i]].tolist() if turns else None,
                        turn_index=wire["turn_index"][r_end[i] - rl:r_end[i]].tolist() if turns else None,
                        routed_experts=None if routed is None else routed[i])
                for i, (pl, rl) in enumerate(zip(wire["prompt_lengths"], wire["response_lengths"]))]
    groups, start = [], 0
    for size in wire["group_sizes"].tolist():
        groups.append(ScoredGroup(None, rollouts[start:start + size], wire["rewards"][start:start + size]))
        start += size
    return groups


def wire_bytes(tree) -> int:
    """Bytes of the numpy arrays in `tree` (what `broadcast` sends, less its small JSON header)."""
    if isinstance(tree, dict):
        return sum(wire_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(wire_bytes(v) for v in tree)
    return tree.nbytes if isinstance(tree, np.ndarray) else 0


# ----------------------------------------------------------------------------------- the byte codec
def encode(tree) -> bytes:
    """`tree` → header length (8 bytes) + JSON header + the arrays' bytes, concatenated."""
    chunks, offset = [], 0

    def spec(x):
        nonlocal offset
        if isinstance(x, dict):
            return {"dict": [[str(k), spec(v)] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"list" if isinstance(x, list) else "tuple": [spec(v) for v in x]}
        if isinstance(x, (np.ndarray, jax.Array)):
            a = np.ascontiguousarray(np.asarray(x))
            chunks.append(a.tobytes())
            offset += a.nbytes
            return {"array": [a.dtype.str, list(a.shape), offset - a.nbytes]}
        if isinstance(x, np.generic):
            x = x.item()
        if x is None or isinstance(x, (bool, int, str)) or (isinstance(x, float) and math.isfinite(x)):
            return {"value": x}
        if isinstance(x, float):  # NaN / ±inf: JSON has no literal for them
            return {"float": repr(x)}
        raise TypeError(f"cannot broadcast a {type(x).__name__}; use numpy arrays, numbers, strings, dicts, lists")

    header = json.dumps(spec(tree)).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(chunks)


def decode(payload: bytes):
    """Inverse of `encode` (arrays are copies: writable, independent of the buffer)."""
    n = int.from_bytes(payload[:8], "little")
    header, data = json.loads(payload[8:8 + n]), memoryview(payload)[8 + n:]

    def build(s):
        (kind, v), = s.items()
        if kind == "dict":
            return {k: build(x) for k, x in v}
        if kind in ("list", "tuple"):
            items = [build(x) for x in v]
            return items if kind == "list" else tuple(items)
        if kind == "array":
            dtype, shape, start = np.dtype(v[0]), tuple(v[1]), v[2]
            count = math.prod(shape)
            return np.frombuffer(data, dtype, count, start).reshape(shape).copy()
        if kind == "float":
            return float(v)
        return v

    return build(header)
