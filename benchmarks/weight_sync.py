"""Weight-sync throughput: Flax learner → vLLM, against a memcpy and a safetensors disk round trip.

All rates are bytes of the bf16 HF tensors (the payload an engine receives) per second, measured in one run:

  memcpy        one torch copy_ of a buffer of the same size (the floor: nothing can move bytes faster)
  update        one AdamW update of all params (for bf16 params: with f32 master params in the optimizer
                state, `optim.with_master_weights`, which writes the bf16 params the push then exports)
  convert       Flax params → (hf_name, torch bf16 tensor) pairs (`iter_hf_tensors`: cast on the JAX side if
                the learner's dtype differs, DLPack into torch, transposes as torch views), until every tensor
                is ready
  push          convert + `VLLMEngine.update_weights` (name/shape check, layerwise reload, re-packing,
                prefix-cache reset): what one sync costs the trainer
  disk          `save_hf_model` (safetensors into /tmp, i.e. the page cache) + vLLM `reload_weights` from
                that path: the sync a trainer would do without an in-process push
  sglang copy   convert + what the SGLang adapter does to each bucket before `update_weights_from_tensor`
                (fused-group-complete buckets of --sglang-bucket-mb, every tensor copied into torch-owned
                contiguous memory, `sglang_adapter.torch_owned`): the CPU side of the transport, without
                SGLang's own pickling (which needs the GPU engine)
  sglang fp8    the same in blockwise mode: projections quantized 128x128 (fresh tensors), the rest copied
  int8 convert  Flax params → the INT8 push (`iter_hf_tensors(quantization="int8_per_channel")`: each projection
                quantized per channel in JAX, int8 + f32 scales into torch by DLPack); its own payload in bytes
  int8 push     int8 convert + `update_weights` into an INT8 W8A8 engine (reload of int8 + scales)
  int8 bf16     the bf16 push into the same INT8 engine, which quantizes in torch (what every anchor does)

Targets: convert ≥ 0.8× memcpy, push ≥ 3× disk.

    python -m benchmarks.weight_sync [--layers 24 --hidden 1024 --intermediate 4096 --vocab 32000 --repeats 3]
    python -m benchmarks.weight_sync --param-dtype bfloat16 --sglang-only   # memcpy, convert, sglang rows
"""

import argparse
import os
import shutil
import tempfile

from benchmarks.bench_common import add_model_size_args, random_qwen2_checkpoint, timed


