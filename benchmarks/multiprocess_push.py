"""Push time into vLLM with its worker in this process vs in other processes, same model, one run.

Arms (one engine at a time, each started on the same random Qwen2 checkpoint):

  in_process           one worker in this process: the pairs pass by reference (VLLMEngine's default)
  engine_core_process  in_process=False: the engine core and its one worker in a process of their own
  tensor_parallel_2    tensor_parallel_size=2: two worker processes, each loading its shard (vLLM-CPU: each
                       worker's threads bound to half of this process's CPUs unless VLLM_CPU_OMP_THREADS_BIND
                       is set)

The pushed pairs are bf16 torch tensors made once (the learner's conversion is not timed here:
benchmarks/weight_sync.py). Per arm: `push` = `VLLMEngine.update_weights` (checks, transport, layerwise reload,
prefix-cache reset), median of --repeats after one warm-up; `segment` = the shared-memory copy alone
(`shared_weights.shared_segment`: what the multi-process arms add before the RPC). Each arm's greedy output
must be unchanged by pushing the weights it already serves.

    python -m benchmarks.multiprocess_push [--layers 12 --hidden 1024 --intermediate 4096 --repeats 3 --out DIR]
"""

import argparse
import datetime
import os
import platform
import tempfile

from benchmarks.bench_common import add_model_size_args, random_qwen2_checkpoint, timed, write_json

ARMS = {"in_process": {}, "engine_core_process": dict(in_process=False),
        "tensor_parallel_2": dict(engine_init_kwargs={"tensor_parallel_size": 2})}


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                    platform.processor())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_size_args(parser, layers=12, hidden=1024, intermediate=4096, heads=16, vocab=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None, help="write <out>/<date>_multiprocess_push.json")
    args = parser.parse_args()

    import torch

    from portable_rl.convert.hf import load_hf_model
    from portable_rl.convert.to_torch import iter_hf_tensors
    from portable_rl.engines import SamplingConfig, create_engine
    from portable_rl.engines.shared_weights import shared_segment

    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # one half of the CPUs per tensor-parallel worker
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(map(str, part)) for part in (cpus[:len(cpus) // 2], cpus[len(cpus) // 2:]))
    workdir = args.workdir or tempfile.mkdtemp(prefix="multiprocess_push_")
    ckpt = random_qwen2_checkpoint(os.path.join(workdir, "ckpt"), args)
    model, config = load_hf_model(ckpt)
    pairs = [(name, tensor.to(torch.bfloat16).contiguous().clone()) for name, tensor in iter_hf_tensors(model, config)]
    del model
    n_bytes = sum(t.numel() * t.element_size() for _, t in pairs)

    def write_segment():
        with shared_segment(pairs):
            pass

    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "cpus": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
              "model": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                        "vocab": args.vocab, "params": sum(t.numel() for _, t in pairs), "payload_bytes": n_bytes},
              "repeats": args.repeats, "thread_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
              "segment_s": timed(write_segment, args.repeats), "arms": {}}
    probe, greedy = [[1, 2, 3, 4]], SamplingConfig(temperature=0.0, max_tokens=4)
    for arm in args.arms.split(","):
        with create_engine("vllm", model_path=ckpt, max_model_len=256, **ARMS[arm]) as engine:
            before = engine.generate(probe, greedy)[0].response_token_ids
            push_s = timed(lambda: engine.update_weights(pairs), args.repeats)
            assert engine.generate(probe, greedy)[0].response_token_ids == before, arm
            result["arms"][arm] = {"push_s": push_s, "gib_per_s": n_bytes / 2**30 / push_s,
                                   "by_reference": engine.pushes_by_reference}
        print(f"{arm}: push {push_s:.3f} s ({n_bytes / 2**30 / push_s:.2f} GiB/s)", flush=True)
        if args.out:  # after every arm, so an interrupted run keeps what finished
            write_json(args.out, f"{result['date'][:10]}_multiprocess_push.json", result)
    base = result["arms"].get("in_process", {}).get("push_s")
    print(f"\npayload {n_bytes / 2**30:.3f} GiB; shared-memory segment write {result['segment_s']:.3f} s")
    print("| arm | push (s) | GiB/s | / in_process |\n|---|---|---|---|")
    for arm, row in result["arms"].items():
        ratio = f"{row['push_s'] / base:.2f}x" if base else "-"
        print(f"| {arm} | {row['push_s']:.3f} | {row['gib_per_s']:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
