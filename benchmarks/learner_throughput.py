"""Learner throughput on ragged RL batches: real (non-padding) tokens per second of one learner update.

One batch of `--sequences` rollouts (prompt of `--prompt_tokens` + a response whose length is drawn
from a lognormal, clipped to [16, 2048] tokens, seeded), one random untied Qwen2 checkpoint
(`bench_common.random_qwen2_checkpoint`, ~30M params by default), and three ways to run one update
(forward + backward + clip + AdamW) over it:

    new    `rl.learner.Learner` with the memory-linear layout: sequences packed into rows (segment ids),
           blockwise attention, chunked logprob head, `--micro_tokens` per micro-batch
    old    the same `Learner` with the old layout: one row per sequence padded to a power of two,
           dense attention, one jitted call, no chunking
    torch  HF transformers + torch the way users run it: `AutoModelForCausalLM` (sdpa attention) on rows
           padded to the batch's longest sequence with `attention_mask`, `torch.optim.AdamW`,
           `clip_grad_norm_`, the same clipped policy loss with token-mean weights

    tokens/s = real tokens of the batch (prompt + response, no padding) / median update seconds

Same work: at the first update every policy equals the behaviour policy (the rollout logprobs are set
to the learner's own logprobs, so TIS weights are 1), so the three gradients are the same gradient;
their pre-clip norms must agree with torch's (fp32 1e-3, bf16 3e-2 relative) or the script exits non-zero.
dtypes: `fp32` = f32 params and compute; `bf16` = bf16 matmuls (ours: compute_dtype=bfloat16 with f32
params; torch: `torch.autocast("cpu", torch.bfloat16)`). `--dtypes bf16,fp32` measures both per side and
the ratio is best vs best. Each side runs in its own spawned process (XLA's and torch's thread pools never
compete); the parent asks for one update at a time, alternating sides, so load on a shared box hits
all of them alike; medians of `--reps` after one warm-up update. The sides of one dtype run together
(alternating); dtypes run one after another (fewer processes in memory at once).

    python -m benchmarks.learner_throughput [--sequences 16] [--dtypes bf16,fp32] [--reps 3] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.bench_common import add_model_size_args, random_qwen2_checkpoint, serve_timed_steps

SIDES = ("new", "old", "torch")
GRAD_NORM_RTOL = {"fp32": 1e-3, "bf16": 3e-2}
OPTIM = dict(learning_rate=1e-5, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=1.0)
CLIP = (0.2, 0.28)  # clip-higher eps low / high (the DAPO recipes)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_size_args(p, layers=4, hidden=384, intermediate=1024, heads=6)
    p.add_argument("--sequences", type=int, default=16, help="rollouts in the batch (one mini-batch)")
    p.add_argument("--prompt_tokens", type=int, default=64)
    p.add_argument("--median_response", type=float, default=160.0, help="lognormal median (tokens)")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma")
    p.add_argument("--min_response", type=int, default=16)
    p.add_argument("--max_response", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro_tokens", type=int, default=None,
                   help="new path: max_tokens_per_micro_batch (default: one micro-batch)")
    p.add_argument("--chunk_tokens", type=int, default=1024, help="new path: logprob_chunk_tokens")
    p.add_argument("--attention_impl", default="blockwise", help="new path attention")
    p.add_argument("--remat", default="none", help="new path remat (CPU memory is not the limit here)")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma list of fp32, bf16")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma list of {SIDES}")
    p.add_argument("--arms", default=None,
                   help="comma list of side:dtype (e.g. new:bf16,old:bf16,torch:bf16,torch:fp32); "
                        "default: every side x every dtype")
    p.add_argument("--reps", type=int, default=3, help="timed updates per side (alternating)")
    p.add_argument("--torch_threads", type=int, default=os.cpu_count())
    p.add_argument("--workdir", default=None, help="where the checkpoint goes (reused if present)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    bad = [d for d in args.dtypes.split(",") if d not in GRAD_NORM_RTOL] + \
          [s for s in args.sides.split(",") if s not in SIDES]
    if bad:
        p.error(f"unknown dtype/side {bad}; dtypes: {sorted(GRAD_NORM_RTOL)}, sides: {SIDES}")
    if not 1 <= args.min_response <= args.max_response:
        p.error("need 1 <= --min_response <= --max_response")
    return args


def make_rollouts(args) -> dict:
    """Seeded ragged rollouts: token ids, lognormal response lengths in [min, max], advantages."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(args.median_response), args.sigma, args.sequences)),
                      args.min_response, args.max_response).astype(int)
    top = min(args.vocab, 98)  # ids any tokenizer of make_tiny_checkpoint knows
    prompts = [rng.integers(3, top, args.prompt_tokens).tolist() for _ in lengths]
    responses = [rng.integers(3, top, n).tolist() for n in lengths]
    advantages = rng.standard_normal(args.sequences).astype(np.float32)
    advantages -= advantages.mean()
    return {"prompts": prompts, "responses": responses, "advantages": advantages.tolist(),
            "response_lengths": lengths.tolist()}