def optimizer_update_time(model, param_dtype: str, repeats: int) -> float:
    """One jitted AdamW update of every parameter, as the train step does it (gradients: ones).

    With bf16 params the optimizer is `with_master_weights(AdamW)`, as `train(param_dtype="bfloat16")`
    builds it: the bf16 copy the push exports is written by this update, so its cost shows here, not
    in the conversion."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl.learner_jax.optim import make_optimizer, with_master_weights

    tx = make_optimizer(learning_rate=1e-6)
    if param_dtype == "bfloat16":
        tx = with_master_weights(tx)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    update = nnx.jit(lambda m, o, g: o.update(m, g), donate_argnums=(0, 1))  # in place, as training does

    def run():
        update(model, optimizer, grads)
        jax.block_until_ready(nnx.state(model, nnx.Param))

    seconds = timed(run, repeats)
    del optimizer, grads
    return seconds


def sglang_transport_times(model, config, bucket_bytes: int, repeats: int) -> tuple[float, float]:
    """(bf16 / flash_rl, blockwise) seconds for convert + the SGLang adapter's per-bucket transport."""
    from portable_rl.engines.buckets import bucketed_groups
    from portable_rl.convert.to_torch import iter_hf_tensors
    from portable_rl.engines.sglang_adapter import transport_bucket

    def run(fp8_mode):
        for bucket in bucketed_groups(iter_hf_tensors(model, config), bucket_bytes):
            transport_bucket(bucket, fp8_mode)  # dropped before the next, as after update_weights_from_tensor

    return timed(lambda: run(None), repeats), timed(lambda: run("blockwise"), repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_size_args(parser, layers=24, hidden=1024, intermediate=4096, heads=16, vocab=32000)
    parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--sglang-bucket-mb", type=int, default=512, help="SGLangEngine's bucket_bytes default")
    parser.add_argument("--sglang-only", action="store_true", help="skip the vLLM push and the disk round trip")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import torch

    from portable_rl.convert.hf import copy_tokenizer_files, load_hf_model, save_hf_model
    from portable_rl.convert.to_torch import iter_hf_tensors
    from portable_rl.engines import SamplingConfig, create_engine

    workdir = args.workdir or tempfile.mkdtemp(prefix="weight_sync_")
    ckpt = os.path.join(workdir, "ckpt")
    random_qwen2_checkpoint(ckpt, args)
    model, config = load_hf_model(ckpt, param_dtype=jnp.dtype(args.param_dtype))
    pairs = list(iter_hf_tensors(model, config))
    n_params = sum(t.numel() for _, t in pairs)
    n_bytes = sum(t.numel() * t.element_size() for _, t in pairs)
    del pairs
    print(f"model: {n_params / 1e6:.0f}M params, {n_bytes / 2**30:.2f} GiB in bf16, "
          f"learner params {args.param_dtype}; torch threads {torch.get_num_threads()}, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")

    src = torch.empty(n_bytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    t_memcpy = timed(lambda: dst.copy_(src), args.repeats)
    del src, dst

    def convert():
        for _, tensor in iter_hf_tensors(model, config):
            pass  # torch.from_dlpack waits until the JAX computation producing the tensor is done

    t_convert = timed(convert, args.repeats)
    t_sglang, t_sglang_fp8 = sglang_transport_times(model, config, args.sglang_bucket_mb << 20, args.repeats)
    gib = 2 ** 30
    if args.sglang_only:
        rows = [("memcpy (torch copy_)", t_memcpy), ("convert Flax→torch", t_convert),
                ("sglang copy: convert + buckets to torch-owned", t_sglang),
                ("sglang fp8: convert + blockwise quantize / copy", t_sglang_fp8)]
        print("\n| path | time (s) | GiB/s |\n|---|---|---|")
        for name, t in rows:
            print(f"| {name} | {t:.3f} | {n_bytes / gib / t:.2f} |")
        print(f"\nsglang copy over convert: +{t_sglang - t_convert:.3f} s per sync "
              f"({(t_sglang - t_convert) / t_memcpy:.2f}x a memcpy of the payload)")
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    t_update = optimizer_update_time(model, args.param_dtype, args.repeats)

    engine = create_engine("vllm", model_path=ckpt, max_model_len=256)
    probe = [[1, 2, 3, 4]]
    sampling = SamplingConfig(temperature=0.0, max_tokens=4)
    reference = engine.generate(probe, sampling)[0].response_token_ids

    t_push = timed(lambda: engine.update_weights(iter_hf_tensors(model, config)), args.repeats)
    assert engine.generate(probe, sampling)[0].response_token_ids == reference  # same weights, same output

    disk = os.path.join(workdir, "disk")

    def disk_round_trip():
        shutil.rmtree(disk, ignore_errors=True)
        save_hf_model(model, config, disk, dtype="bfloat16")
        copy_tokenizer_files(ckpt, disk)
        engine._llm.collective_rpc("reload_weights", kwargs=dict(weights_path=disk, is_checkpoint_format=True))
        engine._llm.reset_prefix_cache()

    t_disk = timed(disk_round_trip, args.repeats)
    assert engine.generate(probe, sampling)[0].response_token_ids == reference
    engine.close()

    def convert_int8():
        for _, tensor in iter_hf_tensors(model, config, quantization="int8_per_channel"):
            pass

    int8_bytes = sum(t.numel() * t.element_size()
                     for _, t in iter_hf_tensors(model, config, quantization="int8_per_channel"))
    t_convert_int8 = timed(convert_int8, args.repeats)
    engine = create_engine("vllm", model_path=ckpt, max_model_len=256, engine_init_kwargs={"quantization":
                           "int8_per_channel"}, quantized_checkpoint_root=os.path.join(workdir, "quantized"))
    reference = engine.generate(probe, sampling)[0].response_token_ids
    t_push_int8 = timed(lambda: engine.update_weights(
        iter_hf_tensors(model, config, quantization="int8_per_channel")), args.repeats)
    t_push_int8_bf16 = timed(lambda: engine.update_weights(iter_hf_tensors(model, config)), args.repeats)
    assert engine.generate(probe, sampling)[0].response_token_ids == reference
    engine.close()

    rows = [("memcpy (torch copy_)", t_memcpy), ("convert Flax→torch", t_convert),
            ("optimizer update (AdamW" + (" + f32 master → bf16 params)" if args.param_dtype == "bfloat16"
                                          else ", f32 params)"), t_update),
            ("push into vLLM (convert+reload)", t_push), ("disk: save safetensors + reload", t_disk),
            ("sglang copy: convert + buckets to torch-owned", t_sglang),
            ("sglang fp8: convert + blockwise quantize / copy", t_sglang_fp8)]
    rows += [("int8 convert: JAX quantize → torch", t_convert_int8, int8_bytes),
             ("int8 push: learner-quantized into INT8 vLLM", t_push_int8, int8_bytes),
             ("int8 bf16: bf16 push into INT8 vLLM (torch quantizes)", t_push_int8_bf16, n_bytes)]
    print("\n| path | payload (GiB) | time (s) | GiB/s |\n|---|---|---|---|")
    for name, t, *payload in rows:
        size = payload[0] if payload else n_bytes
        print(f"| {name} | {size / gib:.3f} | {t:.3f} | {size / gib / t:.2f} |")
    print(f"\nINT8 push payload: {int8_bytes / n_bytes:.2f}x the bf16 push's bytes; learner-quantized push "
          f"{t_push_int8_bf16 / t_push_int8:.2f}x faster than a bf16 push into the same INT8 engine, "
          f"{t_push / t_push_int8:.2f}x the bf16 push into a bf16 engine")
    print(f"\nconvert / memcpy throughput: {t_memcpy / t_convert:.2f}x (target >= 0.8x)")
    print(f"push / disk throughput:      {t_disk / t_push:.2f}x (target >= 3x)")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
