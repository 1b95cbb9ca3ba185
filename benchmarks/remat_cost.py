"""Step-time cost of the learner's memory knobs on CPU: remat policies and the chunked logprob head.

Work per call (one jitted function per variant, same random model and batch for all of them):

    loss  = -sum_{b,t} logp[b, t] * mask[b, t] / sum mask,   logp = sequence_logprobs(model, ids, mask)
    call  = jax.value_and_grad(loss) w.r.t. all params       (forward + backward, no optimizer update)

Variants: remat in {none, full, dots_saveable, dots_with_no_batch_dims_saveable} with the unchunked head,
and chunk_tokens in {None, 256, 1024} with remat='none' (`Transformer(remat=)`, `sequence_logprobs(
chunk_tokens=)`). Every variant is compiled first, then the variants are called round-robin (one call
each per round, `block_until_ready`), so background load on a shared box hits all alike; the table is
the median over `--reps` rounds, the ratio is against the first variant (remat='none', no chunk).
`cpu_ms` is the process CPU time of the call (all XLA threads; `time.process_time`): the work done,
which a loaded shared box distorts far less than wall time.
`temp_MiB` is the compiled program's temporaries (`memory_analysis()`, XLA:CPU), what the knob buys.
The 1-minute load average before/after is recorded.

Model: a random Qwen3-style decoder built in memory (`--layers 4 --hidden 512 --intermediate 1536
--heads 8 --vocab 16384`, tied embeddings: ~21M params), float32 params, bf16 compute, attention
`--attention_impl` (default 'auto': blockwise on CPU).

    python -m benchmarks.remat_cost [--rows 4 --seq 256] [--reps 9] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.bench_common import add_model_size_args
from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.logprobs import sequence_logprobs
from portable_rl.learner_jax.model import Transformer

# (name, remat, chunk_tokens); the first is the baseline of the ratios.
VARIANTS = (("none", "none", None), ("full", "full", None), ("dots_saveable", "dots_saveable", None),
            ("dots_with_no_batch_dims_saveable", "dots_with_no_batch_dims_saveable", None),
            ("chunk 256", "none", 256), ("chunk 1024", "none", 1024))


def make_batch(rows: int, seq: int, vocab: int, seed: int = 0):
    """Right-padded rows of random length in [seq/2, seq]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq // 2, seq + 1, rows)
    mask = (np.arange(seq)[None] < lengths[:, None]).astype(np.int32)
    return jnp.asarray(rng.integers(3, vocab, (rows, seq)), jnp.int32), jnp.asarray(mask)


def compiled_variant(config, params_state, ids, mask, remat, chunk_tokens, attention_impl):
    """(jitted value_and_grad on the shared params, its compiled temp bytes)."""
    model = Transformer(config, param_dtype=jnp.float32, compute_dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                        attention_impl=attention_impl, remat=remat)
    graphdef, _ = nnx.split(model)

    def loss(state, ids, mask):
        logp, _ = sequence_logprobs(nnx.merge(graphdef, state), ids, mask, chunk_tokens=chunk_tokens)
        valid = mask[:, 1:].astype(jnp.float32)
        return -jnp.sum(logp[:, 1:] * valid) / jnp.sum(valid)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params_state, ids, mask).compile()
    return (lambda: compiled(params_state, ids, mask)), compiled.memory_analysis().temp_size_in_bytes, model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_size_args(parser, layers=4, hidden=512, intermediate=1536, heads=8, vocab=16384)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--attention_impl", default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    config = ModelConfig(family="qwen3", vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
                         head_dim=args.hidden // args.heads, tie_word_embeddings=True)
    ids, mask = make_batch(args.rows, args.seq, args.vocab)
    _, state = nnx.split(Transformer(config, param_dtype=jnp.float32, compute_dtype=jnp.bfloat16,
                                     rngs=nnx.Rngs(0)))
    params = sum(x.size for x in jax.tree.leaves(state))

    load_before = os.getloadavg()[0]
    calls, temp, losses, impl = {}, {}, {}, None
    for name, remat, chunk in VARIANTS:
        calls[name], temp[name], model = compiled_variant(config, state, ids, mask, remat, chunk,
                                                          args.attention_impl)
        impl = model.attention_impl
        losses[name] = float(jax.block_until_ready(calls[name]())[0])   # warm-up call
    times = {name: [] for name in calls}
    cpu_times = {name: [] for name in calls}
    for _ in range(args.reps):
        for name, call in calls.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - start_cpu)
    load_after = os.getloadavg()[0]

    base = statistics.median(times[VARIANTS[0][0]])
    base_cpu = statistics.median(cpu_times[VARIANTS[0][0]])
    rows = [{"variant": name, "remat": remat, "chunk_tokens": chunk,
             "step_ms": 1e3 * statistics.median(times[name]),
             "ratio": statistics.median(times[name]) / base,
             "cpu_ms": 1e3 * statistics.median(cpu_times[name]),
             "cpu_ratio": statistics.median(cpu_times[name]) / base_cpu,
             "temp_MiB": temp[name] / 2**20, "loss": losses[name]} for name, remat, chunk in VARIANTS]
    # Every knob computes the same function: a different loss means a broken variant, not a cost.
    spread = max(abs(r["loss"] - rows[0]["loss"]) for r in rows)
    result = {"device": str(jax.devices()[0]), "params": params, "layers": args.layers, "hidden": args.hidden,
              "vocab": args.vocab, "rows": args.rows, "seq": args.seq, "attention_impl": impl,
              "reps": args.reps, "load_before": load_before, "load_after": load_after,
              "max_loss_difference": spread, "variants": rows}
    if spread > 1e-2 * abs(rows[0]["loss"]):
        raise SystemExit(f"variants disagree on the loss by {spread} (> 1%): {json.dumps(rows)}")
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['device']}  {params / 1e6:.1f}M params  batch {args.rows}x{args.seq}  attention {impl}  "
          f"median of {args.reps}  load {load_before:.1f} -> {load_after:.1f}")
    print(f"{'variant':<34} {'step ms':>9} {'ratio':>7} {'cpu ms':>9} {'cpu ratio':>9} {'temp MiB':>9}")
    for r in rows:
        print(f"{r['variant']:<34} {r['step_ms']:>9.1f} {r['ratio']:>7.2f} {r['cpu_ms']:>9.1f} "
              f"{r['cpu_ratio']:>9.2f} {r['temp_MiB']:>9.1f}")


if __name__ == "__main__":
    main()
