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

Decode (`--decode`): rollout-length generation, the way RL rollouts spend their time. Every request decodes
exactly --max-tokens (default 256; `SamplingConfig.min_tokens = max_tokens`: EOS is masked until then, so
every arm does the same work), from --prompts prompts whose lengths are drawn uniformly from
--prompt-len (default 100-300 tokens: word-problem text from the checkpoint's own tokenizer, cut to that
length). The KV cache holds every prompt at full length, so each decode step runs at batch B = --prompts.
Each repetition (--reps, default 5) runs every arm twice, full length and prefill-only (max_tokens = 1), in an
order rotated by one arm per repetition, after a warm-up round of WARMUP_TOKENS per prompt (an engine's first
call builds its GEMM primitives for the prefill and decode shapes; the decode batch stays B throughout, so a
short round covers them); the prefix cache is reset before each call:

    t_decode        = t(max_tokens = T) − t(max_tokens = 1)            (same arm, same repetition, adjacent)
    decode tokens/s = B · (T − 1) / t_decode
    rollout tokens/s = B · T / t(max_tokens = T)
    per arm: the median over repetitions of each; best unquantized = the fp32 / bf16 arm of higher decode tokens/s
    ratio           = arm's median decode tokens/s / best unquantized arm's   (also per repetition, same round)

`--out FILE` writes every call (arm, repetition, position in the round, tokens, seconds), each arm's engine
dtype and kernel (`served_by`), the CPU model and flags, load averages, command, date and git commit.

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
    python -m benchmarks.rollout --decode --model checkpoints/smollm2-135m-instruct --out docs/data/rollout_decode/X.json
    bash benchmarks/rollout_decode.sh      # the decode measurement at SmolLM2 size, d 2048 and d 4096 (all arms)

Measured numbers, with their CPUs: docs/experiments/cpu_rollouts.md ("INT8 rollouts", "Rollout throughput",
"INT8 decode at rollout length").
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


def checkpoint(args, workdir: str) -> tuple[str, str, int]:
    """(checkpoint directory, its name, parameter count): --model, or a random Qwen2 written into workdir."""
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

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
                    head_dim=64, tie_word_embeddings=True,
                    max_positions=4096)  # --decode's prompts + 256 tokens pass the default 512
        name = f"qwen2_l{args.layers}_d{args.hidden}_f{args.intermediate}_v{args.vocab}_p4096"
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
    return ckpt, name, n_params


def throughput(args) -> dict:
    from portable_rl.engines import SamplingConfig, create_engine
    from portable_rl.engines.cpu_features import FAST_BF16_CPU_FLAGS, cpu_flags

    workdir = args.workdir or tempfile.mkdtemp(prefix="rollout_bench_")
    ckpt, name, n_params = checkpoint(args, workdir)
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


# ---------------------------------------------------------------------------------------------- decode
CPU_FLAG_PATTERN = r"avx512[a-z_0-9]*|avx_vnni|amx[a-z_0-9]*"  # what the docs quote of /proc/cpuinfo
WARMUP_TOKENS = 8  # generated per prompt in the warm-up round (module doc)


def word_problem_prompts(ckpt: str, n: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """n prompts of lengths uniform in [min_len, max_len]: word-problem text (tasks/word_problems.py), a
    different run of problems per prompt, in the checkpoint's own tokenizer, cut to the drawn length."""
    import numpy as np

    from portable_rl.rl.codec import TextCodec
    from portable_rl.tasks.word_problems import WordProblemsTask

    codec, task = TextCodec(ckpt), WordProblemsTask(seed=seed, num_eval=0)
    lengths = np.random.default_rng(seed).integers(min_len, max_len + 1, n)
    prompts = []
    for i, length in enumerate(lengths):
        ids, draw = [], 0
        while len(ids) < length:  # more problems until the text is long enough (a char tokenizer needs fewer)
            text = "\n\n".join(ex.prompt for ex in task.train_batch(i, draw, 16))
            ids += codec.encode_prompt(text) if not ids else codec.tokenizer.encode("\n\n" + text,
                                                                                   add_special_tokens=False)
            draw += 1
        prompts.append(ids[:length])
    return prompts


def kv_cache_bytes(ckpt: str, prompts: int, max_model_len: int) -> int:
    """A KV cache that holds every prompt at full length in float32 (the widest engine dtype), with a
    quarter to spare for block rounding: no request waits or is preempted, so every decode step runs all
    prompts at once in every arm. At least the adapter's default (256 MiB: 11,520 SmolLM2 tokens), which
    also covers whole blocks for tiny models."""
    from portable_rl.engines.vllm_adapter import CPU_KV_CACHE_BYTES

    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4  # K and V, float32
    return max(CPU_KV_CACHE_BYTES, int(1.25 * per_token * prompts * max_model_len))


def _timed_call(engine, prompts, sampling) -> tuple[float, int]:
    """(wall seconds, generated tokens) of one adapter `generate`, after a prefix-cache reset (so every call
    prefills its prompts and no arm reuses KV entries another call computed)."""
    engine._llm.reset_prefix_cache()
    start = time.perf_counter()
    rollouts = engine.generate(prompts, sampling)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.response_token_ids) for r in rollouts)
    if tokens != len(prompts) * sampling.max_tokens:
        raise RuntimeError(f"{tokens} tokens generated, not {len(prompts)} x {sampling.max_tokens}: the forced "
                           "length (min_tokens = max_tokens) did not reach vLLM")
    return elapsed, tokens


