"""Colocated smoke test (one GPU): a JAX learner and an engine process share the device under the memory plan.

    driver (this process, no JAX, no CUDA)
      ├─ learner process: XLA env from the plan; builds a ~1B model + AdamW (resident state), AOT-compiles one
      │    train step and reports XLA's prediction of its peak (memory_analysis, benchmarks/learner_memory.py's
      │    method: argument + output − alias + temp), then runs steps on command
      └─ engine process: torch holding the plan's engine share (weights + KV cache tensors; sleep frees them,
           wake maps them back, weights first, as vLLM's cumem pool does), or, with --vllm and vLLM installed,
           a real in-process VLLMEngine (enable_sleep_mode, gpu_memory_utilization from the plan) on a small
           random checkpoint, cycled sleep → wake(weights) → push → wake(kv_cache) → generate

    the plan:  MemoryPlan(learner_peak_gb = XLA's prediction, learner_resident_gb = measured state,
               engine_weights_gb = the engine's weights) → gpu_memory_utilization, XLA's variables
    each step: engine.sleep → learner step (peak polled) → wake(weights) → push → wake(kv_cache) → generate

Reports, per process, the peak device memory seen (NVML per-PID used memory, else nvidia-smi, polled every
50 ms while each learner phase runs --reps updates; on --dry-run the resident set size) and the device's,
the plan's prediction for each, and two verdicts:
  learner_peak_within_prediction  measured learner peak − its runtime ≤ XLA's predicted peak × 1.01, where
                                  runtime = the learner process's bytes before its first step − its state
                                  (CUDA context, cuBLAS/cuDNN workspaces: outside XLA's memory_analysis;
                                  its measured size: docs/experiments/gpu_check.md)
  device_within_plan              the device's peak in the learner phase ≤ peak + asleep + reserve, and in
                                  the generation phase ≤ the device (what the plan promises)
`ok`: every step ran, i.e. no
allocation failed in either process. Results go to OUT/colocation_check.json, rewritten after each part.
Last, the control: XLA with its defaults (75 % preallocated) and then an engine asking for 0.6 of the device,
the layout the recipes had before the plan; on a GPU its "outcome" should be that the engine could not.
`--dry-run`: CPU, tiny sizes, checks that the protocol runs.

    python -m benchmarks.colocation_check [--dry-run] [--vllm] [--out DIR] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

from benchmarks import bench_common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9


# ------------------------------------------------------------------------------------------- memory probes
def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # noqa: BLE001  (no nvidia-ml-py, or no driver: nvidia-smi, or --dry-run)
        return None


_NVML = None  # set by the driver on a GPU run


def used_bytes(pids: list[int], dry_run: bool) -> dict[int, float]:
    """Device bytes per PID (nvidia-smi), or resident set size on --dry-run."""
    if dry_run:
        out = {}
        for pid in pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    out[pid] = next(float(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
            except (OSError, StopIteration):
                out[pid] = 0.0
        out["device"] = sum(out.values())
        return out
    if _NVML is not None:  # NVML directly: ~1 ms a sample, and no CUDA context in this process
        nvml, handle = _NVML
        seen = {p.pid: float(p.usedGpuMemory or 0) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        out = {pid: seen.get(pid, 0.0) for pid in pids}
        out["device"] = float(nvml.nvmlDeviceGetMemoryInfo(handle).used)
        return out
    text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=10).stdout
    seen = {int(p): float(m) * 2**20 for p, m in (line.split(",") for line in text.strip().splitlines() if line)}
    out = {pid: seen.get(pid, 0.0) for pid in pids}
    # the whole device too: in a container nvidia-smi may not see the PIDs (another PID namespace)
    total = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, timeout=10).stdout
    out["device"] = float(total.split()[0]) * 2**20
    return out


class PeakPoller:
    """Polls `used_bytes` in a thread; `peaks` holds the max per PID since the last `reset()`."""

    def __init__(self, pids, dry_run):
        self.pids, self.dry_run = list(pids), dry_run
        self.peaks = {p: 0.0 for p in self.pids + ["device"]}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                for key, b in used_bytes(self.pids, self.dry_run).items():
                    self.peaks[key] = max(self.peaks[key], b)
            except Exception:  # noqa: BLE001  (a failed poll is a missed sample, not a failed check)
                pass
            time.sleep(0.05)

    def reset(self):
        peaks, self.peaks = self.peaks, {p: 0.0 for p in self.pids + ["device"]}
        return peaks

    def stop(self):
        self._stop.set()
        self._thread.join()


# ----------------------------------------------------------------------------------------------- children
def serve(handle):
    """A child's loop: one JSON command per stdin line → one JSON reply per stdout line."""
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply = handle(cmd) or {}
        except Exception as e:  # noqa: BLE001  (reported to the driver, which records it)
            reply = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps(reply), flush=True)
        if cmd["op"] == "exit":
            return