# ------------------------------------------------------------------------------------------------ ours
def jax_side(side: str, ckpt: str, dtype: str, rollouts: dict, args):
    """(update() -> metrics, first-update metrics) for our Learner with the `side`'s memory layout."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from portable_rl import tis
    from portable_rl.convert import load_hf_model
    from portable_rl.learner_jax.memory import MemoryConfig
    from portable_rl.learner_jax.optim import make_optimizer
    from portable_rl.rl.batching import pack_rollouts
    from portable_rl.rl.dapo import dapo_config
    from portable_rl.rl.learner import Learner

    if side == "new":
        memory = MemoryConfig(attention_impl=args.attention_impl, pack_sequences=True,
                              max_tokens_per_micro_batch=args.micro_tokens,
                              logprob_chunk_tokens=args.chunk_tokens, remat=args.remat)
    else:
        memory = MemoryConfig(attention_impl="dense", pack_sequences=False, max_tokens_per_micro_batch=None,
                              logprob_chunk_tokens=None, remat="none")
    compute = jnp.float32 if dtype == "fp32" else jnp.bfloat16
    model, _ = load_hf_model(ckpt, param_dtype=jnp.float32, compute_dtype=compute,
                             attention_impl=memory.attention_impl, remat=memory.remat)
    optimizer = nnx.Optimizer(model, make_optimizer(**OPTIM), wrt=nnx.Param)
    n = len(rollouts["prompts"])
    cfg = dapo_config(prompt_batch_size=1, n_samples=n, mini_batch_size=1, clip_eps_low=CLIP[0],
                     clip_eps_high=CLIP[1], loss_aggregation="token-mean")
    correction = tis.RolloutCorrectionConfig(mode="token", clip=2.0)
    learner = Learner(model, optimizer, cfg, correction, memory=memory)
    zeros = [[0.0] * len(r) for r in rollouts["responses"]]
    view = pack_rollouts(rollouts["prompts"], rollouts["responses"], zeros, rollouts["advantages"])
    # The behaviour policy is the learner itself: rollout logprobs := its own, so TIS weights are 1.
    old = learner.old_logprobs(view)  # (prepare leaves the first mini-batch's to its update: rl/learner.py)
    view["rollout_logprobs"] = np.where(view["response_mask"] > 0, old, 0.0).astype(np.float32)
    prepared = learner.prepare(view)

    def update():  # timing only: the same batch again, its old logprobs knowingly stale after the first
        return learner.update(dataclasses.replace(prepared, policy_version=learner.updates))

    first = update()
    return update, {"loss": first["train/loss"], "grad_norm": first["train/grad_norm"],
                    "padded_tokens": int(prepared.metrics["batch/rows"] * prepared.metrics["batch/row_tokens"]),
                    "micro_batches": int(prepared.metrics["batch/micro_batches"])}


# ----------------------------------------------------------------------------------------------- torch
def torch_side(ckpt: str, dtype: str, rollouts: dict, args):
    """(update(), first-update metrics) for HF transformers + torch AdamW on rows padded to the longest."""
    import contextlib

    import numpy as np
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    model.train()
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIM["learning_rate"], betas=(OPTIM["b1"], OPTIM["b2"]),
                                  eps=OPTIM["eps"], weight_decay=OPTIM["weight_decay"])
    seqs = [p + r for p, r in zip(rollouts["prompts"], rollouts["responses"])]
    longest = max(map(len, seqs))
    ids = np.zeros((len(seqs), longest), np.int64)
    attn = np.zeros_like(ids)
    resp = np.zeros((len(seqs), longest), np.float32)
    for i, (s, p) in enumerate(zip(seqs, rollouts["prompts"])):
        ids[i, :len(s)], attn[i, :len(s)], resp[i, len(p):len(s)] = s, 1, 1.0
    ids, attn, resp = map(torch.from_numpy, (ids, attn, resp))
    adv = torch.tensor(rollouts["advantages"])[:, None]                                  # [B, 1]
    weight = resp[:, 1:] / resp.sum()                                                    # token-mean ω
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()

    def update():
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits    # [B, T, V]
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())                                          # 1, with grad
        loss_t = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP[0], 1 + CLIP[1]))
        loss = (weight * loss_t).sum()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["max_grad_norm"])
        optimizer.step()
        return {"loss": float(loss.detach()), "grad_norm": float(grad_norm)}

    first = update()
    return update, dict(first, padded_tokens=int(ids.numel()), micro_batches=1)


# ---------------------------------------------------------------------------------------------- driver
def side_worker(conn, side: str, ckpt: str, dtype: str, rollouts: dict, args) -> None:
    """One side in its own process: build, report the first update, then time one update per "step"."""
    try:
        if side == "torch":
            import torch

            torch.set_num_threads(args.torch_threads)
            update, first = torch_side(ckpt, dtype, rollouts, args)
        else:
            update, first = jax_side(side, ckpt, dtype, rollouts, args)
        conn.send(("ok", first))
    except Exception as e:  # report instead of hanging the parent
        import traceback

        conn.send(("error", f"{side}/{dtype} failed: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))
        return
    serve_timed_steps(conn, update)


def run_all(arms: list[tuple[str, str]], ckpt: str, rollouts: dict, args) -> dict:
    """{(side, dtype): (first-update metrics, [update seconds])}, updates requested round-robin."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # fresh interpreters: no forked JAX / OpenMP state
    conns, procs, first = {}, [], {}
    try:
        for arm in arms:  # started one at a time: compiles do not compete
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=side_worker, args=(child, arm[0], ckpt, arm[1], rollouts, args), daemon=True)
            proc.start()
            procs.append(proc)
            status, payload = parent.recv()
            if status != "ok":
                raise RuntimeError(payload)
            conns[arm], first[arm] = parent, payload
            print(f"  ready {arm[0]}/{arm[1]}: first grad norm {payload['grad_norm']:.6g}", file=sys.stderr,
                  flush=True)
        times = {arm: [] for arm in arms}
        for _ in range(args.reps):
            for arm, conn in conns.items():
                conn.send("step")
                times[arm].append(conn.recv())
    finally:
        for conn in conns.values():
            conn.send("stop")
        for proc in procs:
            proc.join(timeout=30)
    return {arm: (first[arm], times[arm]) for arm in arms}


