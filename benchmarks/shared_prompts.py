"""Shared prompts in the learner: one SmolLM2 learner step with and without `share_prompts`, same batch.

A GRPO group is n answers to one prompt. Packed one sequence at a time, the learner runs the prompt's
p tokens n times; with `learner_jax.MemoryConfig.share_prompts` (learner_jax/memory.py) they share one copy and each answer
is a continuation segment that attends to it (learner_jax/attention.py):

    learner tokens per group    n · (p + r)    ->    p − 1 + n · (r + 1)

Both arms are the SmolLM2 recipe's learner (gin/recipes/smollm2_arith_fp8.gin: bf16 compute, fp32
masters, blockwise attention, remat 'full', 1024-token micro-batches, 512-token head chunks) on one batch
of `--groups` word-problem prompts (chat template on) × `--samples` random answers of ~`--response-tokens`
tokens (uniform in [r/2, 3r/2]), `dapo.build_batch` as the loop builds it. Checked first: the two arms'
old logprobs agree (bf16 compute: max |Δ| reported) and so do their first update's loss and grad norm.
Timing: `prepare` + `update` (old logprobs + the optimizer updates: the learner's whole share of a step),
arms alternated after one warm-up (compile) call each, median of `--reps`; ratio = unshared / shared.

    python -m benchmarks.shared_prompts [--model checkpoints/smollm2-135m-instruct] [--groups 8]
                                        [--samples 8] [--response-tokens 70] [--reps 2] [--json]
                                        [--compute-dtype float32]   (the arms agree to float32 rounding)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def build(args):
    import numpy as np

    from portable_rl.convert.gguf import convert_gguf
    from portable_rl.engines.base import Rollout
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.dapo import build_batch
    from portable_rl.rl.dapo import dapo_config
    from portable_rl.rl.rollout import ScoredGroup
    from portable_rl.tasks import WordProblemsTask

    if not os.path.exists(os.path.join(args.model, "config.json")):
        convert_gguf(args.model)
    codec = TextCodec(args.model, chat_template=True)
    cfg = dapo_config(prompt_batch_size=args.groups, mini_batch_size=max(args.groups // 2, 1), n_samples=args.samples,
                     max_response_tokens=2 * args.response_tokens, temperature=0.6, overlong_buffer=0)
    rng = np.random.default_rng(0)
    task = WordProblemsTask(min_ops=1, max_ops=2, max_start=10, max_amount=5)
    groups = []
    for example in task.train_batch(0, 0, args.groups):
        prompt = codec.encode_prompt(example.prompt)
        rollouts = []
        for _ in range(args.samples):
            n = int(rng.integers(args.response_tokens // 2, 3 * args.response_tokens // 2 + 1))
            response = rng.integers(100, 40000, n).tolist()
            rollouts.append(Rollout(0, prompt, response, (-2.0 + 0.3 * rng.standard_normal(n)).tolist(), "length"))
        groups.append(ScoredGroup(example, rollouts, rng.integers(0, 2, args.samples).astype(np.float32)))
    batch, _ = build_batch(cfg, groups, codec.pad_id)
    prompt_tokens = float(np.mean([len(g.rollouts[0].prompt_token_ids) for g in groups]))
    return cfg, batch, prompt_tokens


def learner(args, cfg, share: bool):
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl import tis
    from portable_rl.convert.hf import load_hf_model
    from portable_rl.learner_jax.memory import MemoryConfig
    from portable_rl.learner_jax.optim import make_optimizer
    from portable_rl.rl.learner import Learner

    memory = MemoryConfig(attention_impl="auto", pack_sequences=True, share_prompts=share,
                          max_tokens_per_micro_batch=1024, logprob_chunk_tokens=512, remat="full")
    model, _ = load_hf_model(args.model, param_dtype=jnp.float32, compute_dtype=jnp.dtype(args.compute_dtype),
                             attention_impl=memory.attention_impl, remat=memory.remat)
    tx = make_optimizer(learning_rate=1e-5, warmup_steps=0, weight_decay=0.0)
    return Learner(model, nnx.Optimizer(model, tx, wrt=nnx.Param), cfg,
                   tis.RolloutCorrectionConfig(mode="token", clip=2.0), memory=memory)


def alternated_step_seconds(learners: dict, batch: dict, reps: int) -> tuple[dict, dict]:
    """`prepare` + `update` of each learner on `batch`, the learners alternated `reps` times (load on a shared
    box hits them alike; compile first) → (median seconds per learner, all seconds; NaN medians for reps=0)."""
    times = {name: [] for name in learners}
    for _ in range(reps):
        for name, learner in learners.items():
            start = time.perf_counter()
            learner.update(learner.prepare(batch))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) if t else float("nan") for name, t in times.items()}, times


def add_batch_args(parser: argparse.ArgumentParser, *, groups: int, samples: int) -> None:
    """The model, the batch `build` makes (`--groups` prompts × `--samples` answers of ~`--response-tokens`), the
    timing repetitions and the learner's compute dtype: the options of every benchmark timing this learner."""
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--groups", type=int, default=groups)
    parser.add_argument("--samples", type=int, default=samples)
    parser.add_argument("--response-tokens", type=int, default=70)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--json", action="store_true")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(parser, groups=8, samples=8)  # --compute-dtype float32: the arms must agree to f32 rounding
    args = parser.parse_args()
    import numpy as np

    cfg, batch, prompt_tokens = build(args)
    arms = {"unshared": learner(args, cfg, False), "shared": learner(args, cfg, True)}
    first = {name: l.prepare(batch) for name, l in arms.items()}
    mask = batch["response_mask"] > 0
    old = {name: l.old_logprobs(batch) for name, l in arms.items()}  # every mini-batch's (prepare skips the first's)
    old_diff = float(np.abs(old["shared"] - old["unshared"])[mask].max())
    updates = {name: arms[name].update(first[name]) for name in arms}      # the warm-up (compile) call
    med, times = alternated_step_seconds(arms, batch, args.reps)
    result = {
        "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?"),
        "load_1min": os.getloadavg()[0], "groups": args.groups, "samples": args.samples,
        "mean_prompt_tokens": prompt_tokens, "response_tokens": args.response_tokens,
        "learner_tokens": {n: first[n].metrics["batch/learner_tokens"] for n in arms},
        "micro_batches": {n: first[n].metrics["batch/micro_batches"] for n in arms},
        "old_logprobs_max_abs_diff": old_diff,
        "first_update": {n: {k: updates[n][k] for k in ("train/loss", "train/grad_norm")} for n in arms},
        "seconds": med, "all_seconds": times, "speedup": med["unshared"] / med["shared"],
    }
    # float32: the same function up to reduction order; bf16: both arms round activations at different
    # points (other packings, other blockwise tiles), so only a loose check
    tol = (1e-3, 1e-3) if args.compute_dtype == "float32" else (1.0, 0.05)
    grad_rel = abs(updates["shared"]["train/grad_norm"] / updates["unshared"]["train/grad_norm"] - 1)
    result["first_update_grad_norm_rel_diff"] = grad_rel
    ok = old_diff < tol[0] and grad_rel < tol[1]
    print(json.dumps(result, indent=None if args.json else 2))
    if not ok:
        raise SystemExit("the two arms disagree: shared prompts changed the update")


if __name__ == "__main__":
    main()
