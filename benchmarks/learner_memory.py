"""Per-device peak memory of ONE learner update at real model sizes, from abstract shapes (nothing allocated).

The model and optimizer are built with `nnx.eval_shape` (bf16 params; `with_master_weights(make_optimizer())`
keeps f32 master params and f32 AdamW moments), every leaf is a `jax.ShapeDtypeStruct` carrying its fsdp
`NamedSharding` (`learner_jax/sharding.py`), the batch is `ShapeDtypeStruct`s split by rows over the mesh,
and each jitted function of one update is `lower(...).compile()`d for a mesh of host CPU devices
(`--xla_force_host_platform_device_count=--fsdp`, set below before JAX starts). Per compiled function f,
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

Caveat: the compiled program is XLA:CPU's, not XLA:GPU's. Both partition the same way (GSPMD) and
assign buffers with the same liveness analysis, but fusion and scheduling differ (e.g. how early
all-gathered weights are prefetched), and XLA:CPU upcasts some bf16 dots (f32 all-gathered weights, f32
matmul outputs), so read the numbers as an upper-side estimate of the GPU peak. `--cpu_scheduler memory`
switches XLA:CPU to its memory-minimising scheduler (lower at ~1k tokens per device, higher at 32k;
docs/scaling.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

# Published config.json values (Qwen/Qwen3-8B, Qwen/Qwen2.5-7B on the HF hub); `qwen2_1b` the GPU check's model;
# `tiny` for smoke tests.
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
}
OPTIM = dict(learning_rate=1e-6, weight_decay=0.1, max_grad_norm=1.0)   # the 7B/8B recipes' AdamW
GB = 1e9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3_8b", choices=sorted(MODELS))
    p.add_argument("--tokens_per_device", type=int, default=32768)
    p.add_argument("--fsdp", type=int, default=8, help="fsdp mesh size = number of host devices")
    p.add_argument("--path", default="new", choices=("new", "old", "both"))
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (same widths)")
    p.add_argument("--remat", default="full", help="new path: remat policy (learner_jax/memory.py)")
    p.add_argument("--attention_impl", default="blockwise", help="new path: attention implementation")
    p.add_argument("--micro_tokens", type=int, default=None,
                   help="new path: max_tokens_per_micro_batch per device (default: --tokens_per_device)")
    p.add_argument("--chunk_tokens", type=int, default=4096, help="new path: logprob_chunk_tokens")
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
    for name in ("tokens_per_device", "fsdp", "chunk_tokens", "segment_tokens"):
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


# --------------------------------------------------------------------------------------- abstract state
def device_bytes(x) -> int:
    """Bytes of one device's shard of a ShapeDtypeStruct / array with a sharding."""
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    return math.prod(shape) * x.dtype.itemsize


def tree_device_bytes(tree) -> int:
    import jax

    return sum(device_bytes(x) for x in jax.tree.leaves(tree))


def abstract_model_and_optimizer(config, mesh, *, model_kwargs):
    """(model, optimizer) whose arrays are sharded ShapeDtypeStructs: bf16 params, f32 master + moments."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl.learner_jax.model import Transformer
    from portable_rl.learner_jax.optim import make_optimizer, with_master_weights
    from portable_rl.learner_jax.sharding import state_shardings

    def create():
        model = Transformer(config, param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                            **model_kwargs)
        optimizer = nnx.Optimizer(model, with_master_weights(make_optimizer(**OPTIM)), wrt=nnx.Param)
        return model, optimizer

    model, optimizer = nnx.eval_shape(create)
    for module in (model, optimizer):
        state = nnx.state(module)
        shardings = state_shardings(state, mesh)
        nnx.update(module, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                        state, shardings))
    return model, optimizer


def abstract_batch(mesh, rows_per_device: int, seq: int, fields: dict):
    """{name: ShapeDtypeStruct [fsdp * rows_per_device, seq]} split by rows over the batch axes."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from portable_rl.learner_jax.sharding import batch_shards

    rows = rows_per_device * batch_shards(mesh)
    sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    return {k: jax.ShapeDtypeStruct((rows, seq), dtype, sharding=sharding) for k, dtype in fields.items()}


