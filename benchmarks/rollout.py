"""Rollout throughput of vLLM engine arms (fp32, bf16, fp8_per_channel, INT8); the step-time breakdown of a run.

Throughput. Real in-process vLLM engines (`create_engine("vllm", ...)`, one per `--arms` entry: `ARMS`) on
the SAME checkpoint generate for the SAME prompts with the SAME seeded sampling (temperature 1, top_p 1,
top_k -1). The engines alternate (fp32, bf16, fp8, int8, fp32, ...) so background load hits all alike:

    tokens/s = generated response tokens / wall time of one `generate` call      (median over --reps;
               the prefix cache is reset before each call, so every call prefills its prompts)
    ratio    = an arm's tokens/s / the best unquantized arm's (fp32 or bf16) in the same run

The JSON also records the CPU's bf16 / int8 dot-product flags and each engine's dtype and GEMM kernel
(`served_by`, e.g. `CPUInt8ScaledMMLinearKernel._apply_weights_onednn`).

On CPU the FP8 GEMM is engines/vllm_cpu_fp8.py's dense GEMM of the exactly upcast fp8 operands (there is
no FP8 matrix unit), so this ratio says little about FP8 tensor-core GEMMs on a GPU (there, expect
fp8 ≥ bf16 once GEMMs dominate). `--fp8-baseline` adds a third arm on the same fp8 engine: vLLM's own
kernel with row-wise scales (`torch._scaled_mm` → oneDNN, the previous fast path), alternating with the
others, for the speed-up of the dense path in one run. `--support-cost` adds the bf16 engine at top_p 0.8 /
top_k 64 returning each token's sampling support (`SamplingConfig.return_support`: vLLM's top-64 processed
logprobs per token), the price of exact top-p TIS (tokens/s; the arms sample different tokens).
`--model DIR` benchmarks an HF checkpoint directory
(e.g. checkpoints/smollm2-135m-instruct) instead of a random Qwen2.

Breakdown. `--run-dir RUN` reads RUN/metrics.jsonl (written by `portable_rl.train`) and prints the medians of
time/generate, time/logprob, time/train, time/sync and time/step over steps, their shares of the step
(the rest, "other", is the post-sync probe and held-out evaluation), and checks sync < 5 % of a step and
each per-step diagnostic (`DIAGNOSTICS`: time/update_survival, time/mismatch_split) < 1 %. The probe itself
(time/probe: engine generation + learner scoring, the split included) is reported, not checked, and so are
the medians of the probe's KL and its split (`MISMATCH`: probe/kl = quantization + kernels + interaction,
rl/mismatch_split.py).

    python -m benchmarks.rollout [--layers 8 --hidden 1024 --intermediate 2816 --vocab 32000]
                                 [--prompts 16 --max-tokens 32 --reps 2] [--tiny] [--json]
    python -m benchmarks.rollout --model checkpoints/smollm2-135m-instruct --prompts 32 --max-tokens 64 --fp8-baseline
    python -m benchmarks.rollout --layers 4 --hidden 4096 --intermediate 11008 --arms bf16 int8_per_channel
    python -m benchmarks.rollout --run-dir runs/dapo_fp8

Measured numbers, with their CPUs: docs/experiments/cpu_rollouts.md ("INT8 rollouts", "Rollout throughput").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

PHASES = ("time/generate", "time/logprob", "time/train", "time/sync")
SYNC_SHARE_TARGET = 0.05
# Per-step diagnostics that must stay cheap (each under 1 % of a step); absent in older runs.
DIAGNOSTICS = ("time/update_survival", "time/mismatch_split")
DIAGNOSTIC_SHARE_TARGET = 0.01
REPORTED = ("time/probe",)  # shares reported without a target
MISMATCH = ("probe/kl", "mismatch/quantization", "mismatch/kernels", "mismatch/interaction", "mismatch/staleness")


# ------------------------------------------------------------------------------------------- breakdown
def step_breakdown(run_dir: str) -> dict:
    """Medians over steps of each phase and of the whole step, from RUN/metrics.jsonl."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        sys.exit(f"no metrics.jsonl in {run_dir}; pass the RUN_DIR of a finished `portable_rl.train` run")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in rows if "time/step" in r]  # step 0 (initial eval + sync) has no time/step
    if not steps:
        sys.exit(f"{path} has no rows with time/step; did the run finish a training step?")
    medians = {k: statistics.median(r.get(k, 0.0) for r in steps) for k in PHASES + ("time/step",)}
    step = medians["time/step"]
    out = {"run_dir": run_dir, "steps": len(steps), "medians_s": medians,
           "shares": {k: medians[k] / step for k in PHASES},
           "other_share": 1.0 - sum(medians[k] for k in PHASES) / step,
           # median of the per-step ratio too: the ratio of medians can hide a few slow syncs
           "sync_share_median_per_step": statistics.median(r["time/sync"] / r["time/step"] for r in steps)}
    out["sync_ok"] = out["shares"]["time/sync"] < SYNC_SHARE_TARGET
    out["diagnostics"] = {k: {"median_s": statistics.median(r[k] for r in steps if k in r),
                              "share_median_per_step": statistics.median(r[k] / r["time/step"] for r in steps if k in r)}
                          for k in DIAGNOSTICS if any(k in r for r in steps)}
    for d in out["diagnostics"].values():
        d["ok"] = d["share_median_per_step"] < DIAGNOSTIC_SHARE_TARGET
    out["reported"] = {k: {"median_s": statistics.median(r[k] for r in steps if k in r),
                           "share_median_per_step": statistics.median(r[k] / r["time/step"] for r in steps if k in r)}
                       for k in REPORTED if any(k in r for r in steps)}
    out["mismatch_medians"] = {k: statistics.median(r[k] for r in steps if k in r)
                               for k in MISMATCH if any(k in r for r in steps)}
    return out


