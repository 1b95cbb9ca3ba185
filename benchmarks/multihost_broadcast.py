"""Cost of the driver's per-step broadcast (rl/multihost.py) between JAX processes, by payload size.

    python -m portable_rl.launch --num_processes 2 --devices_per_process 4 \
        --module benchmarks.multihost_broadcast -- --sizes 1e3,1e5,1e6,1e7,3.5e7 --reps 5

(from the repository root). Every process times `Processes.broadcast` of a dict of one uint8 array of each
size (the same call the training loop makes: length, then bytes, through `broadcast_one_to_all`), after one
warm-up call per size (the jitted sum compiles once per shape); process 0 prints one JSON line per size with
the median seconds and MB/s. 3.5e7 bytes is about the Qwen3-8B recipe's step (512 kept sequences with ~8k
response tokens each, `groups_to_wire`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main():
    from portable_rl.launch import initialize_from_environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e3,1e5,1e6,1e7", help="payload bytes, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    initialize_from_environment()
    from portable_rl.rl.multihost import Processes

    procs = Processes.current()
    for size in (int(float(s)) for s in args.sizes.split(",")):
        payload = {"x": np.full(size, 7, np.uint8)} if procs.is_driver else None
        procs.broadcast(payload)  # warm-up: compiles the jitted sum for this shape
        seconds = []
        for _ in range(args.reps):
            procs.barrier(f"broadcast {size}")  # start together: time the transfer, not a late arrival
            t0 = time.perf_counter()
            out = procs.broadcast(payload)
            seconds.append(time.perf_counter() - t0)
        assert out["x"].shape == (size,) and int(out["x"][-1]) == 7
        if procs.is_driver:
            median = statistics.median(seconds)
            print(json.dumps({"processes": procs.count, "bytes": size, "median_s": round(median, 5),
                              "min_s": round(min(seconds), 5), "MB_per_s": round(size / median / 1e6, 1)}),
                  flush=True)


if __name__ == "__main__":
    main()