def rotated(arms: list[str], rep: int) -> list[str]:
    """Repetition rep's order: the arms rotated by rep, so no arm always runs first (or after the same one)."""
    k = rep % len(arms)
    return arms[k:] + arms[:k]


def summarize_decode(calls: list[dict], arms: list[str]) -> dict:
    """Per arm, medians over the measured repetitions (warm-up excluded) and the ratios (module doc)."""
    measured = [c for c in calls if not c["warmup"]]
    per_rep = {arm: {c["rep"]: c for c in measured if c["arm"] == arm} for arm in arms}
    summary = {}
    for arm in arms:
        rows = per_rep[arm].values()
        summary[arm] = {"generate_s": statistics.median(c["generate_s"] for c in rows),
                        "prefill_s": statistics.median(c["prefill_s"] for c in rows),
                        "decode_s": statistics.median(c["decode_s"] for c in rows),
                        "decode_tokens_per_s": statistics.median(c["decode_tokens_per_s"] for c in rows),
                        "rollout_tokens_per_s": statistics.median(c["rollout_tokens_per_s"] for c in rows)}
    unquantized = [a for a in arms if a in UNQUANTIZED]
    best = max(unquantized, key=lambda a: summary[a]["decode_tokens_per_s"]) if unquantized else None
    if best:
        for arm in arms:
            s = summary[arm]
            s["decode_ratio"] = s["decode_tokens_per_s"] / summary[best]["decode_tokens_per_s"]
            s["rollout_ratio"] = s["rollout_tokens_per_s"] / summary[best]["rollout_tokens_per_s"]
            s["decode_ratio_per_rep"] = [per_rep[arm][r]["decode_tokens_per_s"] / per_rep[best][r]["decode_tokens_per_s"]
                                         for r in sorted(per_rep[arm])]
    return {"best_unquantized": best, "arms": summary}


def machine() -> dict:
    """The CPU (model, the flags docs quote, cores), the load and the software of this run."""
    import platform
    import re
    import subprocess

    import torch
    import vllm

    cpuinfo = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return {"cpu_model": model.group(1).strip() if model else platform.processor(),
            "cpu_flags": sorted(set(re.findall(CPU_FLAG_PATTERN, cpuinfo))), "cpus": os.cpu_count(),
            "git_commit": commit, "git_dirty": bool(dirty), "python": platform.python_version(),
            "torch": torch.__version__, "vllm": vllm.__version__, "torch_threads": torch.get_num_threads()}