def print_breakdown(b: dict) -> None:
    print(f"{b['run_dir']}: medians over {b['steps']} steps")
    print("| " + " | ".join(k.removeprefix("time/") for k in PHASES) + " | other | step |")
    print("|" + "---|" * (len(PHASES) + 2))
    cells = [f"{b['medians_s'][k]:.3f} s ({100 * b['shares'][k]:.1f} %)" for k in PHASES]
    print("| " + " | ".join(cells) + f" | {100 * b['other_share']:.1f} % | {b['medians_s']['time/step']:.3f} s |")
    verdict = "ok" if b["sync_ok"] else "OVER"
    print(f"sync share {100 * b['shares']['time/sync']:.2f} % of the median step (per-step median "
          f"{100 * b['sync_share_median_per_step']:.2f} %), target < {100 * SYNC_SHARE_TARGET:.0f} %: {verdict}")
    for k, d in b.get("diagnostics", {}).items():
        print(f"{k}: median {1000 * d['median_s']:.1f} ms, {100 * d['share_median_per_step']:.3f} % of a step "
              f"(per-step median), target < {100 * DIAGNOSTIC_SHARE_TARGET:.0f} %: {'ok' if d['ok'] else 'OVER'}")
    for k, d in b.get("reported", {}).items():
        print(f"{k}: median {1000 * d['median_s']:.1f} ms, {100 * d['share_median_per_step']:.3f} % of a step "
              "(per-step median)")
    if b.get("mismatch_medians"):
        print("medians over steps: " + ", ".join(f"{k} {v:.3g}" for k, v in b["mismatch_medians"].items()))


# ------------------------------------------------------------------------------------------ throughput
def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 16-48 character-tokenizer ids (3..97: printable characters, no special tokens)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, 98, int(rng.integers(16, 49))).tolist() for _ in range(n)]


