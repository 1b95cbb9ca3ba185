"""Learner train-step throughput: our jitted Flax NNX step vs HF transformers (torch) on the same work.

Both sides start from the SAME random Qwen2 checkpoint (written once per size with `make_tiny_checkpoint`,
float32) and run one optimizer step on the SAME batch:

    logp[b, t] = log_softmax(model(ids)[b, t-1])[ids[b, t]]                         (next-token logprob)
    loss       = -sum_{b,t} adv[b] * logp[b, t] * mask[b, t] / sum mask             (policy gradient)
    step       = backward, clip_by_global_norm(1.0), AdamW(lr, b1, b2, eps, wd = 0)

  ours     `make_train_step` (nnx.jit) with `make_optimizer` (optax), loss via `sequence_logprobs`
  torch    `AutoModelForCausalLM.from_pretrained` (sdpa attention), `clip_grad_norm_`, `torch.optim.AdamW`

dtypes: `fp32` = float32 params and compute on both sides; `bf16` = float32 master params with bf16 matmuls
(ours: compute_dtype=bfloat16; torch: `torch.autocast("cpu", torch.bfloat16)`).
Same work: the first step's loss and pre-clip gradient norm must agree (fp32 to 1e-4 relative), else the
script exits non-zero. Timing: each side lives in its own worker process (so XLA's and torch's thread pools
never spin against each other) and the parent asks them for one step at a time, alternating (jax, torch,
jax, torch, ...), so background load on a shared box hits both alike; tokens/s = rows * seq / median step
time; ratio = ours / torch tokens/s. torch uses `torch.set_num_threads(os.cpu_count())` (--torch-threads);
JAX uses XLA's CPU thread pool (all cores). The 1-minute load average before/after is recorded.

    python -m benchmarks.learner_step [--sizes tiny,small,100m] [--dtypes fp32,bf16] [--reps 5] [--json]
                                      [--rows R --seq T]   (one batch shape for every size)

Most of the runtime is the 100m size; `--sizes tiny,small` is the quick check. Measured numbers:
docs/benchmarks.md ("Learner step vs HF transformers").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from benchmarks.bench_common import serve_timed_steps

# Checkpoint dims per size (Qwen2, tied embeddings). 100m: 12 layers, d=768, vocab 32000 -> ~100M params.
SIZES = {
    "tiny": dict(size="tiny", vocab_size=128),
    "small": dict(size="small", vocab_size=128),
    "100m": dict(size="small", vocab_size=32000, hidden_size=768, intermediate_size=2048,
                 num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, head_dim=64),
}
# (rows, seq) per size: big enough that the step is not pure dispatch, small enough for 2 cores.
BATCH = {"tiny": (16, 128), "small": (16, 128), "100m": (8, 128)}
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2}
OPTIM = dict(learning_rate=1e-5, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=1.0)


def make_batch(rows: int, seq: int, vocab: int, seed: int = 0) -> dict:
    """Right-padded rows: a prompt of seq // 4 tokens, then a response of random length."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompt = seq // 4
    lengths = rng.integers(seq // 2, seq + 1, rows)                       # valid tokens per row
    pos = np.arange(seq)[None, :]
    valid = pos < lengths[:, None]                                        # [B, T]
    return {
        "input_ids": np.where(valid, rng.integers(3, min(vocab, 98), (rows, seq)), 0).astype(np.int32),
        "attention_mask": valid.astype(np.int32),
        "response_mask": (valid & (pos >= prompt)).astype(np.float32),   # [B, T]; position 0 never counts
        "advantages": rng.standard_normal(rows).astype(np.float32),      # [B]
    }


# ------------------------------------------------------------------------------------------------ ours
def jax_side(ckpt: str, dtype: str, batch: dict):
    """Returns (step() -> metrics, first-step metrics {loss, grad_norm}) for our learner."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl.convert import load_hf_model
    from portable_rl.learner_jax.logprobs import sequence_logprobs
    from portable_rl.learner_jax.optim import make_optimizer
    from portable_rl.learner_jax.step import make_train_step

    compute = jnp.float32 if dtype == "fp32" else jnp.bfloat16
    model, _ = load_hf_model(ckpt, param_dtype=jnp.float32, compute_dtype=compute)
    optimizer = nnx.Optimizer(model, make_optimizer(**OPTIM), wrt=nnx.Param)

    def loss_fn(model, batch):
        logp, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"])  # [B, T]
        mask = batch["response_mask"]
        loss = -jnp.sum(batch["advantages"][:, None] * logp * mask) / jnp.sum(mask)
        return loss, {}

    train_step = make_train_step(loss_fn)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}

    def step():
        return jax.block_until_ready(train_step(model, optimizer, batch))

    first = step()
    return step, {"loss": float(first["loss"]), "grad_norm": float(first["grad_norm"])}


# ----------------------------------------------------------------------------------------------- torch
def torch_side(ckpt: str, dtype: str, batch: dict):
    """Returns (step(), first-step metrics {loss, grad_norm}) for HF transformers + torch AdamW."""
    import contextlib

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.train()
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIM["learning_rate"],
                                  betas=(OPTIM["b1"], OPTIM["b2"]), eps=OPTIM["eps"],
                                  weight_decay=OPTIM["weight_decay"])
    ids = torch.from_numpy(batch["input_ids"]).long()
    attn = torch.from_numpy(batch["attention_mask"]).long()
    mask = torch.from_numpy(batch["response_mask"])
    adv = torch.from_numpy(batch["advantages"])
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16"
                else contextlib.nullcontext())

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits  # [B, T, V]
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)                       # [B, T-1, V]
        logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)                           # [B, T-1]
        m = mask[:, 1:]
        loss = -(adv[:, None] * logp * m).sum() / mask.sum()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["max_grad_norm"])
        optimizer.step()
        return {"loss": float(loss.detach()), "grad_norm": float(grad_norm)}

    first = step()
    return step, first


# ---------------------------------------------------------------------------------------------- driver
def side_worker(conn, side: str, ckpt: str, dtype: str, batch: dict, torch_threads: int) -> None:
    """One side in its own process: build, report the first step, then time one step per "step" message.

    Separate processes keep XLA's and torch's thread pools from spinning against each other; the idle
    side sleeps in `conn.recv()`.
    """
    try:
        if side == "torch":
            import torch

            torch.set_num_threads(torch_threads)
        step, first = (jax_side if side == "jax" else torch_side)(ckpt, dtype, batch)
        conn.send(("ok", first))
    except Exception as e:  # report instead of hanging the parent
        conn.send(("error", f"{side} side failed: {type(e).__name__}: {e}"))
        return
    serve_timed_steps(conn, step)


def interleaved_medians(conns: dict, reps: int, warmup: int = 1) -> dict:
    """{side: median step seconds}, steps requested alternately (jax, torch, jax, torch, ...)."""
    times = {side: [] for side in conns}
    for i in range(warmup + reps):
        for side, conn in conns.items():
            conn.send("step")
            t = conn.recv()
            if i >= warmup:
                times[side].append(t)
    return {side: statistics.median(ts) for side, ts in times.items()}


def count_params(ckpt: str) -> int:
    import math

    from safetensors import safe_open

    with safe_open(os.path.join(ckpt, "model.safetensors"), framework="numpy") as st:
        return sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())


def bench_one(size: str, dtype: str, workdir: str, reps: int, torch_threads: int, shape=None) -> dict:
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    ckpt = os.path.join(workdir, f"qwen2_{size}")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        make_tiny_checkpoint(ckpt, "qwen2", dtype="float32", **SIZES[size])
    rows, seq = shape or BATCH[size]
    batch = make_batch(rows, seq, SIZES[size]["vocab_size"])
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # fresh interpreters: no forked JAX / OpenMP state
    conns, procs, first = {}, [], {}
    try:
        for side in ("jax", "torch"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=side_worker, args=(child, side, ckpt, dtype, batch, torch_threads),
                               daemon=True)
            proc.start()
            status, payload = parent.recv()
            if status != "ok":
                raise RuntimeError(payload)
            conns[side], first[side] = parent, payload
            procs.append(proc)
        load_before = os.getloadavg()[0]
        medians = interleaved_medians(conns, reps)
        load_after = os.getloadavg()[0]
    finally:
        for conn in conns.values():
            conn.send("stop")
        for proc in procs:
            proc.join(timeout=30)
    jax_first, torch_first = first["jax"], first["torch"]
    t_jax, t_torch = medians["jax"], medians["torch"]
    rel = {k: abs(jax_first[k] - torch_first[k]) / max(abs(torch_first[k]), 1e-12) for k in jax_first}
    same_work = all(r <= LOSS_RTOL[dtype] for r in rel.values())
    tokens = rows * seq
    return {
        "size": size, "dtype": dtype, "params": count_params(ckpt), "rows": rows, "seq": seq,
        "first_step": {"jax": jax_first, "torch": torch_first, "rel_diff": rel, "rtol": LOSS_RTOL[dtype],
                       "same_work": same_work},
        "jax_step_s": t_jax, "torch_step_s": t_torch,
        "jax_tokens_per_s": tokens / t_jax, "torch_tokens_per_s": tokens / t_torch,
        "ratio": t_torch / t_jax, "loadavg_1min": [load_before, load_after],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small,100m", help=f"comma list of {sorted(SIZES)}")
    parser.add_argument("--dtypes", default="fp32", help="comma list of fp32, bf16")
    parser.add_argument("--reps", type=int, default=5, help="timed steps per side (alternating)")
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count(),
                        help="torch.set_num_threads for the torch side (default: the core count)")
    parser.add_argument("--rows", type=int, default=None, help="override the per-size batch rows")
    parser.add_argument("--seq", type=int, default=None, help="override the per-size sequence length")
    parser.add_argument("--workdir", default=None, help="where checkpoints go (reused if present)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    sizes, dtypes = args.sizes.split(","), args.dtypes.split(",")
    shape = (args.rows, args.seq) if args.rows and args.seq else None
    bad = [s for s in sizes if s not in SIZES] + [d for d in dtypes if d not in LOSS_RTOL]
    if bad:
        sys.exit(f"unknown size/dtype {bad}; sizes: {sorted(SIZES)}, dtypes: {sorted(LOSS_RTOL)}")

    import jax
    import torch

    workdir = args.workdir or tempfile.mkdtemp(prefix="learner_step_")
    results = {"device": str(jax.devices()[0]), "cpu_count": os.cpu_count(),
               "torch_threads": args.torch_threads, "jax": jax.__version__, "torch": torch.__version__,
               "reps": args.reps, "runs": []}
    for size in sizes:
        for dtype in dtypes:
            results["runs"].append(bench_one(size, dtype, workdir, args.reps, args.torch_threads, shape))
            r = results["runs"][-1]
            print(f"{size:>5} {dtype} {r['params'] / 1e6:7.1f}M  {r['rows']}x{r['seq']}  "
                  f"ours {r['jax_step_s'] * 1e3:8.1f} ms ({r['jax_tokens_per_s']:8.0f} tok/s)  "
                  f"torch {r['torch_step_s'] * 1e3:8.1f} ms ({r['torch_tokens_per_s']:8.0f} tok/s)  "
                  f"ratio {r['ratio']:.2f}x  first-step loss {r['first_step']['jax']['loss']:.6f} vs "
                  f"{r['first_step']['torch']['loss']:.6f} "
                  f"({'same' if r['first_step']['same_work'] else 'DIFFERENT'})",
                  file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(results))
    else:
        print(f"device {results['device']}, {results['cpu_count']} cores, torch threads "
              f"{results['torch_threads']}, medians of {args.reps} alternating steps; target ratio >= 1.5x")
    if not all(r["first_step"]["same_work"] for r in results["runs"]):
        sys.exit("first-step loss / grad norm differ between JAX and torch beyond tolerance: not the same work")


if __name__ == "__main__":
    main()
