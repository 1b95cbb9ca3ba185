"""What the matched-precision learner costs: one SmolLM2 learner step with `learner_precision='master'` and
with `'engine'` for each engine quantizer, same batch.

With `rl.PrecisionConfig.learner_precision = 'engine'` every learner forward (old logprobs, the loss) runs on
the weights the engine serves, W_served = W + stop_gradient(Q(W) − W) for each decoder projection (rl/served_view.py):
the quantizer Q runs inside every jitted forward and backward, on every micro-batch. This measures that cost:

    arms      master (the default), and 'engine' for fp8_per_channel, int8_per_channel, fake_mxfp4 (each a
              `Learner` on the same model, so the arms share the weights; `optax.sgd(0)` keeps them fixed)
    step      `prepare` + `update`: old logprobs + the optimizer update, the learner's whole share of a step
    timing    arms alternated after one warm-up (compile) call each, median of --reps; ratio = arm / master
    memory    XLA's memory_analysis of the arm's compiled micro-batch gradient step (`Learner._grad_step`):
              temporaries and the total, and what the arm adds to master's

'master' is the default path: `Learner` builds its jitted functions without a model view at all
(rl/learner.py `_jitted`), so it pays nothing for the option.

The batch and learner are `benchmarks.shared_prompts`' (the SmolLM2 recipe's learner: bf16 compute, fp32
masters, shared prompts, remat 'full', 1024-token micro-batches) on `--groups` prompts × `--samples` random
answers of ~`--response-tokens` tokens.

    python -m benchmarks.learner_precision [--model checkpoints/smollm2-135m-instruct] [--groups 4]
                                           [--samples 4] [--response-tokens 70] [--reps 2] [--json]
                                           [--arms master fp8_per_channel int8_per_channel fake_mxfp4]
"""

from __future__ import annotations

import argparse
import json
import os

ARMS = ("master", "fp8_per_channel", "int8_per_channel", "fake_mxfp4")


def make_learner(model, cfg, memory, served: str):
    import optax
    from flax import nnx

    from portable_rl import tis
    from portable_rl.rl.learner import Learner

    learner = Learner(model, nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param), cfg,
                      tis.RolloutCorrectionConfig(mode="token", clip=2.0), memory=memory)
    if served != "master":
        learner.serve_weights_as(served)
    return learner


def grad_step_compiled(learner, prepared):
    """The arm's micro-batch gradient step, lowered and compiled for the batch's first micro-batch."""
    from portable_rl.learner_jax.step import zero_grads

    mb = prepared.micro_batches[0][0]
    return learner._grad_step.lower(learner.model, mb, zero_grads(learner.model)).compile()


def main():
    from benchmarks.shared_prompts import add_batch_args, alternated_step_seconds, build

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(parser, groups=4, samples=4)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, help="'master' is always measured")
    args = parser.parse_args()
    import jax.numpy as jnp

    from portable_rl.convert.hf import load_hf_model
    from portable_rl.learner_jax.memory import MemoryConfig

    cfg, batch, prompt_tokens = build(args)
    memory = MemoryConfig(attention_impl="auto", pack_sequences=True, share_prompts=True,
                          max_tokens_per_micro_batch=1024, logprob_chunk_tokens=512, remat="full")
    model, _ = load_hf_model(args.model, param_dtype=jnp.float32, compute_dtype=jnp.dtype(args.compute_dtype),
                             attention_impl=memory.attention_impl, remat=memory.remat)
    arms = {name: make_learner(model, cfg, memory, name) for name in dict.fromkeys(["master", *args.arms])}
    prepared = {name: learner.prepare(batch) for name, learner in arms.items()}

    compiled = {name: grad_step_compiled(learner, prepared[name]) for name, learner in arms.items()}
    memory_mb = {}
    for name, c in compiled.items():
        ma = c.memory_analysis()
        memory_mb[name] = {"temp": ma.temp_size_in_bytes / 2**20,
                           "total": (ma.argument_size_in_bytes + ma.output_size_in_bytes
                                     - ma.alias_size_in_bytes + ma.temp_size_in_bytes) / 2**20}

    first = {name: learner.update(prepared[name]) for name, learner in arms.items()}  # warm-up (compile)
    seconds, times = alternated_step_seconds(arms, batch, args.reps)
    result = {
        "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith("model name")), "?"),
        "load_1min": os.getloadavg()[0], "groups": args.groups, "samples": args.samples,
        "mean_prompt_tokens": prompt_tokens, "response_tokens": args.response_tokens,
        "compute_dtype": args.compute_dtype,
        "learner_tokens": prepared["master"].metrics["batch/learner_tokens"],
        "micro_batches": prepared["master"].metrics["batch/micro_batches"],
        "first_update_loss": {n: first[n]["train/loss"] for n in arms},
        "seconds": seconds, "all_seconds": times,
        "time_vs_master": {n: seconds[n] / seconds["master"] for n in arms},
        "grad_step_memory_mb": memory_mb,
        "grad_step_extra_mb": {n: memory_mb[n]["total"] - memory_mb["master"]["total"] for n in arms},
    }
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