def decode(args) -> dict:
    import datetime
    import shlex

    from portable_rl.engines import SamplingConfig, create_engine
    from portable_rl.engines.vllm_adapter import INT8, cpu_engine_dtype

    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    workdir = args.workdir or tempfile.mkdtemp(prefix="rollout_bench_")
    ckpt, name, n_params = checkpoint(args, workdir)
    prompts = word_problem_prompts(ckpt, args.prompts, *args.prompt_len)
    max_len = max(map(len, prompts)) + args.max_tokens
    kv_bytes = kv_cache_bytes(ckpt, len(prompts), max_len)
    engines = {}
    try:
        for arm in args.arms:
            kwargs = dict(ARMS[arm])
            kwargs["engine_init_kwargs"] = {**kwargs.get("engine_init_kwargs", {}), "kv_cache_memory_bytes": kv_bytes}
            engines[arm] = create_engine("vllm", model_path=ckpt, max_model_len=max_len, seed=0,
                                         quantized_checkpoint_root=os.path.join(workdir, "quantized"), **kwargs)
        served_by = {arm: _served_by(engine) for arm, engine in engines.items()}
        prefill = SamplingConfig(temperature=1.0, max_tokens=1, min_tokens=1, seed=0)
        b = len(prompts)
        calls = []
        for rep in range(1 + args.reps):  # round 0 warms up
            t = min(WARMUP_TOKENS, args.max_tokens) if rep == 0 else args.max_tokens
            full = SamplingConfig(temperature=1.0, max_tokens=t, min_tokens=t, seed=0)
            for position, arm in enumerate(rotated(list(engines), rep)):
                generate_s, _ = _timed_call(engines[arm], prompts, full)
                prefill_s, _ = _timed_call(engines[arm], prompts, prefill)
                decode_s = generate_s - prefill_s
                calls.append({"rep": rep, "warmup": rep == 0, "arm": arm, "position": position,
                              "dtype": served_by[arm].split(",")[0], "served_by": served_by[arm],
                              "generated_tokens": b * t, "prefill_tokens": sum(map(len, prompts)),
                              "generate_s": generate_s, "prefill_s": prefill_s, "decode_s": decode_s,
                              "decode_tokens_per_s": b * (t - 1) / decode_s, "rollout_tokens_per_s": b * t / generate_s})
                print(f"rollout --decode: rep {rep} {arm}: {b * t} tokens in {generate_s:.2f} s, prefill {prefill_s:.2f} s, "
                      f"decode {b * (t - 1) / decode_s:.1f} tok/s{' (warm-up)' if rep == 0 else ''}",
                      file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    int8_dtype, int8_why = cpu_engine_dtype(quantization=INT8)
    return {"mode": "decode", "command": shlex.join([sys.executable, "-m", "benchmarks.rollout", *sys.argv[1:]]),
            "started_utc": started.isoformat(timespec="seconds"),
            "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average_before": load_before, "load_average_after": os.getloadavg(), **machine(),
            "model": name, "params": n_params, "prompts": b, "max_tokens": args.max_tokens, "reps": args.reps,
            "prompt_tokens": {"min": min(map(len, prompts)), "mean": sum(map(len, prompts)) / b,
                              "max": max(map(len, prompts))},
            "max_model_len": max_len, "kv_cache_memory_bytes": kv_bytes,
            "adapter_int8_dtype": {"dtype": int8_dtype, "why": int8_why}, "served_by": served_by,
            **summarize_decode(calls, list(engines)), "calls": calls}


def print_decode(r: dict) -> None:
    print(f"model {r['model']} ({r['params'] / 1e6:.1f}M params), {r['prompts']} prompts of "
          f"{r['prompt_tokens']['min']}-{r['prompt_tokens']['max']} tokens x {r['max_tokens']} generated, "
          f"median of {r['reps']} rotated repetitions; {r['cpu_model']}, {r['cpus']} CPUs, load "
          f"{r['load_average_before'][0]:.1f} -> {r['load_average_after'][0]:.1f}")
    print(f"CPU flags: {' '.join(r['cpu_flags']) or 'none of avx512* / avx_vnni / amx*'}; the adapter serves INT8 "
          f"with {r['adapter_int8_dtype']['dtype']} glue ({r['adapter_int8_dtype']['why']})")
    for arm, s in r["arms"].items():
        ratio = (f"  decode {s['decode_ratio']:5.2f}x {r['best_unquantized']} "
                 f"(reps {min(s['decode_ratio_per_rep']):.2f}-{max(s['decode_ratio_per_rep']):.2f}), "
                 f"rollout {s['rollout_ratio']:5.2f}x" if r["best_unquantized"] else "")
        print(f"  {arm:<22} generate {s['generate_s']:7.2f} s  prefill {s['prefill_s']:6.2f} s  "
              f"decode {s['decode_tokens_per_s']:8.1f} tok/s  rollout {s['rollout_tokens_per_s']:8.1f} tok/s"
              f"{ratio}  [{r['served_by'][arm]}]")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default=None, help="print the step-time breakdown of this run and exit")
    parser.add_argument("--tiny", action="store_true", help="the tiny default model instead of --layers ...")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024, help="multiple of 256 (head_dim 64, 4 q per kv)")
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--decode", action="store_true",
                        help="rollout-length decode: forced length, realistic prompts, prefill timed apart (module doc)")
    parser.add_argument("--prompts", type=int, default=None, help="default 16; with --decode 32")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 32; with --decode 256 (exactly)")
    parser.add_argument("--reps", type=int, default=None, help="default 2; with --decode 5")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[100, 300], metavar=("MIN", "MAX"),
                        help="--decode: prompt lengths, uniform in [MIN, MAX] tokens")
    parser.add_argument("--out", default=None,
                        help="--decode: write every call's raw numbers here (docs/data/rollout_decode/<date>_<cpu>_<model>.json)")
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
    defaults = dict(prompts=32, max_tokens=256, reps=5) if args.decode else dict(prompts=16, max_tokens=32, reps=2)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.decode:
        if args.fp8_baseline or args.support_cost:
            sys.exit("--decode measures the --arms engines only; run --fp8-baseline / --support-cost without it")
        if args.max_tokens < 2 or args.prompt_len[0] < 1 or args.prompt_len[0] > args.prompt_len[1]:
            sys.exit(f"--decode needs --max-tokens >= 2 (got {args.max_tokens}) and 1 <= MIN <= MAX for --prompt-len")
        r = decode(args)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(r, f, indent=1)
        print(json.dumps(r)) if args.json else print_decode(r)
        return
    if args.out:
        sys.exit("--out is for --decode (the raw per-call file)")
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
