"""The cost of routing replay in the learner: one learner step on the same batch with and without the engine's
routed experts (rl.PrecisionConfig.routing = 'replay' vs 'own'), and what `compare_routing` adds.

A tiny random Qwen3-MoE (`--size` preset, `--experts` experts, top-`--top-k`) learner in float32, one batch of
`--groups` prompts × `--samples` answers (prompt `--prompt-tokens`, answers uniform in [r/2, 3r/2] of
`--response-tokens`), `dapo.build_batch` as the loop builds it, packed micro-batches. Each arm's step is
build_batch + `prepare` + `update` (the batch as the loop gathers it, old logprobs, the optimizer update):

    own      rollouts without routing, routing='own'
    replay   the same rollouts with random routed experts [len - 1, S, K] uint8, routing='replay',
             compare_routing=False: the gather into the batch, into every micro-batch, and the forced experts
    compare  replay with compare_routing=True: + one forward-only pass under the learner's own routing

Reported: the median seconds of each arm (arms alternated after one warm-up call each, `--reps` times), the
replay share = (replay − own) / own (target < 2 %), the compare share = (compare − replay) / replay, and the host
time of gathering the routing alone (build_batch's routing view + its per-micro-batch layout copies).

    python -m benchmarks.routing_replay [--size small] [--groups 8] [--samples 8] [--response-tokens 64]
                                        [--reps 5] [--json docs/data/moe_replay/replay_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def rollouts(args, num_layers: int):
    import numpy as np

    from portable_rl.engines.base import Rollout
    from portable_rl.rl.rollout import ScoredGroup

    rng = np.random.default_rng(0)
    groups = []
    for g in range(args.groups):
        prompt = rng.integers(1, 100, args.prompt_tokens).tolist()
        rolls = []
        for _ in range(args.samples):
            n = int(rng.integers(args.response_tokens // 2, 3 * args.response_tokens // 2 + 1))
            rows = len(prompt) + n - 1
            routed = np.argsort(rng.random((rows, num_layers, args.experts)), -1)[..., :args.top_k].astype(np.uint8)
            rolls.append(Rollout(g, prompt, rng.integers(1, 100, n).tolist(), (-2.0 + 0.3 * rng.standard_normal(n)).tolist(),
                                 "length", routed_experts=routed))
        groups.append(ScoredGroup(None, rolls, rng.integers(0, 2, args.samples).astype(np.float32)))
    return groups


def strip_routing(groups):
    import dataclasses

    return [dataclasses.replace(g, rollouts=[dataclasses.replace(r, routed_experts=None) for r in g.rollouts])
            for g in groups]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)

    import jax.numpy as jnp
    import optax
    from flax import nnx

    from portable_rl import tis
    from portable_rl.convert import load_hf_model
    from portable_rl.learner_jax.memory import MemoryConfig
    from portable_rl.rl import batching
    from portable_rl.rl.dapo import build_batch
    from portable_rl.rl.learner import Learner
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint
    from portable_rl.rl.dapo import dapo_config

    cfg = dapo_config(prompt_batch_size=args.groups, mini_batch_size=max(args.groups // 2, 1), n_samples=args.samples,
                      max_response_tokens=2 * args.response_tokens, overlong_buffer=0, old_logprobs_from_update=False)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(os.path.join(tmp, "moe"), "qwen3_moe", size=args.size, dtype="float32",
                                    num_experts=args.experts, num_experts_per_tok=args.top_k,
                                    max_positions=4 * (args.prompt_tokens + 2 * args.response_tokens))
        models = {}

        def learner(routing, compare):
            model, config = load_hf_model(ckpt, param_dtype=jnp.float32, compute_dtype=jnp.float32)
            models["config"] = config
            return Learner(model, nnx.Optimizer(model, optax.adamw(1e-6), wrt=nnx.Param), cfg,
                           tis.RolloutCorrectionConfig(mode="token", clip=2.0),
                           memory=MemoryConfig(pack_sequences=True), routing=routing, compare_routing=compare)

        arms = {"own": learner("own", False), "replay": learner("replay", False), "compare": learner("replay", True)}
        routed = rollouts(args, sum(models["config"].is_sparse_layer(i)
                                    for i in range(models["config"].num_hidden_layers)))
        plain = strip_routing(routed)

        def step(name):
            t0 = time.perf_counter()
            batch, _ = build_batch(cfg, plain if name == "own" else routed, 0)
            arms[name].update(arms[name].prepare(batch))
            return time.perf_counter() - t0

        rolls = [r for g in routed for r in g.rollouts]
        columns = ([r.prompt_token_ids for r in rolls], [r.response_token_ids for r in rolls],
                   [r.response_logprobs for r in rolls], [0.0] * len(rolls))

        def gather_only():  # the routing's own host copies: its view in the batch, each micro-batch's rows of it
            t0 = time.perf_counter()
            batching.pack_rollouts(*columns, row_multiple=cfg.rows_per_minibatch)
            t1 = time.perf_counter()
            view = batching.pack_rollouts(*columns, row_multiple=cfg.rows_per_minibatch,
                                          routed_experts=[r.routed_experts for r in rolls])
            for mini in arms["replay"].micro_layouts(view):
                for layout in mini:
                    layout.to_rows(view["routed_experts"], fill=-1)
            return (time.perf_counter() - t1) - (t1 - t0)

        for name in arms:  # compile
            step(name)
        times = {name: [] for name in arms}
        gathers = []
        for _ in range(args.reps):
            for name in arms:
                times[name].append(step(name))
            gathers.append(gather_only())
    med = {name: statistics.median(t) for name, t in times.items()}
    batch, _ = build_batch(cfg, routed, 0)
    result = {
        "benchmark": "routing_replay", "args": vars(args),
        "batch_shape": list(batch["routed_experts"].shape), "sequences": args.groups * args.samples,
        "seconds": {name: round(v, 4) for name, v in med.items()}, "raw_seconds": times,
        "gather_seconds": round(statistics.median(gathers), 5),
        "replay_share": (med["replay"] - med["own"]) / med["own"],
        "gather_share": statistics.median(gathers) / med["own"],
        "compare_share": (med["compare"] - med["replay"]) / med["replay"],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "raw_seconds"}, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