def learner_child(args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks.gpu_check import MODEL_1B, MODEL_TINY, build_model

    from portable_rl.learner_jax.logprobs import sequence_logprobs
    from portable_rl.learner_jax.optim import make_optimizer

    model, config = build_model(MODEL_TINY if args.dry_run else MODEL_1B, "float32")
    optimizer = nnx.Optimizer(model, make_optimizer(learning_rate=1e-6), wrt=nnx.Param)
    rows, seq = (2, 32) if args.dry_run else (args.rows, args.seq)
    rng = np.random.default_rng(0)
    batch = {"input_ids": jnp.asarray(rng.integers(3, config.vocab_size, (rows, seq)), jnp.int32),
             "attention_mask": jnp.ones((rows, seq), jnp.int32),
             "advantages": jnp.asarray(rng.standard_normal(rows), jnp.float32)}
    graphdef, state = nnx.split((model, optimizer))
    del model, optimizer

    def step(state, batch):  # the learner's update as a pure function, so XLA can report its memory
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            logp, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"])
            return -jnp.mean(batch["advantages"][:, None] * logp)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
    ma = compiled.memory_analysis()
    predicted = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
                 + ma.temp_size_in_bytes)
    holder = {"state": state}

    def handle(cmd):
        if cmd["op"] == "info":
            return {"state_bytes": state_bytes, "predicted_peak_bytes": predicted, "compile_s": time.perf_counter() - t0,
                    "temp_bytes": ma.temp_size_in_bytes, "backend": jax.default_backend(),
                    "xla_env": {k: v for k, v in os.environ.items() if k.startswith("XLA_PYTHON_CLIENT")}}
        if cmd["op"] == "step":
            start = time.perf_counter()
            for _ in range(args.reps):  # a few updates: a wider window for the memory poller
                holder["state"], loss = compiled(holder["state"], batch)
            loss = float(loss)
            stats = jax.devices()[0].memory_stats() or {}
            return {"loss": loss, "step_s": (time.perf_counter() - start) / args.reps,
                    "xla_peak_bytes_in_use": stats.get("peak_bytes_in_use")}
    serve(handle)


def xla_default_child(args):
    """JAX with XLA's defaults (75 % preallocated at the first use of the device): the control."""
    import jax
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()
    stats = jax.devices()[0].memory_stats() or {}

    def handle(cmd):
        return {"bytes_reserved": stats.get("bytes_reserved"), "bytes_limit": stats.get("bytes_limit")}
    serve(handle)


