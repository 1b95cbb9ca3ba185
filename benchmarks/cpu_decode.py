"""vLLM-CPU decode of SmolLM2-135M-Instruct: dtype choice, where the time goes, and the roofline.

    python -m benchmarks.cpu_decode [--model checkpoints/smollm2-135m-instruct] [--dtypes bfloat16,float32]
                                    [--prompts 32 --max-tokens 128 --reps 2] [--profile] [--json]
                                    [--engine-kwargs '{"enforce_eager": false}']
    OMP_WAIT_POLICY=ACTIVE python -m benchmarks.cpu_decode ...    # OpenMP's spinning (portable_rl's default: PASSIVE)

Throughput. One in-process engine per dtype (`create_engine("vllm", dtype=...)`, the adapter's settings),
the SAME chat prompts and seeded T = 1 sampling with `ignore_eos` (every request decodes exactly
--max-tokens, so each dtype does the same work); the engines alternate so background load hits all alike:

    tokens/s        = prompts · max_tokens / wall time of one generate call     (median over --reps)
    decode tokens/s = prompts · (max_tokens − 1) / (that time − the time of a max_tokens = 1 call)
(the prefix cache is reset before each call, so every call prefills its prompts)

Roofline of one generate call: B prompts of mean length p, then max_tokens decode steps at batch B with
mean context L = p + max_tokens / 2:

    bytes  = P_mm · s + B · L · kv_bytes          P_mm: matmul weights (incl. the tied head), s: bytes/elem
    flops  = 2 · P_mm · B + 4 · B · L · layers · q_heads · head_dim        (GEMMs + attention)
    t_step ≥ max(bytes / BW, flops / F_B)         BW: measured read bandwidth (x.sum() over 1 GiB);
                                                  F_M: measured GEMM FLOP/s of vLLM's oneDNN kernel over
                                                  the model's (N, K) shapes with M rows, this dtype
    t_gen  ≥ B · p · 2 · P_mm / F_512 + max_tokens · t_step                (prefill + decode)
    tokens/s_roof = B · max_tokens / t_gen,   ratio = measured tokens/s / tokens/s_roof
    decode tokens/s_roof = B / t_step,        decode ratio = measured decode tokens/s / that

(B shrinks as requests finish; with ignore_eos they all run --max-tokens, so B = --prompts throughout.)

Profile (--profile): `torch.profiler` over one generate call of the first dtype; self CPU time by op,
grouped as linear (GEMM ops), attention, sampling (softmax / sort / top-k / random), other ops; "python +
framework" = wall − all op time (vLLM's scheduler, input preparation, Python between ops).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from portable_rl.engines.cpu_features import prefer_passive_omp_waits

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "checkpoints" / "smollm2-135m-instruct"
QUESTION = "Tom has {} apples and buys {} more. Then he gives {} to Ann. How many apples does he have now?"
BYTES = {"bfloat16": 2, "float32": 4}

GROUPS = (  # (group, substrings of profiler op names), first match wins
    ("linear", ("linear", "addmm", "aten::mm", "matmul", "onednn_mm", "gemm", "scaled_mm", "bmm")),
    ("attention", ("attention", "attn", "paged", "sdpa", "flash", "reshape_and_cache", "kv_cache")),
    ("sampling", ("softmax", "sort", "topk", "top_k", "multinomial", "exponential", "argmax", "sampl",
                  "random", "gather", "logprob", "cumsum")),
)


def chat_prompts(model: str, n: int) -> list[list[int]]:
    from portable_rl.rl.codec import TextCodec

    codec = TextCodec(model, chat_template=True)
    return [codec.encode_prompt(QUESTION.format(3 + i, 5 + i % 7, 1 + i % 3)) for i in range(n)]


# ---------------------------------------------------------------------------------------- roofline
def model_shapes(model: str) -> dict:
    cfg = json.loads((Path(model) / "config.json").read_text())
    d, f, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    # vLLM's fused layers: qkv_proj [q + 2kv, d], o_proj [d, q], gate_up_proj [2f, d], down_proj [d, f]
    per_layer = [(q + 2 * kv, d), (d, q), (2 * f, d), (d, f)]
    linears = [(n, k, layers) for n, k in per_layer] + [(v, d, 1)]  # (+ the lm_head, tied or not)
    return dict(layers=layers, q_heads=cfg["num_attention_heads"], head_dim=hd, kv_width=kv, linears=linears,
                matmul_params=sum(n * k * c for n, k, c in linears))


def read_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """Bytes/s of `x.sum()` over a float32 buffer far larger than the caches (what decode's weight reads do)."""
    import torch

    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best = min(_time(lambda: x.sum()) for _ in range(reps))
    return x.numel() * 4 / best


def gemm_flops(shapes: dict, m: int, dtype: str, kernel: str = "onednn", reps: int = 20) -> float:
    """FLOP/s of one pass over the model's linears ((N, K), M = m rows), best of `reps` passes.

    The best pass, not the median: on a shared box it is the one least disturbed by other processes.
    kernel="onednn": vLLM-CPU's own GEMM (`ops.onednn_mm`, what its unquantized linears call);
    kernel="torch": torch.nn.functional.linear.
    """
    import torch

    dt = getattr(torch, dtype)
    calls = []
    for n, k, count in shapes["linears"]:
        x, w = torch.randn(m, k, dtype=dt), torch.randn(n, k, dtype=dt)
        if kernel == "onednn":
            from vllm import _custom_ops as ops

            handler = ops.create_onednn_mm(w.t(), 32)
            calls.append((lambda x=x, h=handler: ops.onednn_mm(h, x, None), 2 * m * n * k, count))
        else:
            calls.append((lambda x=x, w=w: torch.nn.functional.linear(x, w), 2 * m * n * k, count))
    total_flops = sum(f * c for _, f, c in calls)
    for fn, _, _ in calls:
        fn()  # warm-up: oneDNN builds its primitive on first use
    best = min(sum(c * _time(fn) for fn, _, c in calls) for _ in range(reps))
    return total_flops / best


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def roofline(shapes: dict, dtype: str, batch: int, prompt_len: float, new_tokens: int, bandwidth: float,
             flops: float, prefill_flops: float) -> dict:
    """Fastest possible generate: prefill (compute-bound) + new_tokens decode steps at batch `batch`."""
    s = BYTES[dtype]
    kv_bytes = 2 * shapes["layers"] * shapes["kv_width"] * s            # K and V of one position, all layers
    attn = 4 * shapes["layers"] * shapes["q_heads"] * shapes["head_dim"]  # QK^T + PV flops per (query, key)
    context = prompt_len + new_tokens / 2                                # mean over the decode steps
    step_bytes = shapes["matmul_params"] * s + batch * context * kv_bytes
    step_flops = 2 * shapes["matmul_params"] * batch + attn * batch * context
    t_mem, t_compute = step_bytes / bandwidth, step_flops / flops
    t_prefill = batch * prompt_len * (2 * shapes["matmul_params"] + attn * prompt_len / 2) / prefill_flops
    t_total = t_prefill + new_tokens * max(t_mem, t_compute)
    return dict(step_bytes=step_bytes, step_flops=step_flops, t_memory_s=t_mem, t_compute_s=t_compute,
                t_prefill_s=t_prefill, bound="memory" if t_mem > t_compute else "compute",
                tokens_per_s=batch * new_tokens / t_total, decode_tokens_per_s=batch / max(t_mem, t_compute))


# ---------------------------------------------------------------------------------------- decode
def decode_throughput(args, prompts) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from portable_rl.engines import create_engine

    max_len = max(map(len, prompts)) + args.max_tokens
    engines = {dt: create_engine("vllm", model_path=str(args.model), max_model_len=max_len, dtype=dt, seed=0,
                                 engine_init_kwargs=args.engine_kwargs)
               for dt in args.dtypes}
    import torch

    threads = torch.get_num_threads()  # what vLLM's CPU worker left torch with
    # The adapter's generate stops at EOS; ignore_eos makes every dtype decode the same number of tokens.
    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0,
                              logprobs=0, detokenize=False)
    first_token = SamplingParams(n=1, temperature=1.0, max_tokens=1, ignore_eos=True, seed=0, logprobs=0,
                                 detokenize=False)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    times = {dt: [] for dt in engines}
    prefill_times = {dt: [] for dt in engines}

    def timed_generate(engine, params):
        engine._llm.reset_prefix_cache()  # every call prefills its prompts (no reuse of the last call's KV)
        start = time.perf_counter()
        outs = engine._llm.generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    try:
        for i in range(1 + args.reps):  # round 0 warms up
            for dt, engine in engines.items():
                elapsed, n_tokens = timed_generate(engine, sampling)
                assert n_tokens == len(prompts) * args.max_tokens, n_tokens
                if i:
                    times[dt].append(elapsed)
                    prefill_times[dt].append(timed_generate(engine, first_token)[0])  # prefill + 1 token
                print(f"cpu_decode: round {i} {dt}: {n_tokens} tokens in {elapsed:.2f} s "
                      f"({n_tokens / elapsed:.1f} tok/s){' (warm-up)' if i == 0 else ''}", file=sys.stderr,
                      flush=True)
        profile = profile_generate(engines[args.dtypes[0]], inputs, sampling) if args.profile else None
    finally:
        for engine in engines.values():
            engine.close()
    tokens = len(prompts) * args.max_tokens
    decode = {dt: len(prompts) * (args.max_tokens - 1) / (statistics.median(times[dt])
                                                          - statistics.median(prefill_times[dt])) for dt in times}
    return dict(torch_threads=threads, tokens_per_s={dt: tokens / statistics.median(v) for dt, v in times.items()},
                decode_tokens_per_s=decode,
                prefill_s={dt: statistics.median(v) for dt, v in prefill_times.items()},
                median_s={dt: statistics.median(v) for dt, v in times.items()}, profile=profile)


