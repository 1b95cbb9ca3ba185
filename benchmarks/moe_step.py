"""The learner's MoE update step against a dense model with the same active parameters, on CPU.

Two random models of the same attention, embedding and depth (Qwen3 layout, float32 params, bf16 compute by
default), differing only in the MLP of every layer:

    moe     qwen3_moe: E experts of width F, top-K routed (router D·E)          active MLP params 3·D·F·K + D·E
    dense   qwen3:     one SwiGLU of width I = K·F                               active MLP params 3·D·K·F

so a token runs through the same number of MLP weights (the router's D·E aside); the MoE model holds E / K
times the MLP weights. Each model takes the learner's real update (`learner_jax.step.make_train_step` with
the RL loss of `rl.learner.make_loss_fn`, AdamW) on the same packed batch ([rows, seq] tokens, one segment per
row, half of it response). Timing: one process, the two jitted steps alternated (dense, moe, dense, moe, ...)
after a warm-up each, so background load on a shared box hits both alike; the ratio of the medians is the
number to read (`moe_over_dense`). The 1-minute load average before and after is recorded.

    python -m benchmarks.moe_step [--experts 16 --top_k 2 --moe_width 256 --hidden 256 --layers 4]
                                  [--rows 4 --seq 512] [--reps 7] [--compute_dtype bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top_k", type=int, default=2)
    p.add_argument("--moe_width", type=int, default=256, help="each expert's SwiGLU width F")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--compute_dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not 0 < args.top_k <= args.experts:
        p.error(f"--top_k={args.top_k} must be in 1..--experts={args.experts}")
    return args


def configs(args):
    from portable_rl.learner_jax.config import ModelConfig

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                  qk_norm=True)
    moe = ModelConfig(family="qwen3_moe", intermediate_size=args.top_k * args.moe_width, num_experts=args.experts,
                      num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_width, norm_topk_prob=True,
                      **common)
    dense = ModelConfig(family="qwen3", intermediate_size=args.top_k * args.moe_width, **common)
    return {"dense": dense, "moe": moe}


def make_batch(rows: int, seq: int, vocab: int, seed: int = 0) -> dict:
    """One sequence per row (segment 1), the second half its response, random advantages."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    response = (np.arange(seq)[None, :] >= seq // 2).astype(np.float32).repeat(rows, 0)
    ones = np.ones((rows, seq), np.float32)
    batch = {"input_ids": rng.integers(1, vocab, (rows, seq)), "segment_ids": ones.astype(np.int32),
             "positions": np.arange(seq, dtype=np.int32)[None].repeat(rows, 0), "response_mask": response,
             "keep_mask": ones, "old_logprobs": -np.log(vocab) * response, "rollout_logprobs": -np.log(vocab) * response,
             "advantages": rng.standard_normal((rows, 1)).astype(np.float32) * ones, "tis_weights": ones,
             "token_weights": response / response.sum()}
    return {k: jnp.asarray(v, jnp.int32 if k in ("input_ids", "segment_ids", "positions") else jnp.float32)
            for k, v in batch.items()}


def active_and_total(config, model) -> tuple[int, int]:
    """(parameters one token runs through, all parameters) of `model`."""
    import jax
    from flax import nnx

    total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if not config.is_moe:
        return total, total
    idle = 3 * config.hidden_size * config.moe_intermediate_size * (config.num_experts - config.num_experts_per_tok)
    return total - config.num_hidden_layers * idle, total


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl.learner_jax import step as step_lib
    from portable_rl.learner_jax.model import Transformer
    from portable_rl.learner_jax.optim import make_optimizer
    from portable_rl.planning.learner_peak import OPTIM, rl_cfg
    from portable_rl.rl.learner import make_loss_fn

    load_before = os.getloadavg()[0]
    batch = make_batch(args.rows, args.seq, args.vocab)
    sides = {}
    for name, config in configs(args).items():
        model = Transformer(config, param_dtype=jnp.float32, compute_dtype=jnp.dtype(args.compute_dtype),
                            rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, make_optimizer(**OPTIM), wrt=nnx.Param)
        train_step = step_lib.make_train_step(make_loss_fn(rl_cfg().loss, 1.0, None))
        start = time.perf_counter()
        jax.block_until_ready(train_step(model, optimizer, batch))   # compile + first step
        active, total = active_and_total(config, model)
        sides[name] = dict(step=train_step, model=model, optimizer=optimizer, times=[], active_params=active,
                           total_params=total, first_step_s=time.perf_counter() - start)
    for _ in range(args.reps):
        for name, side in sides.items():  # dense, moe, dense, moe, ...
            start = time.perf_counter()
            jax.block_until_ready(side["step"](side["model"], side["optimizer"], batch))
            side["times"].append(time.perf_counter() - start)
    medians = {name: statistics.median(side["times"]) for name, side in sides.items()}
    result = {
        "args": vars(args), "tokens_per_step": args.rows * args.seq, "jax": jax.__version__,
        "cpu_count": os.cpu_count(), "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0],
        **{name: {"median_step_s": medians[name], "step_s": side["times"], "first_step_s": side["first_step_s"],
                  "active_params": side["active_params"], "total_params": side["total_params"]}
           for name, side in sides.items()},
        "moe_over_dense": medians["moe"] / medians["dense"],
    }
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        for name in sides:
            r = result[name]
            print(f"{name:5s} active {r['active_params'] / 1e6:.2f} M / total {r['total_params'] / 1e6:.2f} M params: "
                  f"median step {r['median_step_s'] * 1e3:.1f} ms over {args.reps} reps ({result['tokens_per_step']} "
                  "tokens)")
        print(f"moe / dense step time: {result['moe_over_dense']:.2f} (load {load_before:.1f} -> "
              f"{result['load_1min_after']:.1f})")


if __name__ == "__main__":
    main()
