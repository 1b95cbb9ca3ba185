"""One short GPU check: the learner's MFU as the recipes run it, and the quantize-and-push path.

Learner arms (ARMS, in priority order). Each arm is one fresh child process, so its peak memory is its own
and an out-of-memory or a crash costs that arm only. It runs `rl.learner.Learner.update`, the learner's
half of a training step: bf16 params with f32 master weights in AdamW (`optim.with_master_weights`, the
7B/8B recipes), the DAPO clip-higher loss with token TIS (C = 2), the first mini-batch's old logprobs from
the update's own forward (`old_logprobs_from_update`, so there is no separate old-logprob pass), on sequences
of 2048 tokens (512 prompt + 1536 response, random ids) of a random model, with the arm's memory knobs
(`learner_jax.memory.MemoryConfig`: attention, packed rows, micro-batches, logprob head chunk, remat):

    tokens/s        = real tokens / median update seconds (updates after the first)
    model FLOPs     = 6 · N · tokens + 6 · L · heads · head_dim · Σ_s len_s²
    MFU             = model FLOPs / update seconds / peak

N = parameters in matmuls (all but the input embedding; lm_head counts); the attention term is QK^T and
P·V over the causal half of each sequence's own square, forward + backward; remat's recomputation is not
counted (model FLOPs, not hardware FLOPs). `mfu_full_attention` counts the whole T × T square instead
(12 · L · heads · head_dim · Σ_s len_s², the convention of the first GPU check). Peak: dense bf16 without
sparsity, 989 TFLOP/s for an H100 SXM or H200 (same tensor cores), 756 for an H100 PCIe, 835 for an H100
NVL (NVIDIA datasheets); another GPU needs --peak_tflops.

First, in the environment check, the learner's cuDNN attention path (`attention.lengths_attention`, rows of
one segment) against its blockwise kernel, forward and gradients (`env.cudnn_attention`); if it fails, the
arms run 'blockwise' where they ask for cuDNN, and the run reports the failure.

Memory, before anything runs: XLA's `memory_analysis` of the update's compiled functions on this device,
combined as benchmarks/learner_memory.py does (`predicted_peak_bytes`); an arm predicted not to fit in the
allocator's limit is reported and skipped (no out-of-memory tries). After the timed updates, the allocator's
`peak_bytes_in_use` (`measured_peak_bytes`). `compile_s` = lower + compile of the update's functions; the
first update reuses them (`first_update_s`). The 7B arm keeps Qwen2.5-7B's widths and cuts the layer count
to what fits: learner_memory's prediction at 1 and 2 layers on this device gives the fixed and per-layer
bytes. In the background, on a quarter of the host's cores, benchmarks/learner_memory.py predicts each 1B arm's peak as it
does for the recipes (`cpu_prediction`: XLA:CPU, blockwise attention), to set against the measured peak.

Push (one child, after the first two arms): the 1B model's bf16 params as a push reads them:
    bf16_push         every tensor `convert.to_torch.iter_hf_tensors` hands an engine shares the JAX buffer
                      (DLPack, counted), and its GB/s
    int8_quantizer    the learner-side INT8 quantizer (`learner_jax.quantize.quantize_int8_per_channel`,
                      jitted) over every projection, GB/s of bf16 input; bit-equal to the torch quantizer
    int8_push         the whole INT8 push (`export_arrays(quantization="int8_per_channel")` + DLPack): every
                      int8 weight and f32 scale a zero-copy torch view (data pointers compared, counted), GB/s
    fp8_quantizer     `engines.quantize` 128x128 blockwise FP8 (the SGLang FP8 checkpoint format) of every
                      projection in torch on the DLPack views, GB/s, contiguous and from the Flax params

Everything goes to $OUT/gpu_check.json (or --out), rewritten after every part, and a line per part on stdout.
The parent never touches the GPU; it stops starting arms when --budget_s is nearly spent (the push keeps its
turn), and exits 1 if a part failed, 2 if the machine cannot run the check (no GPU visible to JAX or torch,
a missing package), with a one-line reason. `--dry-run` runs every part on CPU with a tiny model and
64-token sequences ('cudnn' runs as 'blockwise'): it tests this script; its numbers mean nothing.

    python -m benchmarks.gpu_check [--dry-run] [--arms a,b,...] [--budget_s 290] [--reps 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

from benchmarks import bench_common
from benchmarks.learner_memory import MODELS
from portable_rl.planning.learner_peak import compile_update

# dense bf16 FLOP/s without sparsity, by a substring of torch.cuda.get_device_name (NVIDIA datasheets)
PEAK_FLOPS = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12))
MODEL_1B = MODELS["qwen2_1b"]
MODEL_7B = MODELS["qwen2_5_7b"]
MODEL_TINY = {"model_type": "qwen2", "vocab_size": 128, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "tie_word_embeddings": False, "rope_theta": 1_000_000.0}
SEQ_TOKENS, PROMPT_TOKENS = 2048, 512            # each sequence; a dry run divides token counts by 32
DRY_RUN_SCALE = 32
OPTIM = dict(learning_rate=1e-6, weight_decay=0.1, max_grad_norm=1.0)   # the 7B/8B recipes' AdamW
FIT_HEADROOM = 0.95   # of the allocator's limit an arm's predicted peak may use (fragmentation, the runtime)
GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arm:
    """One learner measurement: a model, a batch of `sequences` x 2048 tokens, the memory knobs."""
    name: str
    model: str                 # "1b" | "7b" (Qwen2.5-7B widths, layers cut to fit)
    sequences: int
    attention_impl: str        # MemoryConfig.attention_impl; "auto" is cuDNN on a GPU
    pack_sequences: bool       # packed rows of micro_tokens (several segments: attention runs blockwise)
    micro_tokens: int          # MemoryConfig.max_tokens_per_micro_batch
    chunk_tokens: int = 4096   # MemoryConfig.logprob_chunk_tokens
    remat: str = "none"


ARMS = (
    # The recipes' layout on a 1B model: packed rows ('auto' = cuDNN, which packed rows send to blockwise),
    # 2 micro-batches of 8192 tokens, a 4096-token head chunk.
    Arm(name="1b_16k_packed", model="1b", sequences=8, attention_impl="auto", pack_sequences=True,
        micro_tokens=8192),
    # One sequence per row: cuDNN flash attention actually runs.
    Arm(name="1b_16k_rows_cudnn", model="1b", sequences=8, attention_impl="cudnn", pack_sequences=False,
        micro_tokens=8192),
    # 16 x 2048 tokens: 4 micro-batches, the same per-micro-batch memory.
    Arm(name="1b_32k_rows_cudnn", model="1b", sequences=16, attention_impl="cudnn", pack_sequences=False,
        micro_tokens=8192),
    # Qwen2.5-7B's widths and vocabulary, as many layers as fit, the 7B recipe's knobs (full remat).
    Arm(name="7b_stack_16k_packed", model="7b", sequences=8, attention_impl="auto", pack_sequences=True,
        micro_tokens=8192, remat="full"),
    # The kernel alone: blockwise on the same rows as the cuDNN arm.
    Arm(name="1b_16k_rows_blockwise", model="1b", sequences=8, attention_impl="blockwise", pack_sequences=False,
        micro_tokens=8192),
    # What full remat (the 7B/8B recipes' setting) costs on the packed 1B arm.
    Arm(name="1b_16k_packed_remat", model="1b", sequences=8, attention_impl="auto", pack_sequences=True,
        micro_tokens=8192, remat="full"),
)
PUSH_AFTER = 2          # the push runs after this many arms, so a short budget never drops it
ARM_MIN_S = 45          # an arm is not started with less time left than this
PUSH_RESERVE_S = 50     # kept for the push while it has not run


def fail(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


# ------------------------------------------------------------------------------------------ environment
def check_environment(dry_run: bool) -> dict:
    """Imports and devices (in a child: the parent keeps off the GPU); exits 2 with a clear message if the
    machine cannot run the checks."""
    missing = []
    for mod in ("jax", "flax", "optax", "torch", "numpy"):
        try:
            __import__(mod)
        except Exception as e:  # noqa: BLE001  (report any import failure the same way)
            missing.append(f"{mod} ({type(e).__name__}: {e})")
    if missing:
        fail(f"cannot import {', '.join(missing)}; install jax[cuda], flax, optax and torch")
    try:
        import portable_rl.rl.learner  # noqa: F401
    except Exception as e:  # noqa: BLE001
        fail(f"cannot import portable_rl ({type(e).__name__}: {e}); run `python -m benchmarks.gpu_check` from "
             f"the repository root, or `pip install --no-deps -e .`")
    import jax
    import torch

    env = {"python": platform.python_version(), "jax": jax.__version__, "torch": torch.__version__,
           "jax_devices": [str(d) for d in jax.devices()], "jax_backend": jax.default_backend(),
           "torch_cuda": torch.cuda.is_available(), "dry_run": dry_run, "host_cpus": os.cpu_count()}
    if not dry_run:
        if jax.default_backend() not in ("gpu", "cuda"):
            fail(f"JAX sees no GPU (backend {jax.default_backend()!r}, devices {env['jax_devices']}); "
                 f"install jax[cuda12] or use --dry-run on CPU")
        if not torch.cuda.is_available():
            fail("torch.cuda.is_available() is False; a CUDA build of torch is needed for the DLPack and "
                 "quantizer checks (or use --dry-run on CPU)")
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return env


def peak_flops(gpu_name: str | None, override_tflops: float | None) -> tuple[float | None, str]:
    """(dense bf16 peak FLOP/s, where it comes from) for the GPU's name; None if unknown."""
    if override_tflops:
        return override_tflops * 1e12, "--peak_tflops"
    for key, flops in PEAK_FLOPS:
        if gpu_name and key in gpu_name:
            return flops, f"NVIDIA datasheet, {key} dense bf16 (no sparsity)"
    if gpu_name is None:  # dry run: the H200's, so the arithmetic is exercised
        return PEAK_FLOPS[0][1], "dry run: the H200's 989 TFLOP/s"
    return None, f"unknown GPU {gpu_name!r}: pass --peak_tflops"


