"""vLLM adapter: an in-process `vllm.LLM` behind `EngineAdapter`.

Logprobs. vLLM is started with `logprobs_mode="processed_logprobs"` and asked for `logprobs=0` (the sampled
token only). "processed" means after temperature scaling and top-k / top-p masking, so the returned value is
exactly the learner's

    log_softmax(logits / T)[sampled_token]      (float32)

— the distribution the token was drawn from. The default "raw_logprobs" would give log_softmax(logits), the
T=1 distribution, which is off by the temperature for any T != 1.

Sampling support (`SamplingConfig.return_support`, top-k / top-p). vLLM masks the logits outside the support
S_t to −inf before its log_softmax, so with `logprobs=top_k` the top-k processed logprobs it returns are
finite exactly on S_t (|S_t| <= top_k): S_t = {v : logprob_v > −inf} among them. This is the support vLLM
sampled from, on any backend (vLLM's own `return_sampling_mask` gives the same set, but only under Model
Runner V2, which needs Triton and a GPU: not on vLLM-CPU). The engine is started with `max_logprobs`
>= `MAX_SUPPORT` (default; a larger top_k needs `engine_init_kwargs={"max_logprobs": k}`).

Weight sync. `update_weights(pairs)` checks every `(hf_name, tensor)` against the checkpoint the engine was
started from (names and shapes, read from the safetensors headers) before touching the engine, then makes ONE
`collective_rpc` into `PortableRLWorkerExtension.portable_rl_reload_weights` (vLLM's layerwise reload; a
quantized engine re-quantizes from the pushed bf16 weights) and resets the prefix cache, whose KV entries
were computed with the old weights.

How the bytes move. In-process with one worker (`in_process=True`, tensor_parallel_size 1: vLLM's "uni"
executor) the pairs reach the worker by reference: no copy before vLLM's weight loaders. When the workers live
in other processes (`in_process=False`: the engine core in its own process; tensor_parallel_size > 1: one
process per worker), the adapter copies every tensor once into one POSIX shared-memory segment (RAM, never a
file on disk; for GPU tensors this is the device-to-host copy) and sends only a manifest (segment name, and per
tensor its name, dtype, shape and offset) through the same `collective_rpc`, to
`portable_rl_reload_shared_weights`; each worker maps the segment and hands views of it to the same layerwise
reload (a tensor-parallel worker's loaders copy only its shard); the adapter then unlinks the segment
(engines/shared_weights.py). The segment holds the whole push: /dev/shm must have room for it. A segment is visible on this host only, so workers on other hosts
(`nnodes > 1`, `distributed_executor_backend="ray"`) are refused at start.

vLLM internals. Everything here beyond vLLM's public API (kernel patches, the layerwise reload, the reload
warning filter, teardown, resolved config) goes through engines/vllm_internals.py, which names the vLLM
symbol each relies on and checks it against vLLM's source (`python -m portable_rl.engines.vllm_internals`).
`llm_kwargs` builds what `vllm.LLM` is given, without starting anything.

`quantization` reports what vLLM resolved (`model_config.quantization`): the `quantization` argument, or
the method of a pre-quantized checkpoint; None for bf16.

Several in-process engines may live in one process (vLLM keeps process-global parallel state; `close()` tears
it down only with the last one).

INT8 W8A8 (`engine_init_kwargs={"quantization": "int8_per_channel"}`). vLLM 0.32 has no online INT8 for
linear layers; it serves INT8 W8A8 from a compressed-tensors checkpoint (`CompressedTensorsW8A8Int8`: oneDNN
or AMX on x86 CPUs, CUTLASS on GPUs). So the adapter writes that checkpoint once from the bf16 `model_path`
(`engines.quantize.ensure_int8_checkpoint`: per-output-channel int8 projections + `weight_scale`, dynamic
per-token int8 activations, embeddings / norms / lm_head unquantized) into `quantized_checkpoint_root`
(gin: the run directory), atomically, and starts the engine there. A push may carry the projections as
int8 + `weight_scale` (what the learner sends: rl/sync.py) or as floats, which the adapter quantizes with
the same formula in torch; either way the engine reloads checkpoint-format int8, and
vllm_internals.keeping_int8_handler_scale keeps vLLM-CPU's oneDNN kernel from reading a freed scale after the reload.
Unlike FP8, INT8 accepts fp32 activations, so on CPU its dtype follows the box as an unquantized engine's.

Mixture of experts (engines/vllm_moe.py). An MoE checkpoint is served like a dense one and takes the HF
per-expert pairs in a push; the schemes vLLM cannot serve it with are refused at start. With
`return_routed_experts=True`, `generate` can return the experts each position was routed to
(`Rollout.routed_experts`): vLLM's own option on GPU, a router capture inside the worker on vLLM-CPU.

Sleep (colocated with the learner: rl/colocation.py). `enable_sleep_mode=True`
(GPU) starts vLLM with its cumem allocator; `sleep()` then offloads the weights to host RAM and drops the KV
cache (`sleep_level=1`), or drops both (`sleep_level=2`: less host RAM, no offload copy, valid only when
every wake-up is followed by a full push, as the training loop does); `wake_up(tags=["weights"])` maps the
weight memory back for a push, `wake_up(tags=["kv_cache"])` the KV cache, `wake_up()` both. vLLM resumes
scheduling only when both are back. Without sleep mode on a GPU vLLM would free nothing, so `sleep()` raises
(as the SGLang adapter does). vLLM-CPU has no sleep mode (`enable_sleep_mode=True` is refused at start);
there `sleep()` and `wake_up()` only pause and resume the scheduler.

Engine dtype. GPU: bfloat16. CPU (`cpu_engine_dtype`): bfloat16 where /proc/cpuinfo shows bf16 dot-product
instructions (`avx512_bf16`, or AMX `amx_bf16`), and for quantized engines (vLLM's fp8 methods accept
only bf16/fp16 activations); float32 elsewhere, since without those instructions every bf16 GEMM is
widened in software (SmolLM2-135M decode ~4x slower in bf16 than float32 there, ~2.4x faster with
avx512_bf16: docs/experiments/cpu_rollouts.md). Each
distinct choice is printed once per process; an explicit `dtype` (argument or `engine_init_kwargs`; in
gin `--gin.ENGINE_KWARGS="{'quantization': %QUANTIZATION, 'dtype': 'bfloat16'}"`) wins. The CPU KV cache
is sized in bf16 tokens: a float32 engine gets twice the bytes, so both hold the same number of tokens.

Prefix caching. vLLM's prefix cache is on (its default; off only for the CPU router capture, which must see
every position computed) and reset by every push. It reuses whole KV blocks: a request re-prefills everything
after the last full block it shares with earlier ones. A multi-turn rollout's later turn (rl/turns.py) is the
trajectory so far plus an observation, so it re-prefills the observation and the tail of the trajectory that
fills no block. vLLM-CPU's default block is 128 tokens (a tail of 64 on average, as long as an SQL observation);
the adapter starts CPU engines with 32, the smallest its attention kernel takes (`engine_init_kwargs=
{"block_size": ...}` overrides it).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import sys
import dataclasses
from typing import Any, Generator, Iterable, Sequence

import numpy as np

from portable_rl.engines import vllm_internals
from portable_rl.engines.base import (EngineAdapter, Finished, NamedTensor, Request, Rollout, SamplingConfig,
                                      check_prompts, in_waves, named_tensor_pairs, prompt_seeds)
from portable_rl.engines.checkpoint import (WeightUpdateError, check_named_tensors,  # noqa: F401 (re-exported)
                                            read_checkpoint_shapes, tied_embeddings)
from portable_rl.engines.cpu_features import (FAST_BF16_CPU_FLAGS, allow_amx_tiles,  # noqa: F401 (re-exported)
                                              cpu_flags, omp_threads_spin, prefer_passive_omp_waits)
from portable_rl.engines.registry import register
from portable_rl.engines.shared_weights import shared_segment
from portable_rl.engines.vllm_moe import check_moe_quantization, is_moe_checkpoint, records_by_inputs
from portable_rl.errors import ConfigError

WORKER_EXTENSION = "portable_rl.engines.vllm_worker.PortableRLWorkerExtension"
LOGPROBS_MODE = "processed_logprobs"
INT8 = "int8_per_channel"  # served from a compressed-tensors W8A8 checkpoint the adapter writes (module doc)
DEFAULT_QUANTIZED_CHECKPOINT_ROOT = os.path.join("~", ".cache", "portable_rl", "quantized_checkpoints")
MAX_SUPPORT = 128  # default max_logprobs: the largest top_k whose support `generate` can return
CPU_KV_CACHE_BYTES = 256 << 20  # for a bf16 cache (11,520 tokens of SmolLM2-135M); scaled for float32
CPU_BLOCK_SIZE = 32  # tokens a KV block holds on CPU (module doc, "Prefix caching")
_CPU_DTYPE_LOGGED: set[tuple[str, str]] = set()
_OMP_WARNED = False


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_engine_dtype(flags: set[str] | None = None, quantization: str | None = None) -> tuple[str, str]:
    """(dtype, why): bfloat16 when the CPU has hardware bf16 dot products or the engine quantizes to FP8,
    else float32."""
    if quantization and quantization != INT8:
        return "bfloat16", f"quantization={quantization!r} needs bf16/fp16 activations in vLLM"
    flags = cpu_flags() if flags is None else flags
    fast = [f for f in FAST_BF16_CPU_FLAGS if f in flags]
    if fast:
        return "bfloat16", f"CPU has {'/'.join(fast)}"
    return "float32", f"CPU lacks {' and '.join(FAST_BF16_CPU_FLAGS)} (bf16 GEMMs would run in software)"


def resolve_enforce_eager(enforce_eager: bool | None, on_cpu: bool) -> bool | None:
    """None → eager on CPU (vLLM-CPU's compiled path buys nothing here), vLLM's own default on GPU (CUDA graphs).

    Returns the value to pass as `vllm.LLM(enforce_eager=...)`, or None to pass nothing.
    """
    if enforce_eager is None:
        return True if on_cpu else None
    return bool(enforce_eager)


def set_vllm_environment(in_process: bool) -> None:
    """What vLLM reads when it is imported or starts an engine, set right before the engine is created:
    the engine core in this process (tensors pass to the worker by reference) or in its own, vLLM's logs at
    WARNING unless VLLM_LOGGING_LEVEL is set (it logs a few INFO lines per weight sync), and passive OpenMP
    waits unless OMP_WAIT_POLICY is set (`cpu_features.prefer_passive_omp_waits`)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    prefer_passive_omp_waits()


def _warn_if_omp_spins() -> None:
    """Once: idle OpenMP threads spin (the policy was set, or torch loaded OpenMP before it was)."""
    global _OMP_WARNED
    if not _OMP_WARNED and omp_threads_spin():
        _OMP_WARNED = True
        print("[vllm] OMP_WAIT_POLICY is not PASSIVE (set otherwise, or set after torch had loaded OpenMP): on a "
              "shared CPU decode can be >10x slower; export OMP_WAIT_POLICY=PASSIVE",
              file=sys.stderr, flush=True)


def _log_cpu_dtype_once(dtype: str, why: str) -> None:
    if (dtype, why) not in _CPU_DTYPE_LOGGED:
        _CPU_DTYPE_LOGGED.add((dtype, why))
        print(f"[vllm] CPU engine dtype {dtype}: {why}; override with engine_init_kwargs={{'dtype': ...}}",
              file=sys.stderr, flush=True)


def _int8_start_checkpoint(model_path: str, root: str | None, on_cpu: bool) -> str:
    """The INT8 W8A8 checkpoint to start on: `model_path` if it is one, else its copy under `root` (written
    once). Refuses projection shapes GPU INT8 GEMMs cannot take before anything is written."""
    from portable_rl.engines.quantize import ensure_int8_checkpoint, is_int8_checkpoint, is_quantized_weight

    if is_int8_checkpoint(model_path):
        return model_path
    with open(os.path.join(model_path, "config.json")) as f:
        if json.load(f).get("quantization_config"):
            raise ConfigError(f"quantization='int8_per_channel' needs a bf16 (or INT8 W8A8) start checkpoint; "
                              f"{model_path} is already quantized another way: start from its bf16 original")
    if not on_cpu:  # CUTLASS int8 GEMMs need both dims of every weight in multiples of 16 (CPU kernels: any)
        odd = [f"{n} {s}" for n, s in read_checkpoint_shapes(model_path).items()
               if is_quantized_weight(n) and (s[0] % 16 or s[1] % 16)]
        if odd:
            raise ConfigError(f"quantization='int8_per_channel': {odd[0]} (and {len(odd) - 1} more) is not a "
                              "multiple of 16 in both dims, which GPU INT8 GEMMs need; use FP8 for this model")
    return ensure_int8_checkpoint(model_path, os.path.expanduser(root or DEFAULT_QUANTIZED_CHECKPOINT_ROOT))


def llm_kwargs(model: str, *, on_cpu: bool, engine_init_kwargs: dict[str, Any] | None = None, seed: int = 0,
               gpu_memory_utilization: float | None = None, max_model_len: int | None = None,
               enforce_eager: bool | None = None, dtype: str | None = None,
               enable_sleep_mode: bool = False, return_routed_experts: bool = False) -> dict[str, Any]:
    """Everything `VLLMEngine` passes to `vllm.LLM` for an engine started on checkpoint `model` (for INT8 the
    compressed-tensors copy); the arguments are VLLMEngine's. Starts and imports nothing (reads
    /proc/cpuinfo for a CPU engine's default dtype and VLLM_CPU_KVCACHE_SPACE).

    Every key but engine_init_kwargs' is in `vllm_internals.LLM_KWARGS`, whose canary checks it is an
    `EngineArgs` field."""
    engine_init_kwargs = dict(engine_init_kwargs or {})
    quantization = engine_init_kwargs.get("quantization")
    if quantization == INT8:  # served from the compressed-tensors checkpoint, not an online `quantization`
        del engine_init_kwargs["quantization"]
    if dtype is None:  # None = the platform's fast dtype (module doc)
        dtype = cpu_engine_dtype(quantization=quantization)[0] if on_cpu else "bfloat16"
    kwargs: dict[str, Any] = dict(model=str(model), seed=seed, dtype=dtype, logprobs_mode=LOGPROBS_MODE,
                                  worker_extension_cls=WORKER_EXTENSION, max_logprobs=MAX_SUPPORT)
    eager = resolve_enforce_eager(enforce_eager, on_cpu)
    if eager is not None:  # None: vLLM's default (False: CUDA graphs on GPU)
        kwargs["enforce_eager"] = eager
    if max_model_len is not None:  # default: the model's max_position_embeddings
        kwargs["max_model_len"] = max_model_len
    if gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if on_cpu:
        # vLLM-CPU 0.32 rewinds a seeded request's torch.Generator when its prefill is split across
        # steps, which CPU generators cannot do ("CPU Generator does not use offset"): whole prefills
        # only (tests/test_engines_vllm_chunked_prefill.py). engine_init_kwargs may turn it back on.
        kwargs["enable_chunked_prefill"] = False
        kwargs["block_size"] = CPU_BLOCK_SIZE  # vLLM-CPU's default is 128 (module doc, "Prefix caching")
    if enable_sleep_mode:
        kwargs["enable_sleep_mode"] = True
    if return_routed_experts and on_cpu:  # vllm_moe.RoutingCapture: every prompt position computed
        kwargs["enable_prefix_caching"] = False
    elif return_routed_experts:
        kwargs["enable_return_routed_experts"] = True
    kwargs.update(engine_init_kwargs)
    if return_routed_experts and on_cpu and not kwargs.get("enforce_eager"):
        raise ConfigError("return_routed_experts=True on vLLM-CPU captures the router in eager mode only; "
                          "leave enforce_eager at None or True")
    if kwargs.get("nnodes", 1) > 1 or kwargs.get("distributed_executor_backend", "mp") not in ("mp", "uni"):
        raise ConfigError(f"nnodes={kwargs.get('nnodes', 1)}, distributed_executor_backend="
                          f"{kwargs.get('distributed_executor_backend')!r}: a push reaches vLLM's workers through "
                          "this host's shared memory, so they must all run on it; use the 'mp' backend with "
                          "nnodes=1 and scale out with more engines (engines.ray_fleet)")
    if kwargs.get("enable_sleep_mode") and on_cpu:
        raise ConfigError("enable_sleep_mode=True: vLLM-CPU has no sleep mode (it refuses to start); leave it "
                          "off on CPU, where sleep() and wake_up() pause and resume the scheduler")
    if on_cpu and "VLLM_CPU_KVCACHE_SPACE" not in os.environ and "kv_cache_memory_bytes" not in kwargs:
        # On CPU, gpu_memory_utilization reserves that fraction of host RAM; a fixed small KV cache
        # instead lets several engines and the learner share the box.
        wide = str(kwargs["dtype"]).removeprefix("torch.") in ("float32", "float")
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES * (2 if wide else 1)
    if kwargs["logprobs_mode"] != LOGPROBS_MODE:
        raise ValueError(f"logprobs_mode={kwargs['logprobs_mode']!r}: rollout logprobs must be "
                         f"{LOGPROBS_MODE!r} to equal the learner's log_softmax(logits/T)")
    return kwargs


def _sampled_and_support(tokens, flat) -> tuple[list[float], list[list[int]]]:
    """From vLLM's FlatLogprobs (the sampled token and the top-k processed logprobs per position): the
    sampled tokens' logprobs and, per position, the support (ids with a finite logprob; module doc)."""
    ids, values = np.asarray(flat.token_ids), np.asarray(flat.logprobs, np.float64)
    logprobs, support = [], []
    for tok, lo, hi in zip(tokens, flat.start_indices, flat.end_indices):
        pos_ids, pos_values = ids[lo:hi], values[lo:hi]
        logprobs.append(float(pos_values[np.flatnonzero(pos_ids == tok)[0]]))
        support.append(sorted(set(pos_ids[np.isfinite(pos_values)].tolist())))
    return logprobs, support


@register("vllm")
class VLLMEngine(EngineAdapter):
    """In-process vLLM. Defaults suit a small CPU machine; on GPU pass `gpu_memory_utilization` etc.

    Args:
      model_path: the HF checkpoint directory the engine starts from; pushed weights are checked against it.
      engine_init_kwargs: extra `vllm.LLM` keywords, overriding the adapter's (e.g. quantization: "fp8_per_channel"
        on CPU, "fp8" or "fp8_per_block" on GPU, "int8_per_channel" (module doc); tensor_parallel_size;
        max_logprobs); None: none.
      seed: vLLM's engine seed; a request with its own sampling seed uses that one.
      gpu_memory_utilization: the fraction of GPU memory vLLM may claim (weights, activations, KV cache);
        None: vLLM's default. On CPU the adapter gives the KV cache a fixed 256 MiB (bf16 tokens) unless
        VLLM_CPU_KVCACHE_SPACE or engine_init_kwargs sets it.
      max_model_len: the longest prompt + response in tokens; None: the model's max_position_embeddings.
      enforce_eager: True: no CUDA graphs; False: vLLM captures them (the fast decode path on GPU); None:
        eager on CPU, vLLM's default (False) on GPU.
      dtype: the engine's weight and activation dtype; None: bfloat16 on GPU, on CPU bfloat16 or float32 by
        the CPU's bf16 instructions and the quantization (module doc, "Engine dtype").
      in_process: run vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so with one
        worker pushed tensors pass by reference; False: a separate engine-core process, pushed through shared
        memory (module doc, "How the bytes move"), as with tensor_parallel_size > 1.
      validate_weights: check every pushed weight's name and shape against model_path's checkpoint before
        the engine sees it.
      enable_sleep_mode: start vLLM with its sleep allocator so `sleep()` frees GPU memory (GPU only;
        vLLM-CPU refuses it).
      sleep_level: what `sleep()` does to the weights: 1: offloaded to host RAM; 2: dropped (every wake-up
        must be followed by a full push). The KV cache is dropped at both levels.
      quantized_checkpoint_root: where the INT8 W8A8 start checkpoint is written once (quantization
        "int8_per_channel"); None: ~/.cache/portable_rl/quantized_checkpoints.
      return_routed_experts: an MoE checkpoint only: make `generate` able to return the experts each position
        was routed to (`SamplingConfig.return_routed_experts`): vLLM's enable_return_routed_experts on GPU,
        the router capture of vllm_moe.py on CPU (prefix caching off, eager).
    """

    returns_sampling_support = True  # module doc, "Sampling support"

    _live = 0  # in-process engines share vLLM's process-global parallel state; the last one tears it down

    def __init__(self, *, model_path: str, engine_init_kwargs: dict[str, Any] | None = None, seed: int = 0,
                 gpu_memory_utilization: float | None = None, max_model_len: int | None = None,
                 enforce_eager: bool | None = None, dtype: str | None = None, in_process: bool = True,
                 validate_weights: bool = True, enable_sleep_mode: bool = False, sleep_level: int = 1,
                 quantized_checkpoint_root: str | None = None, return_routed_experts: bool = False):
        set_vllm_environment(in_process)
        import vllm

        vllm_internals.check_vllm_version(vllm.__version__)
        vllm_internals.quiet_expected_reload_warnings()
        on_cpu = _on_cpu()
        if on_cpu:  # this process: an in-process worker, or forked ones
            allow_amx_tiles()
            vllm_internals.install_cpu_patches()
            _warn_if_omp_spins()
        if sleep_level not in (1, 2):
            raise ConfigError(f"sleep_level={sleep_level}: use 1 (weights offloaded to host RAM) or 2 (weights "
                              "dropped; the next push restores them)")
        engine_init_kwargs = dict(engine_init_kwargs or {})
        int8 = engine_init_kwargs.get("quantization") == INT8
        self.source_model_path = self.model_path = str(model_path)
        if is_moe_checkpoint(self.model_path):
            check_moe_quantization(engine_init_kwargs.get("quantization"), on_cpu)
        elif return_routed_experts:
            raise ConfigError(f"return_routed_experts=True but {self.model_path} has no experts (not an MoE "
                              "checkpoint); leave it off for dense models")
        if int8:  # served from a compressed-tensors checkpoint, not an online `quantization` (module doc)
            self.model_path = _int8_start_checkpoint(self.model_path, quantized_checkpoint_root, on_cpu)
        kwargs = llm_kwargs(self.model_path, on_cpu=on_cpu, engine_init_kwargs=engine_init_kwargs, seed=seed,
                            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                            enforce_eager=enforce_eager, dtype=dtype, enable_sleep_mode=enable_sleep_mode,
                            return_routed_experts=return_routed_experts)
        if on_cpu and dtype is None and "dtype" not in engine_init_kwargs:
            _log_cpu_dtype_once(*cpu_engine_dtype(quantization=engine_init_kwargs.get("quantization")))
        self.engine_init_kwargs = kwargs
        self.sleep_mode, self.sleep_level = bool(kwargs.get("enable_sleep_mode", False)), sleep_level
        self._validate = validate_weights
        self._expected_shapes = read_checkpoint_shapes(self.model_path) if validate_weights else {}
        # A tied model's checkpoint may omit lm_head.weight; the learner may still push it (vLLM skips it).
        self._optional_names = {"lm_head.weight"} if tied_embeddings(self.model_path) else set()
        self._llm = vllm.LLM(**kwargs)
        if on_cpu:  # a worker in a process of its own (spawned) imported vllm_worker but is not prepared yet
            self._llm.collective_rpc("portable_rl_prepare_cpu_worker")
        self.returns_routed_experts = return_routed_experts
        self._captures_routing = return_routed_experts and on_cpu
        if self._captures_routing:
            self._llm.collective_rpc("portable_rl_capture_routing")
        # What vLLM resolved: the `quantization` argument, or the method of a pre-quantized checkpoint.
        self.quantization = INT8 if int8 else vllm_internals.served_model_config(self._llm).quantization
        self.max_model_len = int(vllm_internals.served_model_config(self._llm).max_model_len)
        self._in_process = in_process
        # one worker in this process: pushes pass by reference; else through shared memory (module doc)
        self.pushes_by_reference = (in_process and vllm_internals.executor_backend(self._llm)
                                    in vllm_internals.SAME_PROCESS_EXECUTORS)
        VLLMEngine._live += in_process

    # ----------------------------------------------------------------------------------------- rollouts
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 seeds: Sequence[int] | None = None) -> list[Rollout]:
        from vllm.inputs import TokensPrompt

        llm = self._require_llm()
        prompts = check_prompts(prompt_token_ids)
        self._check(sampling)
        # One seed per prompt: vLLM gives the n children of a request seeds seed, seed+1, ..., so sample j of
        # prompt i gets seeds[i] + j (by default sampling.seed_for(i, j)).
        params = [self._params(sampling, seed) for seed in prompt_seeds(sampling, seeds, len(prompts))]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        captured = self._take_routing()  # after every generate, so the worker keeps nothing between calls
        # vLLM returns outputs in input order
        return [r for i, out in enumerate(outputs) for r in self._rollouts(i, prompts[i], out, sampling, captured)]

    def serving(self, requests: Sequence[Request]) -> Generator[Finished, Sequence[Request], None]:
        """Continuous batching (base.py, "Serving"): every request joins vLLM's running batch when it is sent,
        and a finished one is yielded right after the engine step that finished it, with the others of that
        step (in request order); the requests sent back join before the next step. A request with n > 1 is
        sent as its n samples (seeds seed + j, as vLLM seeds a request's n children), so each sample is
        answered as soon as it ends. In-process (one worker, `in_process=True`) each call of `LLMEngine.step`
        is one engine step, so what is served depends only on the requests, not on timing. An engine with
        the CPU routing capture (taken per `generate` call) serves in waves (the default)."""
        if self._captures_routing:
            yield from in_waves(self, requests)
            return
        llm = self._require_llm()
        running: dict[str, tuple[int, Request, int]] = {}  # our vLLM request id → (send order, request, sample)
        samples: dict[int, list] = {}  # send order → the request's rollouts so far, per sample
        sends = itertools.count()

        def send(batch):
            for request in batch:
                prompt = check_prompts([request.prompt_token_ids])[0]
                self._check(request.sampling)
                order = next(sends)
                samples[order] = [None] * request.sampling.n
                for j in range(request.sampling.n):
                    rid = f"portable_rl-serve-{order}-{j}"
                    params = self._params(dataclasses.replace(request.sampling, n=1), request.sampling.seed_for(0, j))
                    vllm_internals.add_request(llm, rid, prompt, params)
                    running[rid] = (order, request, j)

        try:
            send(requests)
            while running:
                finished = []
                for out in vllm_internals.step_outputs(llm):
                    order, request, j = running.pop(out.request_id)
                    samples[order][j], = self._rollouts(0, list(request.prompt_token_ids), out,
                                                        dataclasses.replace(request.sampling, n=1), None)
                    if all(r is not None for r in samples[order]):
                        finished.append((order, request, samples.pop(order)))
                if finished:
                    finished.sort(key=lambda f: f[0])
                    send((yield [(request, rollouts) for _, request, rollouts in finished]))
        finally:
            if running:  # the caller raised or closed the session: nothing of it stays in the engine
                vllm_internals.abort_requests(llm, list(running))

    def _check(self, sampling: SamplingConfig) -> None:
        self.check_sampling(sampling)
        # the top-k processed logprobs are finite exactly on the support (module doc); else the sampled one only
        if sampling.return_support and sampling.top_k > self.engine_init_kwargs["max_logprobs"]:
            raise ConfigError(f"top_k={sampling.top_k} with return_support needs the engine started with "
                              f"max_logprobs >= {sampling.top_k} (it has {self.engine_init_kwargs['max_logprobs']}); "
                              f"pass engine_init_kwargs={{'max_logprobs': {sampling.top_k}}}")

    @staticmethod
    def _params(sampling: SamplingConfig, seed: int | None):
        """vLLM's SamplingParams for one prompt's `sampling.n` samples, sample j seeded seed + j."""
        from vllm import SamplingParams

        return SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_tokens, min_tokens=sampling.min_tokens, seed=seed,
            stop_token_ids=list(sampling.stop_token_ids),
            # stop strings are matched on the detokenized text; the token completing one stays (base.py)
            stop=list(sampling.stop), include_stop_str_in_output=True, detokenize=bool(sampling.stop),
            # flat: per request a few primitive lists, not top_k Logprob objects per token
            logprobs=sampling.top_k if sampling.return_support else 0, flat_logprobs=sampling.return_support)

    def _take_routing(self) -> dict | None:
        """The CPU routing capture's records since the last take (None on GPU: vLLM returns them itself)."""
        if not self._captures_routing:
            return None
        return records_by_inputs(self._require_llm().collective_rpc("portable_rl_take_routed_experts")[0])

    @staticmethod
    def _rollouts(index: int, prompt: list[int], out, sampling: SamplingConfig, captured: dict | None
                  ) -> list[Rollout]:
        """The Rollouts of one vLLM RequestOutput, in sample order."""
        rollouts = []
        for completion in sorted(out.outputs, key=lambda c: c.index):
            tokens = list(completion.token_ids)
            support = None
            if sampling.return_support:
                logprobs, support = _sampled_and_support(tokens, completion.logprobs)
            else:
                logprobs = [float(pos[tok].logprob) for tok, pos in zip(tokens, completion.logprobs)]
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a request with {completion.finish_reason!r}")
            routed = None
            if sampling.return_routed_experts:  # [seq_len - 1, layers, top_k] (base.py, "Routed experts")
                routed = captured[tuple(prompt + tokens[:-1])].pop() if captured is not None \
                    else completion.routed_experts
            rollouts.append(Rollout(prompt_index=index, prompt_token_ids=prompt, response_token_ids=tokens,
                                    response_logprobs=logprobs, finish_reason=completion.finish_reason,
                                    sampling_support=support, routed_experts=routed))
        return rollouts

    # ----------------------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[NamedTensor]) -> None:
        """Full sync from the flat `(hf_name, tensor)` pairs; one layerwise reload, then a prefix-cache reset.

        The "bucket" is the whole push: the reload must see every weight at once (vllm_worker.py). In-process
        that holds only refs; a multi-process engine gets one shared-memory segment of all of them (module doc,
        "How the bytes move")."""
        llm = self._require_llm()
        pairs = named_tensor_pairs(named_tensors)
        if self.quantization == INT8:  # float projections → int8 + weight_scale; the learner's int8 pass through
            from portable_rl.engines.quantize import quantize_named_tensors_int8

            pairs = quantize_named_tensors_int8(pairs)
        pairs = list(pairs)  # zero-copy views stay views: only refs are held
        if self._validate:
            check_named_tensors(pairs, self._expected_shapes, self._optional_names)
        if self.pushes_by_reference:
            llm.collective_rpc("portable_rl_reload_weights", kwargs={"weights": pairs})
        else:
            with shared_segment(pairs) as manifest:  # unlinked once every worker has returned
                llm.collective_rpc("portable_rl_reload_shared_weights", kwargs={"manifest": manifest})
        llm.reset_prefix_cache()

    # ----------------------------------------------------------------------------------------- lifecycle
    def sleep(self) -> None:
        """Frees the weights (level 1: offloaded; 2: dropped) and the KV cache; module doc, "Sleep"."""
        llm = self._require_llm()
        if not self.sleep_mode and not _on_cpu():
            raise RuntimeError("VLLMEngine.sleep(): this engine was started without enable_sleep_mode=True, so vLLM "
                               "would free nothing; create it with enable_sleep_mode=True (gin: SLEEP_ENGINE = True "
                               "in gin/colocate.gin)")
        llm.sleep(level=self.sleep_level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Maps back what `sleep` freed: `tags` ["weights"] and/or ["kv_cache"], None for both."""
        bad = set(tags or ()) - {"weights", "kv_cache"}
        if bad:
            raise ValueError(f"wake_up tags {sorted(bad)}: use 'weights' and/or 'kv_cache' (None: both)")
        self._require_llm().wake_up(tags=list(tags) if tags else None)

    def close(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is None:
            return
        VLLMEngine._live -= self._in_process
        if not self._in_process or VLLMEngine._live == 0:
            # vLLM's shutdown also tears down its process-global distributed state, so a later LLM can start.
            vllm_internals.shutdown_engine(llm, in_process=self._in_process)
        else:  # another in-process engine still uses that process-global state: free only this one's worker
            vllm_internals.free_in_process_worker(llm)
        del llm
        gc.collect()

    def _require_llm(self):
        if self._llm is None:
            raise RuntimeError("this VLLMEngine is closed; create a new one")
        return self._llm

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass
