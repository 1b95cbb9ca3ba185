"""Engine vs learner on a training checkpoint: which precision makes the mismatch (docs/training.md, SmolLM2).

    python -m experiments.served_vs_learner --checkpoints RUN/checkpoints --step 14
        [--model checkpoints/smollm2-135m-instruct] [--prompts 32 --max-tokens 96 --temperature 0.6]
    python -m experiments.served_vs_learner --checkpoints RUN/checkpoints --survival-steps 5,10,15

Mismatch. Restores the step's learner weights (fp32 masters) and samples --prompts chat-templated
arithmetic questions from vLLM engines serving them, then scores the same tokens with the learner:

    k1 = mean over response tokens of (log π_engine − log π_learner)      (what `tis/kl` estimates)

    engine                                   learner
    fp8_per_channel, weights pushed          fp32 compute       (an fp32-compute run's tis/kl)
    fp8_per_channel, fresh from the weights  fp32 compute       (equal to the row above: the push is right)
    fp8_per_channel, weights pushed          bf16 compute       (what the learner scores if it sees the
                                                                 weights the engine was sent)
    bf16, fresh                              bf16 compute       (the kernels' floor)

Survival (--survival-steps): `rl/update_survival.py` between consecutive checkpoints (first: the
starting checkpoint), for a bf16 and an fp8_per_channel engine, every 4th channel.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the engines' INFO lines would bury the table

QUESTIONS = [f"Tom has {a} apples. He buys {b} more and eats 2. How many apples does he have?"
             for a, b in zip(range(3, 67), range(2, 66))]


def _learner(model_dir, checkpoints, step, compute_dtype):
    import jax.numpy as jnp

    from portable_rl.convert.hf import load_hf_model
    from portable_rl.learner_jax.checkpoint import Checkpointer

    model, config = load_hf_model(model_dir, compute_dtype=getattr(jnp, compute_dtype))
    if step:
        Checkpointer(checkpoints).restore(model, step=step)
    return model, config


def _score(model, rollouts, temperature, pad_id):
    """The rollouts' per-token response logprobs under `model`, laid out and sliced as the post-sync probe's
    reference is (engines/probe.py's `run_probe`)."""
    import jax.numpy as jnp
    import numpy as np

    from portable_rl.learner_jax.logprobs import sequence_logprobs
    from portable_rl.rl.mismatch_split import response_slices
    from portable_rl.rl.diagnostics import probe_rows

    arrays, spans = probe_rows([r.prompt_token_ids for r in rollouts], [r.response_token_ids for r in rollouts],
                               pad_id)
    logp = sequence_logprobs(model, jnp.asarray(arrays["input_ids"]), jnp.asarray(arrays["attention_mask"]),
                             temperature)[0]
    return response_slices(np.asarray(logp), spans)


def mismatch(args) -> dict:
    from transformers import AutoTokenizer

    from portable_rl.convert.hf import copy_tokenizer_files, save_hf_model
    from portable_rl.convert.to_torch import iter_hf_tensors
    from portable_rl.engines import SamplingConfig, create_engine
    from portable_rl.engines.probe import compare_logprobs

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False)
               for q in QUESTIONS[:args.prompts]]
    sampling = SamplingConfig(temperature=args.temperature, max_tokens=args.max_tokens, n=1, seed=5)
    fp32, config = _learner(args.model, args.checkpoints, args.step, "float32")
    bf16, _ = _learner(args.model, args.checkpoints, args.step, "bfloat16")
    step_dir = tempfile.mkdtemp(prefix="served_vs_learner_")
    save_hf_model(fp32, config, step_dir)
    copy_tokenizer_files(args.model, step_dir)
    fp8 = {"quantization": "fp8_per_channel"}
    out = {}

    def row(name, rollouts, learner):
        r = compare_logprobs([x.response_logprobs for x in rollouts],
                             _score(learner, rollouts, args.temperature, tok.pad_token_id or 0))
        out[name] = {"k1": r.kl, "max_abs_diff": r.max_abs_diff, "tokens": r.n_tokens}
        print(f"{name:<55} k1 {r.kl:.4f}  max|Δ| {r.max_abs_diff:.2f}  ({r.n_tokens} tokens)", flush=True)

    with create_engine("vllm", model_path=args.model, engine_init_kwargs=fp8) as engine:
        engine.update_weights(iter_hf_tensors(fp32, config))
        pushed = engine.generate(prompts, sampling)
        row("fp8 engine, weights pushed  vs fp32-compute learner", pushed, fp32)
        row("fp8 engine, weights pushed  vs bf16-compute learner", pushed, bf16)
    with create_engine("vllm", model_path=step_dir, engine_init_kwargs=fp8) as engine:
        fresh = engine.generate(prompts, sampling)
        out["push_equals_fresh"] = [r.response_logprobs for r in fresh] == [r.response_logprobs for r in pushed]
        row("fp8 engine, fresh           vs fp32-compute learner", fresh, fp32)
    with create_engine("vllm", model_path=step_dir) as engine:
        row("bf16 engine, fresh          vs bf16-compute learner", engine.generate(prompts, sampling), bf16)
    print(f"pushed and fresh fp8 engines sampled identical logprobs: {out['push_equals_fresh']}")
    return out


def survival(args) -> dict:
    from portable_rl.rl.update_survival import UpdateSurvival

    steps = [int(s) for s in args.survival_steps.split(",")]
    out = {}
    for quantization in (None, "fp8_per_channel"):
        _, config = _learner(args.model, args.checkpoints, 0, "float32")
        tracker = UpdateSurvival(config, quantization, channel_stride=4)
        tracker.measure(_learner(args.model, args.checkpoints, 0, "float32")[0])
        previous = 0
        for step in steps:
            got = tracker.measure(_learner(args.model, args.checkpoints, step, "float32")[0])
            out[f"{quantization or 'bf16'} {previous}->{step}"] = got
            print(f"{quantization or 'bf16':<16} steps {previous:>3} -> {step:<3} "
                  + "  ".join(f"{k.removeprefix('sync/')} {v:.3f}" for k, v in got.items()), flush=True)
            previous = step
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct", help="the run's starting HF checkpoint")
    p.add_argument("--checkpoints", required=True, help="the run's checkpoints/ directory")
    p.add_argument("--step", type=int, default=None, help="the checkpoint to compare (mismatch)")
    p.add_argument("--survival-steps", default=None, help="comma-separated checkpoint steps (survival)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.step is None and args.survival_steps is None:
        sys.exit("pass --step N (engine vs learner mismatch) and/or --survival-steps 5,10 (update survival)")
    out = {}
    if args.survival_steps:
        out["survival"] = survival(args)
    if args.step is not None:
        out["mismatch"] = mismatch(args)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