def main(argv=None):
    args = parse_args(argv)
    if args.arms:
        arms = [tuple(a.split(":")) for a in args.arms.split(",")]
        if any(len(a) != 2 or a[0] not in SIDES or a[1] not in GRAD_NORM_RTOL for a in arms):
            sys.exit(f"--arms {args.arms!r}: use side:dtype pairs, sides {SIDES}, dtypes {sorted(GRAD_NORM_RTOL)}")
    else:
        arms = [(s, d) for d in args.dtypes.split(",") for s in args.sides.split(",")]
    dtypes = list(dict.fromkeys(d for _, d in arms))
    sides = list(dict.fromkeys(s for s, _ in arms))
    workdir = args.workdir or tempfile.mkdtemp(prefix="learner_throughput_")
    ckpt = random_qwen2_checkpoint(os.path.join(workdir, f"qwen2_{args.layers}x{args.hidden}_v{args.vocab}"), args)
    rollouts = make_rollouts(args)
    real_tokens = sum(args.prompt_tokens + n for n in rollouts["response_lengths"])
    load_before = os.getloadavg()[0]
    measured = {}
    for dtype in dtypes:  # one dtype's sides at a time (alternating among them): fewer processes in RAM
        measured.update(run_all([a for a in arms if a[1] == dtype], ckpt, rollouts, args))
    load_after = os.getloadavg()[0]

    runs = []
    for (side, dtype), (first, times) in measured.items():
        median = statistics.median(times)
        runs.append({"side": side, "dtype": dtype, "update_s": median, "update_s_all": times,
                     "tokens_per_s": real_tokens / median, "first_update": first,
                     "padded_tokens": first["padded_tokens"], "micro_batches": first["micro_batches"]})
    # Same work: every arm's first pre-clip gradient norm agrees with the reference arm's (torch fp32 if
    # measured, else the first torch arm, else the first arm), to the looser of the two dtypes' tolerances.
    ref = next((r for r in runs if (r["side"], r["dtype"]) == ("torch", "fp32")),
               next((r for r in runs if r["side"] == "torch"), runs[0]))
    same_work = True
    for r in runs:
        ref_norm = ref["first_update"]["grad_norm"]
        r["grad_norm_rel_diff"] = abs(r["first_update"]["grad_norm"] - ref_norm) / max(abs(ref_norm), 1e-12)
        r["same_work"] = r["grad_norm_rel_diff"] <= max(GRAD_NORM_RTOL[r["dtype"]], GRAD_NORM_RTOL[ref["dtype"]])
        same_work &= r["same_work"]
    best = {s: max((r for r in runs if r["side"] == s), key=lambda r: r["tokens_per_s"]) for s in sides}
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu_count": os.cpu_count(),
        "params": _count_params(ckpt), "sequences": args.sequences, "real_tokens": real_tokens,
        "response_lengths": rollouts["response_lengths"], "reps": args.reps,
        "loadavg_1min": [load_before, load_after], "runs": runs, "same_work": same_work,
        "best": {s: {"dtype": r["dtype"], "tokens_per_s": r["tokens_per_s"], "update_s": r["update_s"]}
                 for s, r in best.items()},
    }
    if "torch" in best:
        result["ratio_vs_torch"] = {s: best[s]["tokens_per_s"] / best["torch"]["tokens_per_s"]
                                    for s in sides if s != "torch"}
    out = sys.stdout if args.json else sys.stderr
    for r in runs:
        print(f"{r['side']:>5} {r['dtype']}: {r['update_s']:7.3f} s/update, {r['tokens_per_s']:8.0f} real tok/s "
              f"({r['padded_tokens']} tokens computed, {r['micro_batches']} micro-batch(es)), first grad norm "
              f"{r['first_update']['grad_norm']:.6g}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(result), file=out)
    elif "ratio_vs_torch" in result:
        print(f"{real_tokens} real tokens, best vs best: " +
              ", ".join(f"{s} {v:.2f}x torch" for s, v in result["ratio_vs_torch"].items()), file=out)
    if not same_work:
        sys.exit("first-update gradient norms differ beyond tolerance: the sides did not compute the same update")


def _count_params(ckpt: str) -> int:
    import math

    from safetensors import safe_open

    with safe_open(os.path.join(ckpt, "model.safetensors"), framework="numpy") as st:
        return sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())


if __name__ == "__main__":
    main()