def check_cudnn_attention(dry_run: bool) -> dict:
    """The learner's cuDNN path (`attention.lengths_attention`: rows of one segment, right padding) against its
    blockwise kernel, forward and gradients, bf16 GQA; a dry run runs the same path with XLA's implementation.
    Until it passes on a GPU, the arms run 'blockwise' where they ask for cuDNN."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from portable_rl.learner_jax import attention

    implementation = "xla" if dry_run else "cudnn"
    B, T, N, K, H = 2, 512, 8, 2, 128
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
    k, v = (jax.random.normal(key, (B, T, K, H), jnp.bfloat16) for key in keys[1:3])
    w = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
    segment_ids = jnp.asarray(np.arange(T)[None, :] < np.array([[T], [300]]), jnp.int32)   # right padding

    def run(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v, segment_ids).astype(jnp.float32) * w)
        out = jax.jit(fn)(q, k, v, segment_ids)
        return [out, *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)]

    start = time.perf_counter()
    got = run(lambda q, k, v, s: attention.lengths_attention(q, k, v, s, implementation))
    ref = run(attention.blockwise_attention)
    rel = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                 max(float(jnp.max(jnp.abs(b.astype(jnp.float32)))), 1e-30)) for a, b in zip(got, ref)]
    return {"implementation": implementation, "shape_BTNKH": [B, T, N, K, H],
            "max_rel_diff": dict(zip(("out", "dq", "dk", "dv"), rel)), "seconds": time.perf_counter() - start,
            "ok": max(rel) <= 2e-2}   # bf16 inputs and probabilities: a few ulps of 2^-8


# ------------------------------------------------------------------------------------------ learner arm
def model_config(arm: Arm, dry_run: bool, layers: int | None = None):
    from portable_rl.learner_jax.config import ModelConfig

    hf = dict(MODEL_TINY if dry_run else {"1b": MODEL_1B, "7b": MODEL_7B}[arm.model])
    if layers is not None:
        hf["num_hidden_layers"] = layers
    return ModelConfig.from_hf_dict(hf)


def memory_config(arm: Arm, dry_run: bool, cudnn: bool = True):
    """The arm's MemoryConfig; a dry run scales token counts down; 'cudnn' and 'auto' run as 'blockwise' in a
    dry run or when `cudnn` is False (the cuDNN check failed)."""
    from portable_rl.learner_jax.memory import MemoryConfig

    scale = DRY_RUN_SCALE if dry_run else 1
    no_cudnn = dry_run or not cudnn
    impl = "blockwise" if no_cudnn and arm.attention_impl in ("cudnn", "auto") else arm.attention_impl
    return MemoryConfig(attention_impl=impl, pack_sequences=arm.pack_sequences,
                        max_tokens_per_micro_batch=arm.micro_tokens // scale,
                        logprob_chunk_tokens=arm.chunk_tokens // scale, remat=arm.remat)


def micro_batch_shape(arm: Arm, dry_run: bool) -> tuple[int, int, int]:
    """(rows, tokens per row, micro-batches) of the arm's layout (all sequences have SEQ_TOKENS)."""
    scale = DRY_RUN_SCALE if dry_run else 1
    seq, micro = SEQ_TOKENS // scale, arm.micro_tokens // scale
    micro_batches = arm.sequences * seq // micro
    return (1, micro, micro_batches) if arm.pack_sequences else (micro // seq, seq, micro_batches)


def train_flops(config, n_matmul: int, lengths) -> tuple[float, float]:
    """(model FLOPs of one update with causal attention, the same counting the full T x T square)."""
    tokens = sum(lengths)
    squares = sum(n * n for n in lengths)
    attention_full = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * squares
    return 6.0 * n_matmul * tokens + attention_full / 2, 6.0 * n_matmul * tokens + attention_full


def matmul_params(config) -> tuple[int, int]:
    """(all parameters, parameters in matmuls = all minus the input embedding, lm_head included)."""
    import jax
    from flax import nnx

    from portable_rl.learner_jax.model import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    total = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    embedding = config.vocab_size * config.hidden_size
    return total, total - embedding + (embedding if config.tie_word_embeddings else 0)


def layers_that_fit(capacity: float, peak_1: float, peak_2: float, max_layers: int) -> int:
    """The most layers (<= max_layers) whose peak, linear in the layer count through the predictions at 1 and
    2 layers, stays under capacity; 0 if not even one layer fits."""
    per_layer = peak_2 - peak_1
    fixed = peak_1 - per_layer
    if per_layer <= 0:
        return max_layers if peak_2 <= capacity else 0
    return max(0, min(max_layers, int((capacity - fixed) // per_layer)))


def device_capacity(dry_run: bool) -> tuple[float, str]:
    """The allocator's limit in bytes (what an arm's predicted peak must fit), and where it comes from."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return float(stats["bytes_limit"]), "jax device memory_stats bytes_limit"
    if not dry_run:
        raise RuntimeError("the device reports no bytes_limit; cannot check that an arm fits")
    return 4 * GB, "dry run: 4 GB nominal"


def cut_layers_to_fit(arm: Arm, dry_run: bool, capacity: float, cudnn: bool) -> dict:
    """learner_memory's prediction at 1 and 2 layers of the arm's widths, on this device: the layer count that
    fits `capacity`."""
    import jax

    from portable_rl.planning.learner_peak import predict_update_memory
    from portable_rl.learner_jax.sharding import MeshConfig, make_mesh

    rows, row_tokens, micro_batches = micro_batch_shape(arm, dry_run)
    memory = memory_config(arm, dry_run, cudnn)
    mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    peaks = []
    for layers in (1, 2):
        with jax.set_mesh(mesh):
            p = predict_update_memory(model_config(arm, dry_run, layers), mesh, memory, rows=rows,
                                      row_tokens=row_tokens, micro_batches=micro_batches)
        peaks.append(p["peak_bytes_per_device"])
    max_layers = model_config(arm, dry_run).num_hidden_layers
    return {"layers": layers_that_fit(capacity * FIT_HEADROOM, *peaks, max_layers), "max_layers": max_layers,
            "predicted_peak_1_layer_bytes": peaks[0], "predicted_peak_2_layers_bytes": peaks[1]}


def rollouts(n: int, vocab: int, dry_run: bool, seed: int = 0) -> dict:
    """n sequences of SEQ_TOKENS (PROMPT_TOKENS of prompt), random ids, zero-mean advantages."""
    import numpy as np

    scale = DRY_RUN_SCALE if dry_run else 1
    seq, prompt = SEQ_TOKENS // scale, PROMPT_TOKENS // scale
    rng = np.random.default_rng(seed)
    advantages = rng.standard_normal(n).astype(np.float32)
    return {"prompts": [rng.integers(3, vocab, prompt).tolist() for _ in range(n)],
            "responses": [rng.integers(3, vocab, seq - prompt).tolist() for _ in range(n)],
            "advantages": (advantages - advantages.mean()).tolist()}


def predict_update(learner, prepared) -> dict:
    """learner_memory's `compile_update` of the learner's own step functions on the update's real arguments
    (the update then reuses the compilations)."""
    from portable_rl.learner_jax.step import zero_grads

    micro = prepared.micro_batches[0]
    steps = dict(train_step=learner._train_step, grad_step=learner._grad_step, apply_step=learner._apply_step)
    # an accumulator like the update's, freed before the update runs
    grad_sum = None if len(micro) == 1 else zero_grads(learner.model)
    return compile_update(steps, learner.model, learner.optimizer, micro[0], grad_sum)


def run_arm(arm: Arm, dry_run: bool, reps: int, peak: float | None, cudnn: bool = True) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from portable_rl import tis
    from portable_rl.learner_jax.model import Transformer
    from portable_rl.learner_jax.optim import make_optimizer, with_master_weights
    from portable_rl.rl.batching import pack_rollouts
    from portable_rl.rl.learner import Learner
    from portable_rl.rl.dapo import dapo_config

    out = {"arm": dataclasses.asdict(arm)}
    capacity, out["capacity_source"] = device_capacity(dry_run)
    out["capacity_bytes"] = capacity
    layers = None
    if arm.model == "7b":
        start = time.perf_counter()
        out["fit"] = cut_layers_to_fit(arm, dry_run, capacity, cudnn)
        out["fit"]["seconds"] = time.perf_counter() - start
        layers = out["fit"]["layers"]
        if layers == 0:
            return {**out, "skipped": "not even one layer is predicted to fit", "ok": True}
    config = model_config(arm, dry_run, layers)
    memory = memory_config(arm, dry_run, cudnn)
    out.update(layers=config.num_hidden_layers, memory=dataclasses.asdict(memory))
    model = Transformer(config, param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                        **memory.model_kwargs())
    optimizer = nnx.Optimizer(model, with_master_weights(make_optimizer(**OPTIM)), wrt=nnx.Param)
    cfg = dapo_config(prompt_batch_size=1, n_samples=arm.sequences, mini_batch_size=1, clip_eps_low=0.2,
                      clip_eps_high=0.28, loss_aggregation="token-mean")
    learner = Learner(model, optimizer, cfg, tis.RolloutCorrectionConfig(mode="token", clip=2.0), memory=memory)
    data = rollouts(arm.sequences, config.vocab_size, dry_run)
    # a random model's next-token distribution is near uniform: rollout logprobs -log V keep the TIS weights ~1
    uniform = [[-math.log(config.vocab_size)] * len(r) for r in data["responses"]]
    prepared = learner.prepare(pack_rollouts(data["prompts"], data["responses"], uniform, data["advantages"]))
    lengths = [len(p) + len(r) for p, r in zip(data["prompts"], data["responses"])]
    rows, row_tokens, micro_batches = micro_batch_shape(arm, dry_run)
    out.update(tokens=sum(lengths), micro_batches=int(prepared.metrics["batch/micro_batches"]),
               rows_per_micro_batch=rows, row_tokens=int(prepared.metrics["batch/row_tokens"]),
               padding_fraction=prepared.metrics["batch/padding_fraction"])
    if out["micro_batches"] != micro_batches or out["row_tokens"] != row_tokens:
        raise RuntimeError(f"the learner laid the batch out as {out['micro_batches']} micro-batches of rows of "
                           f"{out['row_tokens']} tokens, not the {micro_batches} of {row_tokens} this arm means")

    # XLA's memory prediction of the update, before it runs (its compilations are reused by the update)
    start = time.perf_counter()
    predicted = predict_update(learner, prepared)
    out["compile_s"] = time.perf_counter() - start
    out.update(predicted_peak_bytes=predicted["peak_bytes_per_device"], predicted=predicted)
    if predicted["peak_bytes_per_device"] > FIT_HEADROOM * capacity:
        return {**out, "ok": True, "skipped": f"predicted peak {predicted['peak_bytes_per_device'] / GB:.1f} GB > "
                f"{FIT_HEADROOM:.0%} of the allocator's {capacity / GB:.1f} GB"}

    def update():
        return learner.update(dataclasses.replace(prepared, policy_version=learner.updates))

    start = time.perf_counter()
    first = update()
    out["first_update_s"] = time.perf_counter() - start
    out.update(loss_first=first["train/loss"], grad_norm_first=first["train/grad_norm"])
    if not (np.isfinite(first["train/loss"]) and np.isfinite(first["train/grad_norm"])):
        raise RuntimeError(f"first update: loss {first['train/loss']}, grad norm {first['train/grad_norm']}")
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        update()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    n_total, n_matmul = matmul_params(config)
    flops, flops_full = train_flops(config, n_matmul, lengths)
    stats_after = jax.devices()[0].memory_stats() or {}
    out.update(params=n_total, matmul_params=n_matmul, update_s_median=step_s, update_s_all=times,
               tokens_per_s=out["tokens"] / step_s, model_flops=flops, achieved_tflops=flops / step_s / 1e12,
               mfu=flops / step_s / peak if peak else None,
               mfu_full_attention=flops_full / step_s / peak if peak else None,
               measured_peak_bytes=stats_after.get("peak_bytes_in_use"), ok=True)
    if out["measured_peak_bytes"]:
        out["measured_over_predicted"] = out["measured_peak_bytes"] / out["predicted_peak_bytes"]
    return out


def cpu_predictions(arms: list[Arm], dry_run: bool, result_path: str) -> None:
    """benchmarks/learner_memory.py's prediction of each 1B arm, on XLA:CPU (blockwise attention), one device;
    the result file is rewritten after each arm."""
    import jax

    from portable_rl.planning.learner_peak import predict_update_memory
    from portable_rl.learner_jax.sharding import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    out = {}
    for arm in arms:
        if arm.model != "1b":
            continue
        rows, row_tokens, micro_batches = micro_batch_shape(arm, dry_run)
        memory = dataclasses.replace(memory_config(arm, dry_run), attention_impl="blockwise")
        try:
            with jax.set_mesh(mesh):
                p = predict_update_memory(model_config(arm, dry_run), mesh, memory, rows=rows,
                                          row_tokens=row_tokens, micro_batches=micro_batches)
            out[arm.name] = {"peak_bytes": p["peak_bytes_per_device"], "peak_function": p["peak_function"],
                             "compile_seconds": p["compile_seconds"]}
        except Exception as e:  # noqa: BLE001  (one arm's prediction failing must not hide the others')
            out[arm.name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        bench_common.write_json(os.path.dirname(result_path), os.path.basename(result_path), out)


# ------------------------------------------------------------------------------------------------ push
def build_model(hf: dict, param_dtype="float32"):
    """(random Transformer with `param_dtype` params and bf16 compute, its ModelConfig) of an HF config dict."""
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl.learner_jax.config import ModelConfig
    from portable_rl.learner_jax.model import Transformer

    config = ModelConfig.from_hf_dict(hf)
    return Transformer(config, param_dtype=jnp.dtype(param_dtype), compute_dtype=jnp.bfloat16,
                       rngs=nnx.Rngs(0)), config


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def check_bf16_push(model, config, device: str, reps: int) -> dict:
    """Every tensor `iter_hf_tensors` hands an engine shares the JAX buffer (bf16 params: no cast)."""
    from portable_rl.convert.hf import export_arrays
    from portable_rl.convert.to_torch import iter_hf_tensors, jax_to_torch

    n, not_zero_copy, n_bytes = 0, [], 0
    for name, array, _ in export_arrays(model, config):
        tensor = jax_to_torch(array)
        n += 1
        n_bytes += tensor.numel() * tensor.element_size()
        if tensor.data_ptr() != array.unsafe_buffer_pointer() or tensor.device.type != device:
            not_zero_copy.append(name)

    def push():
        tensors = [t for _, t in iter_hf_tensors(model, config)]
        _sync(device)
        return tensors

    seconds = bench_common.timed(push, reps)
    return {"tensors": n, "zero_copy": n - len(not_zero_copy), "not_zero_copy": not_zero_copy[:5],
            "GB": n_bytes / GB, "seconds": seconds, "GB_per_s": n_bytes / GB / seconds, "ok": not not_zero_copy}


def check_int8(model, config, device: str, reps: int) -> dict:
    """The learner-side INT8 quantizer's GB/s, and the INT8 push end to end, each tensor's hand-off counted."""
    import jax
    import torch

    from portable_rl.convert.hf import export_arrays, get_param
    from portable_rl.convert.mapping import param_mappings
    from portable_rl.convert.to_torch import jax_to_torch
    from portable_rl.engines.quantize import is_quantized_projection, quantize_int8_per_channel as torch_int8
    from portable_rl.learner_jax.quantize import quantize_int8_per_channel

    kernels = [get_param(model, m.nnx_path)[...] for m in param_mappings(config) if is_quantized_projection(m.hf_name)]
    quantize = jax.jit(quantize_int8_per_channel)
    n_bytes = sum(k.size * k.dtype.itemsize for k in kernels)
    t_quantize = bench_common.timed(lambda: jax.block_until_ready([quantize(k) for k in kernels]), reps)

    def push():
        pairs = [(name, array, jax_to_torch(array)) for name, array, _ in
                 export_arrays(model, config, quantization="int8_per_channel")]
        _sync(device)
        return pairs

    t_push = bench_common.timed(push, reps)
    pairs = push()
    not_zero_copy = [name for name, array, t in pairs
                     if t.data_ptr() != array.unsafe_buffer_pointer() or t.device.type != device]
    int8 = sum(t.dtype == torch.int8 for _, _, t in pairs)
    push_bytes = sum(t.numel() * t.element_size() for _, _, t in pairs)
    q, scale, _ = quantize(kernels[0])
    q_t, s_t = torch_int8(torch.from_dlpack(kernels[0]).T.float().cpu())
    equal = bool(torch.equal(torch.from_dlpack(q).T.cpu(), q_t) and torch.equal(torch.from_dlpack(scale).cpu(), s_t[:, 0]))
    return {"projections": len(kernels), "bf16_GB": n_bytes / GB, "quantize_s": t_quantize,
            "quantize_GB_per_s": n_bytes / GB / t_quantize, "push_s": t_push, "push_bf16_GB_per_s": n_bytes / GB / t_push,
            "push_GB": push_bytes / GB, "tensors": len(pairs), "int8_tensors": int8,
            "zero_copy": len(pairs) - len(not_zero_copy), "not_zero_copy": not_zero_copy[:5],
            "bit_equal_to_torch": equal, "ok": equal and not not_zero_copy and int8 == len(kernels)}


def check_fp8_blockwise(model, config, device: str, reps: int) -> dict:
    """`engines.quantize` 128x128 blockwise FP8 of every projection (torch, on the DLPack views), GB/s."""
    import torch

    from portable_rl.convert.to_torch import iter_hf_tensors
    from portable_rl.engines.quantize import (dequantize_blockwise_fp8, is_quantized_projection,
                                              quantize_blockwise_fp8, quantize_named_tensors_blockwise)

    def timed(fn):
        return bench_common.timed(lambda: (fn(), _sync(device)), reps)

    projections = [t.contiguous() for name, t in iter_hf_tensors(model, config) if is_quantized_projection(name)]
    n_bytes = sum(t.numel() * t.element_size() for t in projections)
    t_contiguous = timed(lambda: [quantize_blockwise_fp8(w) for w in projections])
    t_flax = timed(lambda: list(quantize_named_tensors_blockwise(iter_hf_tensors(model, config))))
    w = projections[0]
    q, scale_inv = quantize_blockwise_fp8(w)
    err = (dequantize_blockwise_fp8(q, scale_inv) - w.float()).abs().max().item()
    bound = w.float().abs().max().item() / 8   # e4m3's relative step near a block's amax is 2^-3
    return {"device": str(q.device), "projections": len(projections), "bf16_GB": n_bytes / GB,
            "contiguous_GB_per_s": n_bytes / GB / t_contiguous, "from_flax_GB_per_s": n_bytes / GB / t_flax,
            "roundtrip_max_abs_err": err, "roundtrip_bound": bound,
            "ok": err <= bound and q.dtype == torch.float8_e4m3fn}


def run_push(dry_run: bool, reps: int) -> dict:
    model, config = build_model(MODEL_TINY if dry_run else MODEL_1B, "bfloat16")  # the recipes' bf16 params
    device = "cpu" if dry_run else "cuda"
    out = {}
    for name, fn in (("bf16_push", check_bf16_push), ("int8", check_int8), ("fp8_blockwise", check_fp8_blockwise)):
        start = time.perf_counter()
        try:
            out[name] = fn(model, config, device, reps)
        except Exception as e:  # noqa: BLE001  (record and go on: one failing check must not hide the others)
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        out[name]["check_s"] = time.perf_counter() - start
        gc.collect()
    out["ok"] = all(v.get("ok") for v in out.values())
    return out


# ------------------------------------------------------------------------------------------------ driver
def child(args) -> None:
    """One part in this process; its result (or error) goes to --result as JSON."""
    result = {}
    start = time.perf_counter()
    try:
        if args.part == "env":
            result = check_environment(args.dry_run)
            try:
                result["cudnn_attention"] = check_cudnn_attention(args.dry_run)
            except Exception as e:  # noqa: BLE001  (the arms then run blockwise; the parent says so)
                result["cudnn_attention"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        elif args.part == "arm":
            env = json.loads(args.env_json)
            peak, _ = peak_flops(env.get("gpu"), args.peak_tflops)
            result = run_arm(next(a for a in ARMS if a.name == args.arm), args.dry_run, args.reps, peak,
                             cudnn=env.get("cudnn_attention", {}).get("ok", False))
        elif args.part == "push":
            result = run_push(args.dry_run, args.reps)
        elif args.part == "cpu_prediction":
            cpu_predictions(list(ARMS), args.dry_run, args.result)
            return
    except Exception as e:  # noqa: BLE001  (recorded for the parent, which goes on with the other parts)
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = time.perf_counter() - start
    bench_common.write_json(os.path.dirname(args.result), os.path.basename(args.result), result)


def child_env(dry_run: bool, part: str) -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if dry_run or part == "cpu_prediction":
        env["JAX_PLATFORMS"] = "cpu"
    elif part == "push":
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # torch allocates the FP8 outputs beside JAX's buffers
    else:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # the default 0.75 leaves 35 GB of an H200 idle
    return env


def _background_cpus() -> None:
    """The background CPU prediction gets the last quarter of the host's cores at a lower priority, so the
    arms' GPU compilations (CPU-bound too) keep the rest."""
    os.nice(10)
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus[-max(1, len(cpus) // 4):])


def spawn(part: str, args, result: str, extra: list[str] = (), background: bool = False):
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--part", part, "--result", result, "--reps", str(args.reps)]
    cmd += (["--dry-run"] if args.dry_run else []) + list(extra)
    if args.peak_tflops:
        cmd += ["--peak_tflops", str(args.peak_tflops)]
    env = child_env(args.dry_run, part)
    if background:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=_background_cpus)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


_CHILD_IDS = itertools.count()


def run_child(part: str, args, workdir: str, timeout: float, extra: list[str] = ()) -> dict:
    """Runs one part in a child process; its JSON, or what went wrong (exit status, timeout, output tail)."""
    result = os.path.join(workdir, f"{part}_{next(_CHILD_IDS)}.json")
    proc = spawn(part, args, result, extra)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "output_tail": output[-3000:]}
    if proc.returncode == 2 and part == "env":
        sys.stderr.write(output)
        sys.exit(2)
    if not os.path.exists(result):
        return {"ok": False, "error": f"the child exited with status {proc.returncode} and wrote no result",
                "output_tail": output[-3000:]}
    with open(result) as f:
        return json.load(f)


def summary(arm_result: dict) -> str:
    r = arm_result
    if "error" in r:
        return f"FAILED: {r['error'][:300]}"
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    mfu = f"MFU {r['mfu']:.1%}" if r.get("mfu") is not None else "MFU unknown (no peak)"
    measured = (f", measured peak {r['measured_peak_bytes'] / GB:.1f} GB" if r.get("measured_peak_bytes") else "")
    return (f"{mfu}, {r['tokens_per_s']:,.0f} tok/s, update {r['update_s_median']:.3f} s, "
            f"{r['layers']} layers, compile {r['compile_s']:.1f} s, predicted peak "
            f"{r['predicted_peak_bytes'] / GB:.1f} GB{measured}")


def same_work(arms: dict) -> dict:
    """Arms of the same model and batch compute the same first update: pre-clip gradient norms agree (bf16)."""
    groups = {}
    for name, r in arms.items():
        if r.get("grad_norm_first") is not None:
            groups.setdefault((r["arm"]["model"], r["arm"]["sequences"], r["layers"]), []).append(
                (name, r["grad_norm_first"]))
    out = {}
    for key, members in groups.items():
        if len(members) > 1:
            ref = members[0][1]
            spread = max(abs(g - ref) / abs(ref) for _, g in members)
            out["/".join(n for n, _ in members)] = {"grad_norms": dict(members), "max_rel_diff": spread,
                                                    "ok": spread <= 3e-2}
    return out


def parent(args) -> int:
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    workdir = tempfile.mkdtemp(prefix="gpu_check_")
    env = run_child("env", args, workdir, timeout=120)
    if "error" in env:
        fail(f"the environment check failed: {env['error']}")
    peak, peak_source = peak_flops(env.get("gpu"), args.peak_tflops)
    results = {"env": env, "peak_tflops": peak / 1e12 if peak else None, "peak_source": peak_source,
               "budget_s": args.budget_s, "arms": {}, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path = bench_common.write_json(args.out, "gpu_check.json", results)
    attention = env["cudnn_attention"]
    print(f"gpu_check: cuDNN attention vs blockwise ({attention.get('implementation', 'cudnn')}): "
          + (f"max rel diff {max(attention['max_rel_diff'].values()):.2e}" if "max_rel_diff" in attention
             else attention.get("error", "")) + ("" if attention["ok"] else "; FAILED: the arms run blockwise"),
          flush=True)
    arms = [a for a in ARMS if not args.arms or a.name in args.arms.split(",")]
    cpu_result = os.path.join(workdir, "cpu_prediction.json")
    cpu_proc = spawn("cpu_prediction", args, cpu_result, background=True) if not args.no_cpu_prediction else None
    env_json = json.dumps(env)
    plan = [("arm", a) for a in arms]
    plan.insert(min(PUSH_AFTER, len(plan)), ("push", None))
    out_of_time = False  # once an arm does not fit in the budget, no later (lower-priority) arm starts
    for i, (part, arm) in enumerate(plan):
        left = deadline - time.perf_counter()
        push_pending = any(p == "push" for p, _ in plan[i + 1:])
        reserve = PUSH_RESERVE_S if push_pending else 0
        out_of_time = out_of_time or (part == "arm" and left - reserve < ARM_MIN_S)
        if part == "arm" and out_of_time:
            results["arms"][arm.name] = {"arm": dataclasses.asdict(arm), "ok": True,
                                         "skipped": f"out of time ({left:.0f} s of --budget_s left)"}
            print(f"gpu_check: {arm.name}: {results['arms'][arm.name]['skipped']}", flush=True)
            continue
        if part == "push":
            results["push"] = run_child("push", args, workdir, timeout=max(left, PUSH_RESERVE_S))
            print("gpu_check: push: " + json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "traceback"}
                                                      if isinstance(v, dict) else v
                                                      for k, v in results["push"].items()}), flush=True)
        else:
            r = run_child("arm", args, workdir, timeout=left - reserve,
                          extra=["--arm", arm.name, "--env_json", env_json])
            r.setdefault("arm", dataclasses.asdict(arm))
            results["arms"][arm.name] = r
            print(f"gpu_check: {arm.name}: {summary(r)}", flush=True)
        bench_common.write_json(args.out, "gpu_check.json", results)
    if cpu_proc is not None:
        try:
            cpu_proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            cpu_proc.kill()
        results["cpu_prediction"] = (json.load(open(cpu_result)) if os.path.exists(cpu_result) else
                                     {"error": "no prediction finished in the budget"})
        for name, p in results["cpu_prediction"].items():
            measured = results["arms"].get(name, {}).get("measured_peak_bytes")
            if isinstance(p, dict) and "peak_bytes" in p and measured:
                p["measured_over_cpu_predicted"] = measured / p["peak_bytes"]
    results["same_work"] = same_work(results["arms"])
    measured_1b = [r["mfu"] for r in results["arms"].values() if r.get("mfu") and r["arm"]["model"] == "1b"]
    results["target"] = {"what": "MFU >= 45 % at 1B with the recipe's knobs", "best_1b_mfu":
                         max(measured_1b) if measured_1b else None,
                         "met": bool(measured_1b) and max(measured_1b) >= 0.45}
    failed = (["cudnn_attention"] if not env["cudnn_attention"]["ok"] else []) + \
             [n for n, r in results["arms"].items() if not r.get("ok")] + \
             (["push"] if not results.get("push", {}).get("ok") else []) + \
             [n for n, s in results["same_work"].items() if not s["ok"]]
    results["failed"] = failed
    results["ok"] = not failed
    results["total_s"] = time.perf_counter() - t0
    bench_common.write_json(args.out, "gpu_check.json", results)
    print(f"gpu_check: best 1B MFU {results['target']['best_1b_mfu']}; wrote {path}; "
          f"{'all checks ok' if results['ok'] else 'FAILED: ' + ', '.join(failed)} in {results['total_s']:.0f} s",
          flush=True)
    return 0 if results["ok"] else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model: tests this script")
    parser.add_argument("--arms", default=None, help=f"comma list of {[a.name for a in ARMS]} (default: all, in order)")
    parser.add_argument("--budget_s", type=float, default=None,
                        help="stop starting arms after this many seconds (default 290; dry run 800)")
    parser.add_argument("--reps", type=int, default=4, help="timed updates per arm after the first")
    parser.add_argument("--peak_tflops", type=float, default=None, help="dense bf16 peak for an unlisted GPU")
    parser.add_argument("--no_cpu_prediction", action="store_true", help="skip learner_memory's CPU prediction")
    parser.add_argument("--out", default=os.environ.get("OUT") or ".", help="directory for gpu_check.json")
    # a child's arguments (set by the parent)
    parser.add_argument("--part", choices=("env", "arm", "push", "cpu_prediction"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--arm", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--env_json", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arms:
        unknown = sorted(set(args.arms.split(",")) - {a.name for a in ARMS})
        if unknown:
            parser.error(f"unknown arms {unknown}; choose from {[a.name for a in ARMS]}")
    if args.part:
        child(args)
        return
    args.budget_s = args.budget_s or (800.0 if args.dry_run else 290.0)
    sys.exit(parent(args))


if __name__ == "__main__":
    main()