def _onednn_rowwise_scaled_mm(self, *, A, B, out_dtype, As, Bs, bias, output_shape):
    """The baseline arm: vLLM's per-channel formula through `torch._scaled_mm` with row-wise scales (oneDNN)."""
    import torch

    m = 1
    for d in output_shape[:-1]:
        m *= d
    scale_a = As.to(torch.float32).reshape(-1, 1)
    scale_a = (scale_a.expand(m, 1) if scale_a.shape[0] == 1 else scale_a[:m]).contiguous()
    scale_b = Bs.to(torch.float32).reshape(1, -1).expand(1, B.shape[1]).contiguous()
    out = torch._scaled_mm(A[:m], B, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    out = out[0] if isinstance(out, tuple) else out
    return (out if bias is None else out + bias).to(out_dtype).view(*output_shape)


class _TruncatedSampling:
    """Runs the bf16 engine with top_p / top_k and the support returned (the `--support-cost` arm)."""

    def __init__(self, engine, top_p: float, top_k: int):
        self.engine, self.top_p, self.top_k = engine, top_p, top_k

    def generate(self, prompts, sampling):
        import dataclasses

        truncated = dataclasses.replace(sampling, top_p=self.top_p, top_k=self.top_k, return_support=True)
        rollouts = self.engine.generate(prompts, truncated)
        assert all(r.sampling_support is not None for r in rollouts)
        return rollouts

    def close(self):
        pass  # the engine is closed once, under its own name


class _Fp8Kernel:
    """Runs an fp8 engine's generate with a chosen CPU GEMM (the dense fast path, or the oneDNN baseline)."""

    def __init__(self, engine, kernel):
        self.engine, self.kernel = engine, kernel

    def generate(self, prompts, sampling):
        from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel as K

        dense = K.apply_scaled_mm
        K.apply_scaled_mm = self.kernel or dense
        try:
            return self.engine.generate(prompts, sampling)
        finally:
            K.apply_scaled_mm = dense

    def close(self):
        pass  # the engine is closed once, under its own name


# Engine arms: create_engine("vllm", ...) keyword arguments. The unquantized ones set their dtype explicitly
# (the best of them is the baseline); the quantized ones take the adapter's choice for the box.
ARMS = {
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "fp8_per_channel": dict(engine_init_kwargs={"quantization": "fp8_per_channel"}),
    "int8_per_channel": dict(engine_init_kwargs={"quantization": "int8_per_channel"}),
    "int8_per_channel_fp32": dict(engine_init_kwargs={"quantization": "int8_per_channel"}, dtype="float32"),
    "int8_per_channel_bf16": dict(engine_init_kwargs={"quantization": "int8_per_channel"}, dtype="bfloat16"),
}
UNQUANTIZED = ("fp32", "bf16")
INT8_DOT_FLAGS = {"avx512_vnni", "avx_vnni", "amx_int8"}


def _served_by(engine) -> str:
    """The engine's dtype and the kernel class of its first quantized linear layer (or "unquantized")."""
    from portable_rl.engines.vllm_internals import first_linear_kernel, served_model_config

    dtype = str(served_model_config(engine._llm).dtype).removeprefix("torch.")
    return f"{dtype}, {engine._llm.collective_rpc(first_linear_kernel)[0]}"


def throughput(args) -> dict:
    from portable_rl.engines import SamplingConfig, create_engine
    from portable_rl.engines.cpu_features import FAST_BF16_CPU_FLAGS, cpu_flags
    from portable_rl.testing import make_tiny_checkpoint

    workdir = args.workdir or tempfile.mkdtemp(prefix="rollout_bench_")
    if args.model:
        ckpt, name = args.model, os.path.basename(os.path.normpath(args.model))
        if not os.path.exists(os.path.join(ckpt, "config.json")):
            sys.exit(f"--model {ckpt}: no config.json there; pass an HF checkpoint directory")
    elif args.tiny:
        dims = dict(size="tiny", vocab_size=128)
        name = "qwen2_tiny"
    else:
        dims = dict(size="small", vocab_size=args.vocab, hidden_size=args.hidden,
                    intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                    num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64 // 4,
                    head_dim=64, tie_word_embeddings=True)
        name = f"qwen2_l{args.layers}_d{args.hidden}_f{args.intermediate}_v{args.vocab}"
    if not args.model:
        ckpt = os.path.join(workdir, name)
        if not os.path.exists(os.path.join(ckpt, "config.json")):
            make_tiny_checkpoint(ckpt, "qwen2", dtype="bfloat16", **dims)
    from safetensors import safe_open
    import math

    from portable_rl.engines.checkpoint import safetensors_files

    n_params = 0
    for path in safetensors_files(ckpt):
        with safe_open(path, framework="numpy") as st:
            n_params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())

    max_len = 48 + args.max_tokens
    workdir_q = os.path.join(workdir, "quantized")
    engines = {arm: create_engine("vllm", model_path=ckpt, max_model_len=max_len, seed=0,
                                  quantized_checkpoint_root=workdir_q, **ARMS[arm]) for arm in args.arms}
    owned = list(engines.values())
    served_by = {arm: _served_by(engine) for arm, engine in engines.items()}
    if args.fp8_baseline:  # both fp8 arms reset the shared engine's prefix cache before each call
        engines["fp8_per_channel"] = _Fp8Kernel(engines["fp8_per_channel"], None)
        engines["fp8_onednn_baseline"] = _Fp8Kernel(engines["fp8_per_channel"].engine, _onednn_rowwise_scaled_mm)
    if args.support_cost:  # the bf16 engine again, at top_p 0.8 / top_k 64 with each token's support
        engines["bf16_top_p_support"] = _TruncatedSampling(engines["bf16"], 0.8, 64)
    prompts = make_prompts(args.prompts)
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens, seed=0)
    times = {k: [] for k in engines}
    tokens = {}
    try:
        for i in range(1 + args.reps):  # round 0 warms up
            for kind, engine in engines.items():
                # Every call prefills its prompts (and no arm reuses KV entries another arm's GEMM computed).
                (engine.engine if isinstance(engine, (_Fp8Kernel, _TruncatedSampling)) else engine
                 )._llm.reset_prefix_cache()
                start = time.perf_counter()
                rollouts = engine.generate(prompts, sampling)
                elapsed = time.perf_counter() - start
                n_tokens = sum(len(r.response_token_ids) for r in rollouts)
                if i == 0:
                    tokens[kind] = n_tokens
                elif n_tokens != tokens[kind]:  # same seed, same weights: the same samples every time
                    raise RuntimeError(f"{kind}: {n_tokens} tokens, {tokens[kind]} in the warm-up round")
                if i:
                    times[kind].append(elapsed)
                print(f"rollout: round {i} {kind}: {n_tokens} tokens in {elapsed:.2f} s"
                      f"{' (warm-up)' if i == 0 else ''}", file=sys.stderr, flush=True)
    finally:
        for engine in owned:
            engine.close()
    medians = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens[k] / medians[k] for k in engines}
    unquantized = [a for a in engines if a in UNQUANTIZED]
    best = max(unquantized, key=tps.get) if unquantized else None
    out = {"model": name, "params": n_params, "prompts": args.prompts, "max_tokens": args.max_tokens,
           "reps": args.reps, "cpu_flags": sorted(cpu_flags() & (INT8_DOT_FLAGS | set(FAST_BF16_CPU_FLAGS))),
           "generated_tokens": tokens, "median_s": medians, "tokens_per_s": tps, "served_by": served_by,
           "best_unquantized": best,
           "ratio_over_best_unquantized": {k: tps[k] / tps[best] for k in engines} if best else {}}
    if args.fp8_baseline:
        out["ratio_dense_over_onednn"] = tps["fp8_per_channel"] / tps["fp8_onednn_baseline"]
    if args.support_cost:  # tokens/s: the two arms sample different tokens (and lengths)
        out["ratio_support_over_plain_bf16"] = tps["bf16_top_p_support"] / tps["bf16"]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default=None, help="print the step-time breakdown of this run and exit")
    parser.add_argument("--tiny", action="store_true", help="the tiny default model instead of --layers ...")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024, help="multiple of 256 (head_dim 64, 4 q per kv)")
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="where the checkpoint goes (reused if present)")
    parser.add_argument("--model", default=None, help="an HF checkpoint directory instead of a random Qwen2")
    parser.add_argument("--fp8-baseline", action="store_true",
                        help="add vLLM's own per-channel kernel (oneDNN _scaled_mm) on the same fp8 engine")
    parser.add_argument("--support-cost", action="store_true",
                        help="add the bf16 engine at top_p 0.8 / top_k 64 returning each token's sampling support")
    parser.add_argument("--arms", nargs="+", default=["fp32", "bf16", "fp8_per_channel", "int8_per_channel"],
                        choices=sorted(ARMS), help="engines to alternate (each compared with the best of fp32 / bf16)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    if args.run_dir:
        b = step_breakdown(args.run_dir)
        print(json.dumps(b)) if args.json else print_breakdown(b)
        return
    if args.hidden % 256:
        sys.exit(f"--hidden {args.hidden} must be a multiple of 256 (head_dim 64, 4 query heads per kv head)")
    r = throughput(args)
    if args.json:
        print(json.dumps(r))
        return
    print(f"model {r['model']} ({r['params'] / 1e6:.1f}M params), {r['prompts']} prompts x {r['max_tokens']} "
          f"max tokens, median of {r['reps']} alternating generate calls")
    print(f"CPU flags: {', '.join(r['cpu_flags']) or 'no bf16 / int8 dot products'}")
    for kind in r["median_s"]:
        ratio = r["ratio_over_best_unquantized"].get(kind)
        print(f"  {kind:<22} {r['median_s'][kind]:7.2f} s  {r['generated_tokens'][kind]:6d} tokens  "
              f"{r['tokens_per_s'][kind]:8.1f} tok/s" + (f"  {ratio:5.2f}x {r['best_unquantized']}" if ratio else "")
              + (f"  [{r['served_by'][kind]}]" if kind in r["served_by"] else ""))
    if "ratio_dense_over_onednn" in r:
        print(f"  fp8 dense path / oneDNN baseline tokens/s: {r['ratio_dense_over_onednn']:.2f}x")


if __name__ == "__main__":
    main()
