"""Mixture-of-experts on vLLM: what an MoE checkpoint may be served with, the CPU expert reload fix, and the
router's top-k captured inside the engine (routing replay on vLLM-CPU).

Pushes. The learner pushes the HF per-expert pairs (`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`;
Qwen2-MoE adds `mlp.shared_expert.*` and `mlp.shared_expert_gate`), checked against the checkpoint's headers
like any other push. vLLM's loader (`RoutedExperts.load_weights`, vllm 0.32) maps each per-expert tensor by a
dict lookup to one slice copy: gate_proj → `w13_weight[e, :I]`, up_proj → `w13_weight[e, I:]`, down_proj →
`w2_weight[e]` ([E, 2I, H] and [E, H, I]). That is the only per-expert loop, vLLM's own; the adapter adds none.

Served with (`check_moe_quantization` refuses the rest at start, in one line):
    unquantized (float32 / bfloat16)   CPU and GPU
    int8_per_channel                   CPU with AMX (tested): the INT8 start checkpoint and every push carry the experts
                                       as int8 + per-channel scale like the dense projections, the routers
                                       unquantized (engines/quantize.py); vLLM serves them with
                                       `CompressedTensorsW8A8Int8MoEMethod` (`CPUExpertsInt8` on x86). GPU: untested
    fp8_per_channel / fp8 / ...        GPU only: vLLM-CPU 0.32's online FP8 MoE quantization
                                       (`Fp8PtpcOnlineMoEMethod`) calls `dynamic_per_token_scaled_fp8_quant`,
                                       a CUDA op vLLM-CPU does not build (the engine dies at start)

CPU expert reload (`apply_cpu_reload_fix`). vLLM-CPU's unquantized experts (`CPUUnquantizedExperts`) prepack
w13/w2 into their grouped-GEMM layout in `process_weights_after_loading`, which
`UnquantizedFusedMoEMethod.process_weights_after_loading` calls on the FIRST load only (`moe_kernel is None`).
A layerwise reload (vllm_worker.py) then leaves the raw, unpacked weights where the kernel reads packed ones:
measured with vllm-cpu 0.32 on a tiny Qwen3-MoE, a push's greedy tokens differ from a fresh engine's on the
same weights. The fix runs the experts' own prepack again after every reload of the layer; GPU experts keep
vLLM's behaviour (their hook is a no-op there).

Routing capture (`RoutingCapture`, vLLM-CPU). vLLM's own `enable_return_routed_experts` needs Model Runner V2,
which needs Triton: vLLM-CPU refuses to start with it. So the worker records the router's top-k itself,
through the hook vLLM's capturer uses (`BaseRouter.set_capture_fn`, called with the logical top-k ids
[tokens, top_k] of every forward, before any EPLB remapping), and attributes each row to its request and
position from the model runner's batch: rows follow `input_batch.req_ids`, `num_scheduled_tokens[req]` rows
each, at the positions `_model_forward` was given. The result per finished sequence is vLLM's layout
(`CompletionOutput.routed_experts`, see engines/base.py `Rollout.routed_experts`):

    routed_experts[p][l] = the top_k experts layer l routed the token at position p to, p < len(sequence) - 1

(the last sampled token is never an input). Prefix caching is off while capturing (a cached prompt block
would have no rows), and the engine must be eager (the hook is a Python call inside the forward).

vLLM symbols this module depends on (vllm 0.32; `check_vllm_symbols` fails in one line naming the one that
changed; tests/test_engines_vllm_moe.py runs it):
    fused_moe.router.base_router.BaseRouter.set_capture_fn / ._select_experts   the top-k hook
    fused_moe.runner.moe_runner.MoERunner (.router, .layer_id)                   one per MoE layer
    v1.worker.gpu_model_runner.GPUModelRunner.execute_model(scheduler_output)    one scheduler step
    v1.worker.gpu_model_runner.GPUModelRunner._model_forward(input_ids, positions)  the step's token rows
    fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod             the reload fix
    fused_moe.experts.cpu_moe.CPUUnquantizedExperts.process_weights_after_loading  the CPU prepack
"""

from __future__ import annotations

import inspect
import json
import os
from functools import partial

import numpy as np

from portable_rl.errors import ConfigError

SUPPORTED_VLLM = (0, 32)  # the minor release whose MoE internals this module reads
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen-MoE, Mixtral, DeepSeek
INT8 = "int8_per_channel"
_RELOAD_FIX_APPLIED = False


def is_moe_checkpoint(model_path: str) -> bool:
    """True when config.json of `model_path` declares routed experts."""
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    return any((config.get(key) or 0) > 0 for key in MOE_CONFIG_KEYS)