def profile_generate(engine, inputs, sampling) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine._llm.generate(inputs, sampling, use_tqdm=False)
        wall = time.perf_counter() - start
    ops = [(e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages() if e.self_cpu_time_total > 0]
    groups = {g: 0.0 for g, _ in GROUPS} | {"other ops": 0.0}
    for name, s in ops:
        low = name.lower()
        group = next((g for g, keys in GROUPS if any(k in low for k in keys)), "other ops")
        groups[group] += s
    op_total = sum(groups.values())
    groups["python + framework"] = max(wall - op_total, 0.0)
    top = sorted(ops, key=lambda o: -o[1])[:15]
    return dict(wall_s=wall, seconds=groups, shares={g: s / wall for g, s in groups.items()},
                top_ops=[(n, round(s, 3)) for n, s in top])


def main():
    prefer_passive_omp_waits()  # before anything loads torch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="torch.profiler split of one generate (first dtype)")
    p.add_argument("--engine-kwargs", type=json.loads, default={}, help="JSON dict for vllm.LLM")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.dtypes = args.dtypes.split(",")
    if not (args.model / "config.json").exists():
        sys.exit(f"no checkpoint at {args.model}; write it with: python -m portable_rl.convert.gguf {args.model}")
    if bad := [d for d in args.dtypes if d not in BYTES]:
        sys.exit(f"--dtypes {bad}: use bfloat16 and/or float32")

    prompts = chat_prompts(str(args.model), args.prompts)
    result = dict(model=str(args.model), prompts=args.prompts, max_tokens=args.max_tokens, reps=args.reps,
                  engine_kwargs=args.engine_kwargs, ld_preload=os.environ.get("LD_PRELOAD", ""),
                  omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                  load_average=os.getloadavg()[0], cpu_flags=cpu_flags())
    result.update(decode_throughput(args, prompts))
    shapes = model_shapes(str(args.model))
    bandwidth = read_bandwidth()
    prompt_len = statistics.mean(map(len, prompts))
    result.update(matmul_params=shapes["matmul_params"], read_bandwidth_GBps=bandwidth / 1e9,
                  mean_prompt_tokens=prompt_len, roofline={})
    for dt in args.dtypes:
        flops = gemm_flops(shapes, args.prompts, dt)
        prefill = gemm_flops(shapes, 512, dt, reps=5)
        roof = roofline(shapes, dt, args.prompts, prompt_len, args.max_tokens, bandwidth, flops, prefill)
        roof.update(gemm_GFLOPs=flops / 1e9, gemm_GFLOPs_m512=prefill / 1e9,
                    torch_linear_GFLOPs=gemm_flops(shapes, args.prompts, dt, kernel="torch") / 1e9,
                    ratio=result["tokens_per_s"][dt] / roof["tokens_per_s"],
                    decode_ratio=result["decode_tokens_per_s"][dt] / roof["decode_tokens_per_s"])
        result["roofline"][dt] = roof
    result["load_average_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.model.name}: {args.prompts} prompts x {args.max_tokens} tokens (ignore_eos), median of "
          f"{args.reps}; torch threads {result['torch_threads']}; CPU flags {' '.join(result['cpu_flags'])}")
    print(f"read bandwidth {result['read_bandwidth_GBps']:.1f} GB/s; matmul params {shapes['matmul_params']/1e6:.1f}M; "
          f"load average {result['load_average']:.1f} (start) / {result['load_average_end']:.1f} (end)")
    print("| dtype | rollout tok/s (roofline, ratio) | decode tok/s (roofline, ratio) | oneDNN GFLOP/s M=B / M=512 "
          "(torch linear M=B) | decode step: memory / compute ms |")
    print("|---|---|---|---|---|")
    for dt in args.dtypes:
        r = result["roofline"][dt]
        print(f"| {dt} | {result['tokens_per_s'][dt]:.1f} ({r['tokens_per_s']:.0f}, {100 * r['ratio']:.0f} %) | "
              f"{result['decode_tokens_per_s'][dt]:.1f} ({r['decode_tokens_per_s']:.0f}, "
              f"{100 * r['decode_ratio']:.0f} %) | {r['gemm_GFLOPs']:.0f} / {r['gemm_GFLOPs_m512']:.0f} "
              f"({r['torch_linear_GFLOPs']:.0f}) | {1e3 * r['t_memory_s']:.1f} / {1e3 * r['t_compute_s']:.1f} "
              f"({r['bound']}-bound) |")
    if result["profile"]:
        prof = result["profile"]
        print(f"profile of one {args.dtypes[0]} generate ({prof['wall_s']:.2f} s): " + ", ".join(
            f"{g} {100 * s:.0f} %" for g, s in prof["shares"].items()))
        for name, s in prof["top_ops"]:
            print(f"  {s:8.3f} s  {name}")


def cpu_flags() -> list[str]:
    """The flags that decide the engine dtype (and AVX-512 itself), for the record."""
    from portable_rl.engines.cpu_features import cpu_flags as all_flags

    return sorted(f for f in all_flags() if f.startswith(("avx512_bf16", "amx", "avx512f")))


if __name__ == "__main__":
    main()
