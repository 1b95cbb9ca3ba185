"""Per-device peak memory of ONE learner update at real model sizes, from abstract shapes (nothing allocated).
The compile and its accounting live in portable_rl/planning/learner_peak.py (the planner uses them too:
`python -m portable_rl.plan`); this script picks a model and the knobs from the command line.

The model and optimizer are built with `nnx.eval_shape` (bf16 params; `with_master_weights(make_optimizer())`
keeps f32 master params and f32 AdamW moments; `--moment1_dtype bfloat16` keeps the first moment in bf16,
`--param_dtype float32` f32 params with no master copy, as `rl.PrecisionConfig` sets them), every leaf is a `jax.ShapeDtypeStruct` carrying its fsdp
`NamedSharding` (`learner_jax/sharding.py`), the batch is `ShapeDtypeStruct`s split by rows over the mesh,
and each jitted function of one update is `lower(...).compile()`d for a mesh of host CPU devices
(`--xla_force_host_platform_device_count=--fsdp x --expert`, set below before JAX starts). Per compiled function f,
`f.memory_analysis()` gives per-device bytes of its arguments, outputs, the outputs aliased onto donated
arguments, and its temporaries (one block: XLA's buffer assignment packs every intermediate, its reuse
included, into it):

    live(f)  = argument + output - alias + temp + (persistent state that is not an argument of f)
    peak     = max over the functions f of one update of live(f)

persistent state = params + optimizer state (+ the gradient accumulator on the micro-batch path); it is
resident during every function, so it is counted once. `peak_memory_in_bytes` of this jax's
CompiledMemoryStats is reported too (`xla_peak_memory_in_bytes`) but not used: on XLA:CPU it equals the
argument bytes (temporaries are not in it). Lowering runs under `jax.set_mesh(mesh)`, as `Learner` does, so
the model's `sharding.constrain_batch_rows` keeps activations split by rows.

Paths (`--path`):
    new   the memory-linear learner: blockwise attention, one packed row of --tokens_per_device tokens per
          device (several sequences, segment ids), the gradient-accumulation micro-batch step (micro-batches
          of --micro_tokens per device, default all of them; each function of it measured), the chunked
          logprob head (--chunk_tokens), remat (--remat, default 'full'); `--row_tokens R` lays each
          micro-batch out as rows of one R-token sequence instead (pack_sequences off: what cuDNN attention takes)
    old   the learner before it: dense attention ([B, K, G, T, T] f32 scores), the same tokens per device as
          rows of one sequence (--seq_len tokens each, default --tokens_per_device), one jitted step, no
          chunking, no remat
    both  old then new

Output: one line per path; `--json` makes each a JSON object with model, tokens_per_device, fsdp, path,
peak_bytes_per_device, the parts (params / optimizer / argument / output / alias / temp bytes), every
compiled function's numbers, the knobs, compile_seconds.

    python -m benchmarks.learner_memory --model qwen3_8b --tokens_per_device 32768 --fsdp 8 --path new --json
    python -m benchmarks.learner_memory --model qwen2_5_7b --tokens_per_device 16384 --fsdp 8 --path both
    python -m benchmarks.learner_memory --model qwen3_8b --layers 4 ...       (fewer layers, same widths)
    python -m benchmarks.learner_memory --model qwen3_30b_a3b --tokens_per_device 16384 --fsdp 8 --expert 1 \
        --moe_dispatch local --extrapolate --json
                                 (an MoE model: the experts split over fsdp x expert; the planner's 1- and
                                  2-layer compiles extrapolated to the full depth, each in a fresh process)

Mixture-of-experts models compile as they run: every expert's weights are parameters (and optimizer state),
split over the `expert` axis (E dimension) and the `fsdp` axis (hidden dimension), while the attention, the
embedding and the head split over fsdp alone (replicated over expert). `--extrapolate` uses the planner's
`predict_peak_in_subprocess` (cached like the planner's answers); without it every layer is compiled.

Caveat: the compiled program is XLA:CPU's, not XLA:GPU's. Both partition the same way (GSPMD) and
assign buffers with the same liveness analysis, but fusion and scheduling differ (e.g. how early
all-gathered weights are prefetched), and XLA:CPU upcasts some bf16 dots (f32 all-gathered weights, f32
matmul outputs), so read the numbers as an upper-side estimate of the GPU peak. `--cpu_scheduler memory`
switches XLA:CPU to its memory-minimising scheduler (lower at ~1k tokens per device, higher at 32k;
docs/scaling.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from portable_rl.planning.learner_peak import PeakRequest, predict_peak_in_subprocess, predict_update_memory

SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "portable_rl" / "planning" / "configs"

# Published config.json values (Qwen/Qwen3-8B, Qwen/Qwen2.5-7B on the HF hub, Qwen/Qwen3-30B-A3B as the planner
# ships it); `qwen2_1b` the GPU check's model; `tiny` / `tiny_moe` for smoke tests.
MODELS = {
    "qwen3_8b": {
        "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
        "tie_word_embeddings": False, "rope_theta": 1000000, "rms_norm_eps": 1e-6, "attention_bias": False,
        "max_position_embeddings": 40960, "hidden_act": "silu", "use_sliding_window": False,
    },
    "qwen2_5_7b": {
        "model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
        "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072, "hidden_act": "silu", "use_sliding_window": False,
    },
    # benchmarks/gpu_check.py's ~1.0B Qwen2-like model (not a published checkpoint)
    "qwen2_1b": {
        "model_type": "qwen2", "hidden_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5504, "vocab_size": 32000,
        "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    },
    "tiny": {
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256,
        "tie_word_embeddings": False, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
    },
    "tiny_moe": {
        "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "tie_word_embeddings": False, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
    },
    "qwen3_30b_a3b": json.loads((SHIPPED_CONFIGS / "qwen3-30b-a3b.json").read_text()),
}
GB = 1e9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3_8b", choices=sorted(MODELS))
    p.add_argument("--tokens_per_device", type=int, default=32768)
    p.add_argument("--fsdp", type=int, default=8, help="fsdp mesh size")
    p.add_argument("--expert", type=int, default=1,
                   help="expert mesh size (MoE models; divides the expert count); host devices = fsdp x expert")
    p.add_argument("--extrapolate", action="store_true",
                   help="compile 1 and 2 layers (each in a fresh process) and extrapolate, as the planner does")
    p.add_argument("--path", default="new", choices=("new", "old", "both"))
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (same widths)")
    p.add_argument("--remat", default="full", help="new path: remat policy (learner_jax/memory.py)")
    p.add_argument("--attention_impl", default="blockwise", help="new path: attention implementation")
    p.add_argument("--micro_tokens", type=int, default=None,
                   help="new path: max_tokens_per_micro_batch per device (default: --tokens_per_device)")
    p.add_argument("--chunk_tokens", type=int, default=4096, help="new path: logprob_chunk_tokens")
    p.add_argument("--moe_dispatch", default="gspmd", choices=("gspmd", "local"),
                   help="new path: MemoryConfig.moe_dispatch (MoE models; learner_jax/moe.py)")
    p.add_argument("--update_by_layer", action="store_true",
                   help="new path: MemoryConfig.update_by_layer (the optimizer update one layer at a time)")
    p.add_argument("--moment1_dtype", default=None, choices=("bfloat16", "float32"),
                   help="make_optimizer's AdamW first-moment dtype (default: the master dtype)")
    p.add_argument("--param_dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="rl.PrecisionConfig.param_dtype (master f32: float32 means no master copy)")
    p.add_argument("--segment_tokens", type=int, default=2048,
                   help="new path: tokens per packed sequence (segment ids; shapes do not depend on it)")
    p.add_argument("--row_tokens", type=int, default=None,
                   help="new path: one sequence per row of this many tokens (pack_sequences off; default: "
                        "one packed row of --micro_tokens)")
    p.add_argument("--seq_len", type=int, default=None,
                   help="old path: row length (one sequence per row; default --tokens_per_device)")
    p.add_argument("--cpu_scheduler", default="concurrency", choices=("concurrency", "memory"),
                   help="XLA:CPU's scheduler: 'concurrency' (XLA:CPU's default) or 'memory' "
                        "(--xla_cpu_enable_concurrency_optimized_scheduler=false; lower at ~1k tokens per "
                        "device, where gathered weights dominate, higher at 32k, where activations do)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args(argv)
    for name in ("tokens_per_device", "fsdp", "expert", "chunk_tokens", "segment_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    seq = args.seq_len or args.tokens_per_device
    if args.tokens_per_device % seq:
        p.error(f"--tokens_per_device={args.tokens_per_device} is not a multiple of --seq_len={seq}")
    micro = args.micro_tokens or args.tokens_per_device
    if args.tokens_per_device % micro:
        p.error(f"--tokens_per_device={args.tokens_per_device} is not a multiple of --micro_tokens={micro}")
    if args.row_tokens is not None and (args.row_tokens < 1 or micro % args.row_tokens):
        p.error(f"--micro_tokens={micro} is not a multiple of --row_tokens={args.row_tokens}")
    return args


def path_memory(path: str, args):
    """The `MemoryConfig` of a path (module doc) and (rows per device, tokens per row) of a micro-batch."""
    from portable_rl.learner_jax.memory import MemoryConfig

    if path == "old":
        seq = args.seq_len or args.tokens_per_device
        return (MemoryConfig(attention_impl="dense", pack_sequences=False, max_tokens_per_micro_batch=None,
                             logprob_chunk_tokens=None, remat="none"), (args.tokens_per_device // seq, seq))
    micro = args.micro_tokens or args.tokens_per_device
    row = args.row_tokens or micro
    return (MemoryConfig(attention_impl=args.attention_impl, pack_sequences=args.row_tokens is None,
                         max_tokens_per_micro_batch=micro, logprob_chunk_tokens=args.chunk_tokens,
                         remat=args.remat, moe_dispatch=args.moe_dispatch, update_by_layer=args.update_by_layer),
            (micro // row, row))


def measure(path: str, config, mesh, args) -> dict:
    """`predict_update_memory` for one path of the command line."""
    memory, (rows, seq) = path_memory(path, args)
    return predict_update_memory(config, mesh, memory, rows=rows, row_tokens=seq,
                                 micro_batches=args.tokens_per_device // (rows * seq),
                                 param_dtype=args.param_dtype, moment1_dtype=args.moment1_dtype)


def extrapolated(args) -> list[dict]:
    """The planner's 1- and 2-layer compiles extrapolated to the model's depth, for each path."""
    hf = dict(MODELS[args.model])
    if args.layers is not None:
        hf["num_hidden_layers"] = args.layers
    rows = []
    for path in ("old", "new") if args.path == "both" else (args.path,):
        memory, (r, seq) = path_memory(path, args)
        request = PeakRequest(hf_config=hf, mesh=(1, args.fsdp, args.expert, 1), memory=dataclasses.asdict(memory),
                              rows=r, row_tokens=seq, micro_batches=args.tokens_per_device // (r * seq),
                              param_dtype=args.param_dtype, moment1_dtype=args.moment1_dtype)
        rows.append((path, hf["num_hidden_layers"], predict_peak_in_subprocess(request)))
    return rows


def report(args, path, layers, result, extra):
    row = {"model": args.model, "layers": layers, "tokens_per_device": args.tokens_per_device, "fsdp": args.fsdp,
           "expert": args.expert, "path": path, "micro_tokens": args.micro_tokens or args.tokens_per_device,
           "moe_dispatch": args.moe_dispatch, "update_by_layer": args.update_by_layer, "param_dtype": args.param_dtype,
           "moment1_dtype": args.moment1_dtype, **result, **extra}
    if args.json:
        print(json.dumps(row), flush=True)
    else:
        print(f"{args.model} L={layers} {args.tokens_per_device} tokens/device fsdp={args.fsdp} expert={args.expert} "
              f"{path}: peak {row['peak_bytes_per_device'] / GB:.2f} GB/device ({row['peak_function']}: "
              f"params {row['params_bytes'] / GB:.2f} + optimizer {row['optimizer_bytes'] / GB:.2f} + "
              f"temp {row['temp_bytes'] / GB:.2f} GB), compile {row['compile_seconds']:.1f} s", flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.extrapolate:
        import jax

        for path, layers, result in extrapolated(args):
            report(args, path, layers, result, {"jax": jax.__version__, "backend": "cpu"})
        return
    devices = args.fsdp * args.expert
    # Host devices must be requested before JAX initialises its CPU backend.
    flags = f" --xla_force_host_platform_device_count={devices}"
    if args.cpu_scheduler == "memory":
        flags += " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + flags).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from portable_rl.learner_jax.config import ModelConfig
    from portable_rl.learner_jax.sharding import MeshConfig, make_mesh

    if len(jax.devices()) < devices:
        sys.exit(f"JAX sees {len(jax.devices())} devices, need --fsdp x --expert = {devices}; run this script in a "
                 f"fresh process (XLA_FLAGS is set before JAX starts)")
    hf = dict(MODELS[args.model])
    if args.layers is not None:
        hf["num_hidden_layers"] = args.layers
    config = ModelConfig.from_hf_dict(hf)
    mesh = make_mesh(MeshConfig(fsdp=args.fsdp, expert=args.expert), devices=jax.devices()[:devices])
    paths = ("old", "new") if args.path == "both" else (args.path,)
    for path in paths:
        with jax.set_mesh(mesh):  # the model pins activations' rows to it (sharding.constrain_batch_rows)
            result = measure(path, config, mesh, args)
        report(args, path, config.num_hidden_layers, result,
               {"jax": jax.__version__, "backend": jax.default_backend()})


if __name__ == "__main__":
    main()