def compile_stats(name: str, jitted, *args) -> dict:
    """Lower + compile `jitted(*args)`; its per-device memory_analysis numbers and compile seconds."""
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    return {"name": name, "argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes),
            "xla_peak_memory_in_bytes": int(getattr(m, "peak_memory_in_bytes", -1)),
            "compile_seconds": seconds}


def combine(functions: list[dict], persistent_bytes: int) -> dict:
    """peak = max_f (argument + output - alias + temp + persistent state not among f's arguments)."""
    for f in functions:
        f["live_bytes"] = (f["argument_bytes"] + f["output_bytes"] - f["alias_bytes"] + f["temp_bytes"]
                           + persistent_bytes - f.pop("persistent_argument_bytes"))
    worst = max(functions, key=lambda f: f["live_bytes"])
    return {"peak_bytes_per_device": worst["live_bytes"], "peak_function": worst["name"],
            "temp_bytes": worst["temp_bytes"], "argument_bytes": worst["argument_bytes"],
            "output_bytes": worst["output_bytes"], "alias_bytes": worst["alias_bytes"],
            "compile_seconds": sum(f["compile_seconds"] for f in functions), "functions": functions}


# ------------------------------------------------------------------------------------------------ paths
INT_FIELDS = ("input_ids", "segment_ids", "positions")
FLOAT_FIELDS = ("response_mask", "keep_mask", "old_logprobs", "rollout_logprobs", "advantages", "tis_weights",
                "token_weights")


