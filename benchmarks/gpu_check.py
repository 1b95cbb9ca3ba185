"""One short GPU check (H200): learner MFU, zero-copy DLPack JAX -> torch, trainer-side FP8 / INT8 quantizer GB/s.

  (i)   MFU of the jitted train step (`make_train_step` + `make_optimizer`, policy-gradient loss over
        `sequence_logprobs`) for a ~1B-parameter random Qwen2-like model, float32 master params, bf16 compute:

            model FLOPs / step = 6 * N * tokens + 12 * L * (heads * head_dim) * seq * tokens
            MFU               = model FLOPs / step time / peak

        N = parameters in matmuls (all but the input embedding; lm_head counts), tokens = rows * seq; the
        attention term counts the full (unmasked) T x S score and P.V matmuls, forward + backward (PaLM,
        appendix B), which is what the learner's attention computes. Peak: the H200's dense bf16
        989 TFLOP/s (NVIDIA H200 SXM datasheet, same tensor cores as the H100 SXM; sparsity not counted).
  (ii)  DLPack JAX -> torch on the GPU without a copy: every tensor `iter_hf_tensors` would hand an engine is
        a torch CUDA tensor whose data_ptr equals the JAX buffer's address; plus the conversion's GiB/s.
  (iii) `engines.quantize` 128x128 blockwise FP8 of every decoder projection, GB/s of bf16 input, both on
        contiguous bf16 tensors and end to end from the Flax params (cast + DLPack + transposed views).
  (iv)  the learner-side INT8 push quantizer (`learner_jax.quantize.quantize_int8_per_channel`, jitted, on
        the learner's device), GB/s of bf16 input over every projection, and end to end: the whole INT8
        push (`iter_hf_tensors(quantization="int8_per_channel")`), every int8 / scale tensor a zero-copy
        DLPack view (counted); bit-equal to the torch quantizer on one projection.

Results go to $OUT/gpu_check.json (or --out) and stdout. Each check records its own error and the others
still run; the exit status is non-zero if any failed. `--dry-run` runs everything on CPU with a tiny model
(for testing this script; its MFU means nothing).

    python -m benchmarks.gpu_check [--dry-run] [--rows 8 --seq 1024] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

from benchmarks import bench_common

H200_BF16_DENSE_PEAK = 989e12  # FLOP/s

# ~1.0B parameters: 20 layers, d=2048, SwiGLU 5504, 16 q heads / 4 kv heads of 128, vocab 32000, untied.
MODEL_1B = dict(family="qwen2", vocab_size=32000, hidden_size=2048, intermediate_size=5504,
                num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                tie_word_embeddings=False, rope_theta=1_000_000.0)
MODEL_TINY = dict(family="qwen2", vocab_size=128, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=False, rope_theta=1_000_000.0)


def fail(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def check_environment(dry_run: bool) -> dict:
    """Imports and devices; exits at once with a clear message if the machine cannot run the checks."""
    missing = []
    for mod in ("jax", "flax", "optax", "torch", "numpy"):
        try:
            __import__(mod)
        except Exception as e:  # noqa: BLE001  (report any import failure the same way)
            missing.append(f"{mod} ({type(e).__name__}: {e})")
    if missing:
        fail(f"cannot import {', '.join(missing)}; install jax[cuda], flax, optax and torch")
    try:
        import portable_rl.learner_jax.step  # noqa: F401
    except Exception as e:  # noqa: BLE001
        fail(f"cannot import portable_rl ({type(e).__name__}: {e}); run `python -m benchmarks.gpu_check` from "
             f"the repository root, or `pip install --no-deps -e .`")
    import jax
    import torch

    env = {"python": platform.python_version(), "jax": jax.__version__, "torch": torch.__version__,
           "jax_devices": [str(d) for d in jax.devices()], "jax_backend": jax.default_backend(),
           "torch_cuda": torch.cuda.is_available(), "dry_run": dry_run}
    if not dry_run:
        if jax.default_backend() not in ("gpu", "cuda"):
            fail(f"JAX sees no GPU (backend {jax.default_backend()!r}, devices {env['jax_devices']}); "
                 f"install jax[cuda12] or use --dry-run on CPU")
        if not torch.cuda.is_available():
            fail("torch.cuda.is_available() is False; a CUDA build of torch is needed for the DLPack and "
                 "quantizer checks (or use --dry-run on CPU)")
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


# ----------------------------------------------------------------------------------------------- (i)
def build_model(dims: dict):
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl.learner_jax.config import ModelConfig
    from portable_rl.learner_jax.model import Transformer

    config = ModelConfig(**dims)
    model = Transformer(config, param_dtype=jnp.float32, compute_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    return model, config


def matmul_params(model, config) -> tuple[int, int]:
    """(all parameters, parameters in matmuls = all minus the input embedding)."""
    import jax
    from flax import nnx

    total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    embedding = config.vocab_size * config.hidden_size
    tied_lm_head = embedding if config.tie_word_embeddings else 0  # tied: the embedding is also lm_head
    return total, total - embedding + tied_lm_head


def train_step_flops(config, n_matmul: int, rows: int, seq: int) -> float:
    tokens = rows * seq
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq * tokens
    return 6.0 * n_matmul * tokens + attention


def check_mfu(model, config, rows: int, seq: int, reps: int, peak: float) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from portable_rl.learner_jax.logprobs import sequence_logprobs
    from portable_rl.learner_jax.optim import make_optimizer
    from portable_rl.learner_jax.step import make_train_step

    def loss_fn(model, batch):
        logp, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"])   # [B, T]
        mask = batch["response_mask"]
        return -jnp.sum(batch["advantages"][:, None] * logp * mask) / jnp.sum(mask), {}

    rng = np.random.default_rng(0)
    batch = {"input_ids": jnp.asarray(rng.integers(3, config.vocab_size, (rows, seq)), jnp.int32),
             "attention_mask": jnp.ones((rows, seq), jnp.int32),
             "response_mask": jnp.asarray(np.arange(seq)[None, :] >= seq // 4, jnp.float32).repeat(rows, 0),
             "advantages": jnp.asarray(rng.standard_normal(rows), jnp.float32)}
    optimizer = nnx.Optimizer(model, make_optimizer(learning_rate=1e-6), wrt=nnx.Param)
    train_step = make_train_step(loss_fn)

    start = time.perf_counter()
    first = jax.block_until_ready(train_step(model, optimizer, batch))
    compile_s = time.perf_counter() - start
    if not np.isfinite(float(first["loss"])):
        raise RuntimeError(f"first-step loss is {float(first['loss'])}")
    jax.block_until_ready(train_step(model, optimizer, batch))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(train_step(model, optimizer, batch))
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    n_total, n_matmul = matmul_params(model, config)
    flops = train_step_flops(config, n_matmul, rows, seq)
    del optimizer
    gc.collect()
    return {"params": n_total, "matmul_params": n_matmul, "rows": rows, "seq": seq,
            "param_dtype": "float32", "compute_dtype": "bfloat16", "compile_and_first_step_s": compile_s,
            "step_s_median": step_s, "step_s_all": times, "tokens_per_s": rows * seq / step_s,
            "model_flops_per_step": flops, "achieved_tflops": flops / step_s / 1e12,
            "peak_tflops": peak / 1e12, "mfu": flops / step_s / peak, "loss_first_step": float(first["loss"])}


# ---------------------------------------------------------------------------------------------- (ii)
def check_dlpack(model, config, expect_device: str) -> dict:
    import jax.numpy as jnp
    import torch

    from portable_rl.convert.hf import cast_params
    from portable_rl.convert.to_torch import iter_hf_tensors, jax_to_torch

    x = jnp.arange(1 << 20, dtype=jnp.bfloat16)
    t = jax_to_torch(x)
    single = {"torch_device": str(t.device), "same_data_ptr": t.data_ptr() == x.unsafe_buffer_pointer()}
    # Every tensor an engine would get: same buffer as the (cast) JAX array, on the expected device.
    mismatched, n = [], 0
    for m, array in cast_params(model, config, "bfloat16"):
        tensor = jax_to_torch(array)
        n += 1
        if tensor.data_ptr() != array.unsafe_buffer_pointer() or tensor.device.type != expect_device:
            mismatched.append(m.hf_name)
    # Conversion rate (fp32 master params -> bf16 on the device, DLPack, transposed views), GiB/s of bf16.
    n_bytes = sum(t.numel() * t.element_size() for _, t in iter_hf_tensors(model, config))

    def convert():
        tensors = [t for _, t in iter_hf_tensors(model, config)]
        if expect_device == "cuda":
            torch.cuda.synchronize()
        return tensors

    convert()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        convert()
        times.append(time.perf_counter() - start)
    ok = single["same_data_ptr"] and single["torch_device"].startswith(expect_device) and not mismatched
    return {"ok": ok, "single_array": single, "tensors_checked": n, "not_zero_copy": mismatched[:5],
            "convert_fp32_to_bf16_GiB": n_bytes / 2**30,
            "convert_GiB_per_s": n_bytes / 2**30 / statistics.median(times)}


# --------------------------------------------------------------------------------------------- (iii)
def check_quantizer(model, config, device: str, reps: int) -> dict:
    import torch

    from portable_rl.engines.quantize import (dequantize_blockwise_fp8, is_quantized_projection,
                                              quantize_blockwise_fp8, quantize_named_tensors_blockwise)
    from portable_rl.convert.to_torch import iter_hf_tensors

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn):
        fn()
        sync()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    projections = [t.contiguous() for name, t in iter_hf_tensors(model, config)
                   if is_quantized_projection(name)]
    n_projections, n_bytes = len(projections), sum(t.numel() * t.element_size() for t in projections)
    t_contiguous = timed(lambda: [quantize_blockwise_fp8(w) for w in projections])

    def from_flax():
        return list(quantize_named_tensors_blockwise(iter_hf_tensors(model, config)))

    t_flax = timed(from_flax)
    # Sanity: FP8 round trip of one projection stays within e4m3 rounding (relative step 2^-3 near amax).
    w = projections[0]
    q, scale_inv = quantize_blockwise_fp8(w)
    err = (dequantize_blockwise_fp8(q, scale_inv) - w.float()).abs().max().item()
    bound = w.float().abs().max().item() / 8
    return {"device": str(q.device), "projections": n_projections,
            "bf16_GB": n_bytes / 1e9, "contiguous_s": t_contiguous,
            "contiguous_GB_per_s": n_bytes / 1e9 / t_contiguous,
            "from_flax_s": t_flax, "from_flax_GB_per_s": n_bytes / 1e9 / t_flax,
            "roundtrip_max_abs_err": err, "roundtrip_bound": bound,
            "ok": err <= bound and q.dtype == torch.float8_e4m3fn}


def check_int8_quantizer(model, config, device: str, reps: int) -> dict:
    import jax
    import torch

    from portable_rl.convert.hf import get_param
    from portable_rl.convert.mapping import param_mappings
    from portable_rl.convert.to_torch import iter_hf_tensors
    from portable_rl.engines.quantize import is_quantized_projection, quantize_int8_per_channel as torch_int8
    from portable_rl.learner_jax.quantize import quantize_int8_per_channel

    kernels = [get_param(model, m.nnx_path)[...].astype("bfloat16") for m in param_mappings(config)
               if is_quantized_projection(m.hf_name)]
    quantize = jax.jit(quantize_int8_per_channel)
    n_bytes = sum(k.size * 2 for k in kernels)

    t_quantize = bench_common.timed(lambda: jax.block_until_ready([quantize(k) for k in kernels]), reps)

    def push():
        out = list(iter_hf_tensors(model, config, quantization="int8_per_channel"))
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    push()
    start = time.perf_counter()
    pairs = push()
    t_push = time.perf_counter() - start
    on_device = sum(t.device.type == device for _, t in pairs)
    q, scale, _ = quantize(kernels[0])
    q_t, s_t = torch_int8(torch.from_dlpack(kernels[0]).T.float().cpu())
    equal = bool(torch.equal(torch.from_dlpack(q).T.cpu(), q_t) and torch.equal(torch.from_dlpack(scale).cpu(), s_t[:, 0]))
    push_bytes = sum(t.numel() * t.element_size() for _, t in pairs)
    return {"projections": len(kernels), "bf16_GB": n_bytes / 1e9, "quantize_s": t_quantize,
            "quantize_GB_per_s": n_bytes / 1e9 / t_quantize, "push_s": t_push, "push_GB": push_bytes / 1e9,
            "tensors": len(pairs), "tensors_on_device": on_device, "bit_equal_to_torch": equal,
            "ok": equal and on_device == len(pairs)}


# --------------------------------------------------------------------------------------------- driver
def write_results(results: dict, out_dir: str) -> str:
    """Writes (or rewrites) out_dir/gpu_check.json; called after every check so a timeout keeps the rest."""
    return bench_common.write_json(out_dir, "gpu_check.json", results)


def run_check(results: dict, name: str, fn, *args) -> None:
    start = time.perf_counter()
    try:
        results[name] = fn(*args)
    except Exception as e:  # noqa: BLE001  (record and go on: one failing check must not hide the others)
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    results[name]["seconds"] = time.perf_counter() - start
    print(f"gpu_check: {name} done in {results[name]['seconds']:.1f} s: "
          f"{json.dumps({k: v for k, v in results[name].items() if k != 'traceback'})}", flush=True)
    write_results(results, results["out_dir"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model: tests this script")
    parser.add_argument("--rows", type=int, default=None, help="default 8 (dry run: 2)")
    parser.add_argument("--seq", type=int, default=None, help="default 1024 (dry run: 32)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT") or ".", help="directory for gpu_check.json")
    args = parser.parse_args()
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows = args.rows or (2 if args.dry_run else 8)
    seq = args.seq or (32 if args.dry_run else 1024)
    t0 = time.perf_counter()
    results = {"env": check_environment(args.dry_run), "out_dir": args.out, "peak_flops_source":
               "H200 SXM dense bf16 989 TFLOP/s (NVIDIA datasheet, without sparsity)"}
    device = "cpu" if args.dry_run else "cuda"
    model, config = build_model(MODEL_TINY if args.dry_run else MODEL_1B)
    run_check(results, "mfu", check_mfu, model, config, rows, seq, args.reps, H200_BF16_DENSE_PEAK)
    if "error" in results["mfu"] and "RESOURCE_EXHAUSTED" in results["mfu"]["error"] and rows > 1:
        results["mfu_first_try"] = results.pop("mfu")  # out of memory: half the rows once
        run_check(results, "mfu", check_mfu, model, config, rows // 2, seq, args.reps, H200_BF16_DENSE_PEAK)
    results["mfu"]["ok"] = results["mfu"].get("ok", "error" not in results["mfu"])
    run_check(results, "dlpack", check_dlpack, model, config, device)
    run_check(results, "fp8_quantizer", check_quantizer, model, config, device, 3)
    run_check(results, "int8_quantizer", check_int8_quantizer, model, config, device, 3)
    results["total_s"] = time.perf_counter() - t0
    results["ok"] = all(results[k].get("ok") for k in ("mfu", "dlpack", "fp8_quantizer", "int8_quantizer"))
    path = write_results(results, args.out)
    print(json.dumps(results, indent=2))
    print(f"gpu_check: wrote {path}; {'all checks ok' if results['ok'] else 'SOME CHECKS FAILED'} "
          f"in {results['total_s']:.0f} s", flush=True)
    sys.exit(0 if results["ok"] else 1)


if __name__ == "__main__":
    main()
