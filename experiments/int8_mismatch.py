"""How far each 8-bit rollout engine samples from the fp32 policy, and what SmoothQuant does for INT8.

    python -m experiments.int8_mismatch [--model checkpoints/smollm2-135m-instruct] [--prompts 32]
        [--max-tokens 64] [--temperature 1.0] [--alphas 0.5 0.75] [--json]

Every engine serves the same starting checkpoint and samples the same chat-templated word problems with
the same seeds; the fp32 learner then scores each engine's own tokens y ~ π_engine:

    d_t = log π_engine(y_t) − log π_learner,fp32(y_t)
    k1 = mean_t d_t      (what `tis/kl` reports during training)     k3 = mean_t (e^(−d_t) − 1 + d_t)

Engines: fp32 and bf16 (the kernels' floor), fp8_per_channel (vLLM's online FP8), int8_per_channel (INT8
W8A8 from the adapter's compressed-tensors copy), and int8_per_channel with SmoothQuant at each --alphas
value: factors from the learner's forward on --calibration prompts (other problems than the scored ones,
`convert.smoothing.calibrate`), pushed to the INT8 engine as training does (`rl.sync.push_weights`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the engines' INFO lines would bury the table

from experiments.served_vs_learner import QUESTIONS, _score  # noqa: E402


def measure(args) -> dict:
    import jax.numpy as jnp
    import numpy as np
    from transformers import AutoTokenizer

    from portable_rl.convert.hf import load_hf_model
    from portable_rl.convert.smoothing import calibrate
    from portable_rl.engines import SamplingConfig, create_engine
    from portable_rl.rl.sync import push_weights

    tok = AutoTokenizer.from_pretrained(args.model)

    def encode(q):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False)

    prompts = [encode(q) for q in QUESTIONS[:args.prompts]]
    calibration = [encode(q) for q in QUESTIONS[-args.calibration:]]
    sampling = SamplingConfig(temperature=args.temperature, max_tokens=args.max_tokens, n=1, seed=5)
    learner, config = load_hf_model(args.model, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    root = os.path.join(args.workdir, "quantized")
    arms = [("fp32", dict(dtype="float32"), None), ("bf16", dict(dtype="bfloat16"), None),
            ("fp8_per_channel", dict(engine_init_kwargs={"quantization": "fp8_per_channel"}), None),
            ("int8_per_channel", dict(engine_init_kwargs={"quantization": "int8_per_channel"}), None)]
    arms += [(f"int8_per_channel + SmoothQuant a={a}", dict(engine_init_kwargs={"quantization": "int8_per_channel"}),
              a) for a in args.alphas]
    out = {}
    for name, kwargs, alpha in arms:
        with create_engine("vllm", model_path=args.model, quantized_checkpoint_root=root, seed=0,
                           max_model_len=400, **kwargs) as engine:
            if alpha is not None:
                push_weights(engine, learner, config, smoothing=calibrate(learner, calibration, alpha))
            rollouts = engine.generate(prompts, sampling)
        learner_logprobs = _score(learner, rollouts, args.temperature, tok.pad_token_id or 0)
        d = np.concatenate([np.asarray(r.response_logprobs) - np.asarray(ref)
                            for r, ref in zip(rollouts, learner_logprobs)])
        row = {"k1": float(d.mean()), "k3": float(np.mean(np.expm1(-d) + d)), "mean_abs": float(np.abs(d).mean()),
               "max_abs": float(np.abs(d).max()), "tokens": int(d.size)}
        out[name] = row
        print(f"{name:<38} k1 {row['k1']:+.4f}  k3 {row['k3']:.4f}  mean|d| {row['mean_abs']:.3f}  "
              f"max|d| {row['max_abs']:.2f}  ({row['tokens']} tokens)", file=sys.stderr, flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--calibration", type=int, default=8, help="calibration prompts (the last problems)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--alphas", type=float, nargs="*", default=[0.5])
    p.add_argument("--workdir", default="/tmp/int8_mismatch")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.prompts + args.calibration > len(QUESTIONS):
        sys.exit(f"--prompts + --calibration must be <= {len(QUESTIONS)}")
    out = measure(args)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