def rl_cfg():
    """The DAPO settings of the 7B/8B recipes (gin/recipes/dapo_seed_settings.gin) that the loss reads."""
    from portable_rl.testing.configs import dapo_config

    return dapo_config(prompt_batch_size=32, n_samples=16, mini_batch_size=32, clip_eps_low=0.2,
                      clip_eps_high=0.28, loss_aggregation="token-mean")


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
                         remat=args.remat), (micro // row, row))


def compile_update(steps: dict, model, optimizer, batch, grad_sum=None) -> dict:
    """Compiles what `rl.learner.Learner.update` runs for one mini-batch and combines each function's
    memory_analysis (module doc): `steps["train_step"]` when `grad_sum` is None (one micro-batch), else
    `steps["grad_step"]` + `steps["apply_step"]` with the f32 accumulator `grad_sum` resident. The arguments
    may be abstract (sharded ShapeDtypeStructs) or the real arrays, whose compilations a later call reuses."""
    from flax import nnx

    # the optimizer's state: step counter + opt_state (nnx.Optimizer holds no model reference)
    params, opt = tree_device_bytes(nnx.state(model, nnx.Param)), tree_device_bytes(nnx.state(optimizer))
    if grad_sum is None:
        f = compile_stats("train_step", steps["train_step"], model, optimizer, batch)
        f["persistent_argument_bytes"] = params + opt
        functions, grads = [f], 0
    else:
        grads = tree_device_bytes(grad_sum)
        g = compile_stats("grad_step", steps["grad_step"], model, batch, grad_sum)
        g["persistent_argument_bytes"] = params + grads
        a = compile_stats("apply_step", steps["apply_step"], model, optimizer, grad_sum)
        a["persistent_argument_bytes"] = params + opt + grads
        functions = [g, a]
    return {**combine(functions, params + opt + grads), "params_bytes": params, "optimizer_bytes": opt,
            "grad_accumulator_bytes": grads}


def predict_update_memory(config, mesh, memory, *, rows: int, row_tokens: int, micro_batches: int) -> dict:
    """Per-device peak of one update (module doc) of `config` under `memory`, micro-batches of [rows, row_tokens]
    per device: `compile_update` of the learner's step functions (`learner_jax.step`) on abstract sharded
    shapes, for `mesh`'s backend. Call it under `jax.set_mesh(mesh)`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl.learner_jax import step as step_lib
    from portable_rl.rl.learner import make_loss_fn

    model, optimizer = abstract_model_and_optimizer(
        config, mesh, model_kwargs=dict(attention_impl=memory.attention_impl, remat=memory.remat))
    fields = {**{k: jnp.int32 for k in INT_FIELDS}, **{k: jnp.float32 for k in FLOAT_FIELDS}}
    batch = abstract_batch(mesh, rows, row_tokens, fields)
    loss_fn = make_loss_fn(rl_cfg().loss, 1.0, memory.logprob_chunk_tokens)
    steps = dict(train_step=step_lib.make_train_step(loss_fn), grad_step=step_lib.make_grad_step(loss_fn),
                 apply_step=step_lib.make_apply_step())
    grad_sum = None if micro_batches == 1 else jax.tree.map(  # step.zero_grads, abstractly
        lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding), nnx.state(model, nnx.Param))
    out = compile_update(steps, model, optimizer, batch, grad_sum)
    out.update(micro_batches=micro_batches, rows_per_device=rows, row_tokens=row_tokens,
               knobs={"attention_impl": memory.attention_impl, "pack_sequences": memory.pack_sequences,
                      "max_tokens_per_micro_batch": memory.max_tokens_per_micro_batch,
                      "logprob_chunk_tokens": memory.logprob_chunk_tokens, "remat": memory.remat})
    return out


def measure(path: str, config, mesh, args) -> dict:
    """`predict_update_memory` for one path of the command line."""
    memory, (rows, seq) = path_memory(path, args)
    return predict_update_memory(config, mesh, memory, rows=rows, row_tokens=seq,
                                 micro_batches=args.tokens_per_device // (rows * seq))


def main(argv=None):
    args = parse_args(argv)
    # Host devices must be requested before JAX initialises its CPU backend.
    flags = f" --xla_force_host_platform_device_count={args.fsdp}"
    if args.cpu_scheduler == "memory":
        flags += " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + flags).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from portable_rl.learner_jax.config import ModelConfig
    from portable_rl.learner_jax.sharding import MeshConfig, make_mesh

    if len(jax.devices()) < args.fsdp:
        sys.exit(f"JAX sees {len(jax.devices())} devices, need --fsdp={args.fsdp}; run this script in a fresh "
                 f"process (XLA_FLAGS is set before JAX starts)")
    hf = dict(MODELS[args.model])
    if args.layers is not None:
        hf["num_hidden_layers"] = args.layers
    config = ModelConfig.from_hf_dict(hf)
    mesh = make_mesh(MeshConfig(fsdp=args.fsdp), devices=jax.devices()[:args.fsdp])
    paths = ("old", "new") if args.path == "both" else (args.path,)
    for path in paths:
        with jax.set_mesh(mesh):  # the model pins activations' rows to it (sharding.constrain_batch_rows)
            result = measure(path, config, mesh, args)
        row = {"model": args.model, "layers": config.num_hidden_layers,
               "tokens_per_device": args.tokens_per_device, "fsdp": args.fsdp, "path": path, **result,
               "jax": jax.__version__, "backend": jax.default_backend()}
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{args.model} L={config.num_hidden_layers} {args.tokens_per_device} tokens/device "
                  f"fsdp={args.fsdp} "
                  f"{path}: peak {row['peak_bytes_per_device'] / GB:.2f} GB/device ({row['peak_function']}: "
                  f"params {row['params_bytes'] / GB:.2f} + optimizer {row['optimizer_bytes'] / GB:.2f} + "
                  f"temp {row['temp_bytes'] / GB:.2f} GB), compile {row['compile_seconds']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
