"""Which 7B/8B recipe fits colocated on how many GPUs: `rl.colocation.MemoryPlan` over device counts.

For N devices the learner is fsdp=N and the engine one vLLM with tensor_parallel_size=N (weights and KV cache
split N ways). The learner's per-device peak at N devices is its state at N plus the activation temp measured
at fsdp=8 (docs/scaling.md "Measured"; temp depends on tokens per device, not on N, apart from one layer's
gathered weights):

    peak(N) = 14·P/N (bf16 params, f32 master + AdamW) [+ 4·P/N f32 accumulator with micro-batches] + temp

Prints a markdown table: layout (time-shared / resident), fits or the knob the plan names, the engine's
gpu_memory_utilization and the KV-cache tokens it leaves. Nothing is allocated; the checkpoints are
header-only (portable_rl.planning.shapes_only).

    python -m benchmarks.colocation_plan [--device_gb 141] [--devices 1 2 4 8]
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

from benchmarks.learner_memory import MODELS  # (published config.json values)
from portable_rl.rl.colocation import MemoryPlan, MemoryPlanError
from portable_rl.planning.shapes_only import hf_shapes, write_shapes_only_checkpoint

GB = 1e9
# (recipe, model, engine quantization, MAX_MODEL_LEN, peak at fsdp=8 in GB, micro-batched?) from docs/scaling.md
RECIPES = [
    ("Qwen3-8B, 32 768 tok/device, one call", "qwen3_8b", "fp8", 22528, 85.9, False),
    ("Qwen3-8B, 32 768 tok/device, 2 x 16 384", "qwen3_8b", "fp8", 22528, 75.6, True),
    ("Qwen2.5-7B, 32 768 tok/device, one call", "qwen2_5_7b", "fp8", 10240, 54.5, False),
]


def rows(device_gb: float, devices: list[int]):
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, quant, max_len, peak8, micro in RECIPES:
            path = write_shapes_only_checkpoint(os.path.join(tmp, model), MODELS[model])
            params = sum(math.prod(s) for s in hf_shapes(MODELS[model]).values())
            state = lambda n: (14 + (4 if micro else 0)) * params / n  # noqa: E731
            temp = peak8 * GB - state(8)
            for n in devices:
                for sleep in (True, False):
                    plan = MemoryPlan(learner_peak_gb=(state(n) + temp) / GB, model_path=path, sleep_engine=sleep,
                                      quantization=quant, max_model_len=max_len, engine_tensor_parallel=n,
                                      learner_shards=n, param_dtype="bfloat16", master_dtype="float32",
                                      device_memory_gb=device_gb)
                    try:
                        b = plan.decide(environ={})
                        verdict = (f"fits: gpu_memory_utilization {b.engine_fraction:.2f}, "
                                   f"KV cache {b.kv_tokens / 1e6:.2f} M tokens")
                    except MemoryPlanError as e:
                        verdict = "no: " + str(e).split("; ")[0].removeprefix("memory plan: ")
                    yield name, n, "time-shared" if sleep else "resident", plan.learner_peak_gb, verdict


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device_gb", type=float, default=141.0, help="memory per GPU (H200: 141)")
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    args = p.parse_args()
    print(f"| recipe | GPUs ({args.device_gb:g} GB each) | layout | learner peak / GPU (GB) | plan |")
    print("|---|---|---|---|---|")
    for name, n, layout, peak, verdict in rows(args.device_gb, args.devices):
        print(f"| {name} | {n} | {layout} | {peak:.1f} | {verdict} |")


if __name__ == "__main__":
    main()