def cpu_serves_int8_experts() -> bool:
    """vLLM-CPU 0.32's only INT8 MoE kernel (`CPUExpertsInt8`) needs an x86 CPU with AMX tiles."""
    import platform

    import torch

    return platform.machine() in ("x86_64", "AMD64") and bool(torch.cpu._is_amx_tile_supported())


def check_moe_quantization(quantization: str | None, on_cpu: bool) -> None:
    """Refuses, in one line, the quantization schemes vLLM cannot serve an MoE checkpoint with (module doc)."""
    if quantization and quantization != INT8 and on_cpu:
        raise ConfigError(f"quantization={quantization!r}: vLLM-CPU 0.32 cannot serve MoE experts in FP8 (its "
                          "online FP8 MoE quantization calls a CUDA-only kernel); on CPU serve this MoE checkpoint "
                          "with quantization='int8_per_channel' or unquantized (None), or use FP8 on a GPU")
    if quantization == INT8 and on_cpu and not cpu_serves_int8_experts():
        raise ConfigError("quantization='int8_per_channel': vLLM-CPU 0.32 serves INT8 MoE experts only on x86 CPUs "
                          "with AMX (CPUExpertsInt8), and this CPU has none; serve this MoE checkpoint unquantized "
                          "(None) here, or INT8 on a GPU or an AMX CPU")


def check_vllm_symbols() -> None:
    """Raises RuntimeError, in one line naming the vLLM version and symbol, when an internal this module relies
    on is gone or has a new signature."""
    import vllm

    def fail(symbol: str, what: str):
        raise RuntimeError(f"vLLM {vllm.__version__}: {symbol} {what}; portable_rl's MoE routing capture "
                           f"(engines/vllm_moe.py) is written for vLLM {SUPPORTED_VLLM[0]}.{SUPPORTED_VLLM[1]}")

    def params(fn) -> list[str]:
        return list(inspect.signature(fn).parameters)

    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError as e:
        fail(e.name or "a fused_moe module", f"cannot be imported ({e})")
    if params(getattr(BaseRouter, "set_capture_fn", None) or (lambda: None)) != ["self", "capture_fn"]:
        fail("BaseRouter.set_capture_fn", "is gone or no longer takes (capture_fn)")
    if "self.capture_fn(topk_ids)" not in inspect.getsource(BaseRouter._select_experts):
        fail("BaseRouter._select_experts", "no longer calls self.capture_fn(topk_ids)")
    if not (isinstance(getattr(MoERunner, "layer_id", None), property) and "router" in
            inspect.getsource(MoERunner.__init__)):
        fail("MoERunner", "has no layer_id property or router attribute")
    if params(GPUModelRunner.execute_model)[:2] != ["self", "scheduler_output"]:
        fail("GPUModelRunner.execute_model", "no longer takes (scheduler_output, ...)")
    if params(GPUModelRunner._model_forward)[:3] != ["self", "input_ids", "positions"]:
        fail("GPUModelRunner._model_forward", "no longer takes (input_ids, positions, ...)")
    if params(UnquantizedFusedMoEMethod.process_weights_after_loading) != ["self", "layer"]:
        fail("UnquantizedFusedMoEMethod.process_weights_after_loading", "no longer takes (layer)")
    if params(CPUUnquantizedExperts.process_weights_after_loading) != ["self", "layer"]:
        fail("CPUUnquantizedExperts.process_weights_after_loading", "no longer takes (layer)")


# ------------------------------------------------------------------------------------------- reload fix
def _prepack_again_on_reload(process_weights_after_loading):
    def process_weights_after_loading_and_prepack(self, layer):
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.utils import is_weights_pre_processed

        reload = self.moe_kernel is not None  # vLLM skips the experts' own processing then (module doc)
        process_weights_after_loading(self, layer)
        experts = self.moe_kernel.fused_experts if self.moe_kernel is not None else None
        if reload and not is_weights_pre_processed() and isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)

    process_weights_after_loading_and_prepack._portable_rl_wrapped = True
    process_weights_after_loading_and_prepack._portable_rl_original = process_weights_after_loading
    return process_weights_after_loading_and_prepack


def apply_cpu_reload_fix() -> bool:
    """Installs the CPU expert reload fix once (module doc); False when this vLLM has no such MoE method."""
    global _RELOAD_FIX_APPLIED
    if _RELOAD_FIX_APPLIED:
        return True
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod as M
    except ImportError:
        return False
    if not getattr(M.process_weights_after_loading, "_portable_rl_wrapped", False):
        M.process_weights_after_loading = _prepack_again_on_reload(M.process_weights_after_loading)
    _RELOAD_FIX_APPLIED = True
    return True


# ------------------------------------------------------------------------------------------- routing capture
class RoutingCapture:
    """Records, inside one vLLM worker, every MoE layer's top-k expert ids per (request, position) (module doc).

    Installed on a model runner (`install`); `take()` returns what the finished requests routed and forgets it.
    """

    def __init__(self, model_runner):
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        check_vllm_symbols()
        runners = sorted((m.layer_id, m) for m in model_runner.get_model().modules() if isinstance(m, MoERunner))
        if not runners:
            raise ConfigError("routing capture asked of a model without MoE layers; leave return_routed_experts off")
        for index, (_, runner) in enumerate(runners):
            runner.router.set_capture_fn(partial(self._capture, index))
        self.num_layers = len(runners)
        # vLLM's CompletionOutput.routed_experts dtype: the narrowest that holds every expert id
        self.dtype = np.uint8 if runners[0][1].router.global_num_experts <= 256 else np.uint16
        self._runner = model_runner
        self._step: dict[int, np.ndarray] | None = None  # layer index → top-k ids [rows, k], during a step
        self._rows: tuple[np.ndarray, np.ndarray] | None = None  # the step's (input_ids, positions)
        self._requests: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        execute_model, model_forward = model_runner.execute_model, model_runner._model_forward

        def execute_model_capturing(scheduler_output, *args, **kwargs):
            self._step, self._rows = {}, None
            try:
                return execute_model(scheduler_output, *args, **kwargs)
            finally:
                step, self._step = self._step, None
                self._record(step, scheduler_output)

        def model_forward_capturing(input_ids=None, positions=None, *args, **kwargs):
            if self._step is not None and input_ids is not None:
                # copies: on CPU .numpy() would view the runner's persistent buffers, rewritten every step
                self._rows = (input_ids.cpu().numpy().copy(), positions.cpu().numpy().copy())
            return model_forward(input_ids, positions, *args, **kwargs)

        model_runner.execute_model = execute_model_capturing
        model_runner._model_forward = model_forward_capturing

    def _capture(self, layer_index: int, topk_ids) -> None:
        if self._step is not None:  # outside a scheduler step: warm-up and dummy runs
            self._step[layer_index] = topk_ids.cpu().numpy().copy()

    def _record(self, step, scheduler_output) -> None:
        if not step or self._rows is None:
            return
        if len(step) != self.num_layers:
            raise RuntimeError(f"routing capture: {len(step)} of {self.num_layers} MoE layers routed this step")
        req_ids = list(self._runner.input_batch.req_ids)
        counts = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
        n = sum(counts)
        experts = np.stack([step[layer][:n] for layer in range(self.num_layers)], axis=1)  # [n, layers, k]
        input_ids, positions = (a[:n] for a in self._rows)  # rows past n are padding
        start = 0
        for req_id, count in zip(req_ids, counts):
            end = start + count
            self._requests.setdefault(req_id, []).append(
                (positions[start:end], input_ids[start:end], experts[start:end]))
            start = end

    def take(self) -> list[tuple[list[int], np.ndarray]]:
        """Per request seen since the last call: (its input tokens by position, top-k ids [positions, layers, k],
        sorted within a row, uint8 / uint16).
        A position computed twice (a preempted request recomputed) keeps its last row."""
        out = []
        for chunks in self._requests.values():
            positions = np.concatenate([c[0] for c in chunks])
            tokens = np.concatenate([c[1] for c in chunks])
            experts = np.concatenate([c[2] for c in chunks])
            last = len(positions) - 1 - np.unique(positions[::-1], return_index=True)[1]  # sorted by position
            if not np.array_equal(positions[last], np.arange(len(last))):
                raise RuntimeError("routing capture: a request's positions do not start at 0 or have gaps "
                                   "(prefix caching must be off while capturing)")
            out.append((tokens[last].tolist(), np.sort(experts[last], axis=-1).astype(self.dtype)))
        self._requests.clear()
        return out


def records_by_inputs(records: list[tuple[list[int], np.ndarray]]) -> dict[tuple[int, ...], list[np.ndarray]]:
    """`RoutingCapture.take()` records keyed by their input tokens: a finished sequence prompt + response
    finds its rows under tuple(prompt + response[:-1]) (identical sequences share a key, one record each)."""
    by_inputs: dict[tuple[int, ...], list[np.ndarray]] = {}
    for tokens, experts in records:
        by_inputs.setdefault(tuple(tokens), []).append(experts)
    return by_inputs
