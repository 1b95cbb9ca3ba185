"""Weight-push cost to a Ray engine fleet: 1 vs 2 vLLM engines, against an in-process `VLLMEngine`.

One run, one random Qwen2 checkpoint, the same (hf_name, bf16 tensor) pairs pushed every time (DLPack views
of the Flax params from `convert.to_torch.iter_hf_tensors`, as in training). Times are medians of
`--repeats` pushes after one warm-up; rates are bytes of the bf16 tensors per second.

  in-process   `VLLMEngine.update_weights` in this process (name/shape check, layerwise reload, re-pack):
               the baseline, tensors passed by reference
  put          the fleet's driver half: each bucket made contiguous and `ray.put` once into the object store
  fleet-1      `RayEngineFleet.update_weights`, 1 engine actor: put + the actor reads the refs + reload
  fleet-2      the same with 2 engine actors (both read the same objects; they reload in parallel)

The interesting ratios: fleet-2 / fleet-1 (the cost of one more engine: ~1 if the engines load in parallel
and the object store is not the bottleneck) and fleet-1 / in-process (the price of the process boundary).

    python -m benchmarks.fleet_push [--layers 6 --hidden 768 --intermediate 2048 --vocab 32000 --repeats 3]
"""

import argparse
import os
import tempfile

from benchmarks.bench_common import add_model_size_args, random_qwen2_checkpoint, timed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_size_args(parser, layers=6, hidden=768, intermediate=2048, heads=12, vocab=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray instance")
    parser.add_argument("--object-store-mb", type=int, default=1024)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()

    import ray
    import torch

    from portable_rl.convert.hf import load_hf_model
    from portable_rl.convert.to_torch import iter_hf_tensors
    from portable_rl.engines import create_engine
    from portable_rl.engines.buckets import bucketed
    from portable_rl.engines.ray_fleet import RayEngineFleet, pack_bucket

    workdir = args.workdir or tempfile.mkdtemp(prefix="fleet_push_")
    ckpt = os.path.join(workdir, "ckpt")
    random_qwen2_checkpoint(ckpt, args)
    model, config = load_hf_model(ckpt)
    pairs = list(iter_hf_tensors(model, config))  # the same views are pushed every time
    n_params = sum(t.numel() for _, t in pairs)
    n_bytes = sum(t.numel() * t.element_size() for _, t in pairs)
    print(f"model: {n_params / 1e6:.0f}M params, {n_bytes / 2**20:.0f} MiB in bf16; {os.cpu_count()} cores, "
          f"torch threads {torch.get_num_threads()}, ray {ray.__version__}")

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, object_store_memory=args.object_store_mb << 20,
             log_to_driver=False)
    bucket_bytes = args.bucket_mb << 20
    results = {}

    def put_only():
        refs = [ray.put(pack_bucket(b)) for b in bucketed(pairs, bucket_bytes)]
        del refs  # freed again, as the fleet frees the previous push

    results["put"] = timed(put_only, args.repeats)
    for num_engines in (1, 2):
        with RayEngineFleet(engine="vllm", model_path=ckpt, num_engines=num_engines, bucket_bytes=bucket_bytes,
                            resources_per_engine={"num_cpus": 1}) as fleet:
            results[f"fleet-{num_engines}"] = timed(lambda: fleet.update_weights(pairs), args.repeats)
    ray.shutdown()
    with create_engine("vllm", model_path=ckpt) as engine:  # in this process, after the actors are gone
        results["in-process"] = timed(lambda: engine.update_weights(pairs), args.repeats)

    print(f"{'push':<12} {'median s':>9} {'MiB/s':>8}")
    for name in ("in-process", "put", "fleet-1", "fleet-2"):
        print(f"{name:<12} {results[name]:>9.3f} {n_bytes / 2**20 / results[name]:>8.0f}")
    print(f"fleet-2 / fleet-1 = {results['fleet-2'] / results['fleet-1']:.2f}; "
          f"fleet-1 / in-process = {results['fleet-1'] / results['in-process']:.2f}; "
          f"put / fleet-1 = {results['put'] / results['fleet-1']:.2f}")


if __name__ == "__main__":
    main()