def engine_child(args):
    """Holds `weights_bytes` + `kv_bytes` of torch memory; sleep frees both, wake maps them back by tag."""
    import torch

    device = "cpu" if args.dry_run else "cuda"
    sizes = {"weights": int(args.weights_bytes), "kv_cache": int(args.kv_bytes)}
    held = {}

    def alloc(tag):
        held[tag] = torch.ones(sizes[tag] // 2, dtype=torch.bfloat16, device=device)  # touched: really mapped

    def handle(cmd):
        op = cmd["op"]
        if op == "start":
            alloc("weights"), alloc("kv_cache")
        elif op == "sleep":
            held.clear()
            if device == "cuda":
                torch.cuda.empty_cache()  # back to the device, as vLLM's cumem unmap does
        elif op == "wake":
            for tag in cmd.get("tags") or ("weights", "kv_cache"):
                alloc(tag)
        elif op == "push":
            held["weights"].mul_(1.0)
        elif op == "generate":
            return {"sum_ok": bool(held["kv_cache"][:16].float().sum().item() == 16.0)}
        reply = {"held_bytes": sum(t.numel() * 2 for t in held.values())}
        if device == "cuda":
            reply.update(reserved_bytes=torch.cuda.memory_reserved(), max_reserved_bytes=torch.cuda.max_memory_reserved())
        return reply
    serve(handle)


def vllm_child(args):
    """A real VLLMEngine with the plan's share and sleep mode, on a small random checkpoint."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from safetensors.torch import load_file

    from portable_rl.engines.base import SamplingConfig
    from portable_rl.engines.vllm_adapter import VLLMEngine
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint(os.path.join(args.out, "colocation_vllm_ckpt"), "qwen2", size="small")
    engine = VLLMEngine(model_path=path, max_model_len=256, gpu_memory_utilization=args.engine_fraction,
                        enable_sleep_mode=True, enforce_eager=True)  # eager: a faster start (no graph capture)
    weights = load_file(os.path.join(path, "model.safetensors"))

    def handle(cmd):
        op = cmd["op"]
        if op == "sleep":
            engine.sleep()
        elif op == "wake":
            engine.wake_up(tags=cmd.get("tags"))
        elif op == "push":
            engine.update_weights(weights.items())
        elif op == "generate":
            out = engine.generate([[1, 40, 41]], SamplingConfig(temperature=0.0, max_tokens=8))
            return {"tokens": len(out[0].response_token_ids)}
        elif op == "exit":
            engine.close()
        return {}
    serve(handle)


# ------------------------------------------------------------------------------------------------- driver
class Child:
    def __init__(self, role, extra, env):
        cmd = [sys.executable, "-m", "benchmarks.colocation_check", "--role", role] + extra  # cwd: the root
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=ROOT)
        self.pid = self.call(None)["pid"]

    def call(self, op, **kw):
        if op is not None:
            self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"child exited with status {self.proc.wait()} during {op!r}")
            if line.startswith("{"):  # libraries may print other lines
                reply = json.loads(line)
                if "error" in reply:
                    raise RuntimeError(f"{op}: {reply['error']}")
                return reply

    def close(self):
        try:
            self.call("exit")
        except Exception:  # noqa: BLE001
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run(args) -> dict:
    from portable_rl.rl.colocation import detect_device_memory, xla_env_for

    if args.dry_run:
        device_bytes, source = 0.3 * GB, "dry run: a pretend 0.3 GB device (host RAM)"
    else:
        device_bytes, _, source = detect_device_memory()
        if device_bytes is None:
            raise RuntimeError(f"no GPU to check ({source})")
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT")}
    if args.dry_run:
        base_env["JAX_PLATFORMS"] = "cpu"
    # 1. The learner under the time-shared plan's XLA settings (they do not depend on the numbers).
    learner_env = {**base_env, **xla_env_for(sleep_engine=True, environ={})}
    learner = Child("learner", ["--rows", str(args.rows), "--seq", str(args.seq), "--reps", str(args.reps)] + (["--dry-run"] if args.dry_run else []),
                    learner_env)
    try:
        return _with_learner(args, learner, device_bytes, source, base_env)
    finally:
        learner.close()


def _with_learner(args, learner, device_bytes, source, base_env) -> dict:
    from portable_rl.rl.colocation import MemoryPlan

    info = learner.call("info")
    # 2. The plan from what the learner reports (the engine's weights: 1.5 GB stands in for a small model).
    weights_gb = 0.01 if args.dry_run else 1.5
    plan = MemoryPlan(learner_peak_gb=info["predicted_peak_bytes"] / GB, sleep_engine=True,
                      learner_resident_gb=info["state_bytes"] / GB, engine_weights_gb=weights_gb,
                      max_model_len=256, engine_overhead_gb=0.0 if args.dry_run else 3.0,
                      engine_asleep_gb=0.0 if args.dry_run else 2.0, reserve_gb=0.05 if args.dry_run else 2.0)
    budget = plan.decide(environ={}, device_memory_bytes=device_bytes, device_source=source)
    share = budget.engine_fraction * device_bytes
    limits = {"predicted_peak": info["predicted_peak_bytes"], "state": info["state_bytes"], "device": device_bytes,
              "learner_phase_device": info["predicted_peak_bytes"] + (plan.engine_asleep_gb + plan.reserve_gb) * GB}
    result = {"device_bytes": device_bytes, "device_source": source, "plan_line": budget.line(),
              "learner_xla_env": info["xla_env"], "learner_compile_s": info["compile_s"],
              "predicted": {"learner_peak_bytes": info["predicted_peak_bytes"],
                            "learner_state_bytes": info["state_bytes"], "engine_bytes": share,
                            "gpu_memory_utilization": budget.engine_fraction}}
    held = share - plan.engine_overhead_gb * GB  # what vLLM's pool would map: weights + KV cache
    engines = [("torch_holder", lambda: Child("engine", ["--weights-bytes", str(weights_gb * GB), "--kv-bytes",
                                                         str(held - weights_gb * GB)]
                                              + (["--dry-run"] if args.dry_run else []), base_env))]
    if args.vllm and not args.dry_run:
        if _has_vllm():
            engines.append(("vllm", lambda: Child("vllm", ["--engine-fraction", str(budget.engine_fraction),
                                                           "--out", args.out], base_env)))
        else:
            result["vllm"] = {"skipped": "vLLM is not installed", "ok": True}
    for name, start_engine in engines:
        result[name] = cycles(args, learner, start_engine, limits)
        write_json(args.out, result)  # a timeout in the next part keeps this one
    result["ok"] = all(result[name].get("ok") for name in ("torch_holder", "vllm") if name in result)
    write_json(args.out, result)
    result["control_without_plan"] = control(args, device_bytes, base_env)
    return result


def control(args, device_bytes: float, base_env: dict) -> dict:
    """The issue this plan fixes: XLA's default preallocation first, then an engine asking for 0.6 of the
    device (the recipes' old GPU_MEMORY_UTILIZATION). Expected on a GPU: the engine cannot get its share."""
    xla = Child("xla_default", [], {**base_env, **({"JAX_PLATFORMS": "cpu"} if args.dry_run else {})})
    try:
        stats = xla.call("info")
        share = 0.6 * device_bytes
        engine = Child("engine", ["--weights-bytes", str(0.1 * share), "--kv-bytes", str(0.9 * share)]
                       + (["--dry-run"] if args.dry_run else []), base_env)
        try:
            engine.call("start")
            outcome = "the engine got its 0.6 share"
        except RuntimeError as e:
            outcome = f"the engine could not get its 0.6 share: {str(e)[:300]}"
        finally:
            engine.close()
    finally:
        xla.close()
    return {"xla_default": stats, "outcome": outcome}


def cycles(args, learner, start_engine, limits: dict) -> dict:
    """`args.steps` time-shared steps with one engine process; both processes' peaks per phase, and the
    verdicts against `limits` (module doc)."""
    try:
        engine = start_engine()
        if "--kv-bytes" in engine.proc.args:
            engine.call("start")
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "error": f"engine start: {e}"}
    poller = PeakPoller([learner.pid, engine.pid], args.dry_run)
    steps, error = [], None
    try:
        time.sleep(0.2)
        start = poller.reset()
        for _ in range(args.steps):
            engine.call("sleep")
            time.sleep(0.2)
            poller.reset()
            step = learner.call("step")
            time.sleep(0.2)
            learner_phase = poller.reset()
            engine.call("wake", tags=["weights"])
            engine.call("push")
            engine.call("wake", tags=["kv_cache"])
            gen = engine.call("generate")
            time.sleep(0.2)
            generation = poller.reset()
            steps.append({**step, "generate": gen,
                          "learner_phase_bytes": {"learner": learner_phase[learner.pid],
                                                  "engine": learner_phase[engine.pid],
                                                  "device": learner_phase["device"]},
                          "generation_phase_bytes": {"learner": generation[learner.pid],
                                                     "engine": generation[engine.pid],
                                                     "device": generation["device"]}})
    except Exception as e:  # noqa: BLE001  (an OOM in either process lands here)
        error = f"{type(e).__name__}: {e}"
    finally:
        poller.stop()
        engine.close()
    if not steps:
        return {"ok": False, "error": error}
    learner_peak = max(s["learner_phase_bytes"]["learner"] for s in steps)
    if learner_peak == 0:  # nvidia-smi saw no PIDs (container): the device's use in the learner phase, which
        learner_peak = max(s["learner_phase_bytes"]["device"] for s in steps)  # adds the sleeping engine's
    runtime = start[learner.pid] - limits["state"]  # the learner's bytes outside XLA's buffers
    device_learner = max(s["learner_phase_bytes"]["device"] for s in steps)
    device_generation = max(s["generation_phase_bytes"]["device"] for s in steps)
    return {"measured": {"learner_peak_bytes": learner_peak, "learner_runtime_bytes": runtime,
                         "engine_peak_bytes": max(s["generation_phase_bytes"]["engine"] for s in steps),
                         "engine_asleep_bytes": max(s["learner_phase_bytes"]["engine"] for s in steps),
                         "learner_during_generation_bytes": max(s["generation_phase_bytes"]["learner"] for s in steps),
                         "device_peak_learner_phase": device_learner,
                         "device_peak_generation_phase": device_generation,
                         "at_start": {"learner": start[learner.pid], "engine": start[engine.pid]}},
            "steps": steps, "error": error, "learner_peak_within_prediction": learner_peak - runtime <= limits["predicted_peak"] * 1.01,
            "device_within_plan": (device_learner <= limits["learner_phase_device"]
                                   and device_generation <= limits["device"]),
            "ok": error is None and len(steps) == args.steps}


def write_json(out_dir: str, result: dict) -> str:
    return bench_common.write_json(out_dir, "colocation_check.json", result)


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--vllm", action="store_true", help="a real vLLM engine where vLLM is installed")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3, help="learner updates per learner phase")
    p.add_argument("--out", default=os.environ.get("OUT") or ".")
    p.add_argument("--role", default="driver", choices=("driver", "learner", "engine", "vllm", "xla_default"))
    p.add_argument("--weights-bytes", type=float, default=0)
    p.add_argument("--kv-bytes", type=float, default=0)
    p.add_argument("--engine-fraction", type=float, default=0.3)
    args = p.parse_args()
    if args.role != "driver":
        {"learner": learner_child, "engine": engine_child, "vllm": vllm_child,
         "xla_default": xla_default_child}[args.role](args)
        return
    if not args.dry_run and shutil.which("nvidia-smi") is None:
        print("colocation_check: no nvidia-smi (no GPU); use --dry-run on CPU", file=sys.stderr)
        sys.exit(2)
    global _NVML
    if not args.dry_run:
        _NVML = _nvml()
    start = time.perf_counter()
    try:
        result = run(args)
    except Exception as e:  # noqa: BLE001  (recorded: the JSON says what failed)
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    result["seconds"] = time.perf_counter() - start
    path = write_json(args.out, result)
    print(json.dumps(result, indent=2))
    print(f"colocation_check: wrote {path}; {'ok' if result['ok'] else 'FAILED'} in {result['seconds']:.0f} s",
          flush=True)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
