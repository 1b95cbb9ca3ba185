"""What the SGLang adapter relies on beyond SGLang's public Engine API (written against sglang 0.5.23), each with a
canary that reads SGLang's source (never imported: SGLang needs CUDA, so a wheel is read on a CPU box):

    python -m portable_rl.engines.sglang_internals [sglang-X.Y.Z-*.whl | unpacked dir]   # default: installed

prints one line per broken internal ("SGLang <version>: <symbol>: <what changed>; update <our file>") and exits
1 if there is any. The adapter touches no private attribute; its risks are behaviours read from SGLang's source
(which env var turns logprobs to T=1, which models the flash_rl reload supports, when seeds count, which INT8
methods cannot reload in place), listed in `INTERNALS`. The keyword sets and signatures of the public calls are
recorded separately (tests/sglang_api.py, tests/fixtures/sglang_api_<version>.json) and drive the strict fake
the adapter is tested against. tests/test_sglang_internals.py runs the canaries when a source is present
(installed sglang, or SGLANG_SRC=<wheel or dir>). Upgrading: docs/engines.md, "Upgrading vLLM / SGLang".
"""

from __future__ import annotations

import ast
import sys

from portable_rl.engines import canary
from portable_rl.engines.canary import (Internal, PackageSource, Problem, class_fields, find_class, find_function,
                                        method_problem, names_used, parameters, string_constants)

# [lower, upper): the releases the adapter is written against (0.5.23's source layout, tests/fixtures/
# sglang_api_0.5.23.json); a later 0.5.x must pass the canaries and tests/sglang_api.py before the upper bound moves.
SUPPORTED_SGLANG = ((0, 5, 23), (0, 6))


def check_sglang_version(version: str) -> None:
    """Raises ConfigError unless `version` lies in SUPPORTED_SGLANG (the one check vLLM's adapter makes too)."""
    canary.check_version("SGLang", version, SUPPORTED_SGLANG, "pip install -r requirements/gpu-sglang.txt (or "
                         "'sglang>=0.5.23,<0.6') in the SGLang environment")


# The env var that makes SGLang's sampler return T=1 logprobs instead of the tempered ones (refused).
RETURN_ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
# The architectures whose `load_weights` carry the `supports_quantized_rl_reload` mark (the flash_rl loader
# refuses the others at load): {architecture: the models/ module defining it}.
FLASH_RL_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# INT8 W8A8 linear methods whose processed weights cannot be reloaded in place (no
# restore_weights_before_loading): the adapter refuses INT8.
INT8_W8A8_METHODS = {"sglang.srt.layers.quantization.w8a8_int8": "W8A8Int8LinearMethod",
                     "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_int8":
                     "CompressedTensorsW8A8Int8"}
# ServerArgs fields and SamplingParams keys the adapter passes.
SERVER_ARGS = ("model_path", "random_seed", "dtype", "enable_deterministic_inference", "enable_memory_saver",
               "enable_weights_cpu_backup", "quantization", "load_format")
SAMPLING_KEYS = ("temperature", "max_new_tokens", "top_p", "top_k", "stop_token_ids", "stop", "no_stop_trim",
                 "sampling_seed")

_ADAPTER = "portable_rl/engines/sglang_adapter.py"


def server_args_fields(src: PackageSource) -> set[str]:
    """Every `ServerArgs` field: its own and those of the namespace classes in `_INPUT_NAMESPACES`
    (srt/server_args.py), declared in srt/arg_groups/fields/*.py (0.5.23 layout)."""
    tree = src.tree("sglang.srt.server_args")
    namespaces = None
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_INPUT_NAMESPACES":
            namespaces = [e.id for e in node.value.elts]
    if namespaces is None:
        raise ValueError("no _INPUT_NAMESPACES in sglang/srt/server_args.py (layout changed since 0.5.23)")
    classes = {}
    for rel in src.glob("sglang/srt/arg_groups/fields/*.py"):
        for node in src.tree(rel.removesuffix(".py").replace("/", ".")).body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node
    fields = class_fields(find_class(tree, "ServerArgs"))
    for name in namespaces:
        fields |= class_fields(classes[name])
    return fields


def _check_return_original_logprob(src):
    return None if RETURN_ORIGINAL_LOGPROB_ENV in string_constants(src.tree("sglang.srt.layers.sampler")) else \
        f"the sampler no longer reads {RETURN_ORIGINAL_LOGPROB_ENV} (find what now switches logprobs to T=1)"


def _check_flash_rl(src):
    if "flash_rl" not in string_constants(src.tree("sglang.srt.configs.load_config")):
        return "load_format 'flash_rl' is gone from configs/load_config.py"
    marked = {}
    for rel in src.glob("sglang/srt/models/*.py"):
        text = src.read(rel.removesuffix(".py").replace("/", "."))
        if "supports_quantized_rl_reload" in text:
            marked[rel.rsplit("/", 1)[1].removesuffix(".py")] = {
                n.name for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name.endswith("ForCausalLM")}
    lost = sorted(a for a, module in FLASH_RL_ARCHITECTURES.items() if a not in marked.get(module, ()))
    new = sorted(a for module, archs in marked.items() for a in archs if a not in FLASH_RL_ARCHITECTURES)
    if lost:
        return f"{', '.join(lost)} no longer carry the supports_quantized_rl_reload mark (narrow FLASH_RL_ARCHITECTURES)"
    return f"models now also marked for the flash_rl reload: {', '.join(new)} (widen FLASH_RL_ARCHITECTURES)" \
        if new else None


def _check_seeds(src):
    used = names_used(src.tree("sglang.srt.sampling.sampling_batch_info"))
    return None if {"sampling_seed", "enable_deterministic_inference"} <= used else \
        "sampling_batch_info no longer ties sampling_seed to enable_deterministic_inference (re-read when seeds count)"


def _check_session(src):
    engine = "sglang.srt.entrypoints.engine"
    fn, problem = method_problem(src, engine, "Engine", "update_weights_from_tensor")
    if problem:
        return problem
    missing = {"named_tensors", "flush_cache"} - set(parameters(fn))
    if missing:
        return f"Engine.update_weights_from_tensor lost parameter(s) {sorted(missing)}"
    for method in ("begin_weight_update", "end_weight_update", "flush_cache"):
        problem = method_problem(src, engine, "Engine", method)[1]
        if problem:
            return problem
    updater = string_constants(src.tree("sglang.srt.managers.scheduler_components.weight_updater"))
    return None if any(t.startswith("update_weights_from_tensor must run between") for t in updater) else \
        "weight_updater no longer refuses updates outside a begin/end session (re-read the session contract)"


def _check_int8_not_reloadable(src):
    for module, cls in INT8_W8A8_METHODS.items():
        klass = find_class(src.tree(module), cls)
        if klass is None:
            return f"{module}.{cls} is gone (re-read how SGLang serves INT8 W8A8)"
        if find_function(klass, "restore_weights_before_loading"):
            return f"{cls} now defines restore_weights_before_loading: INT8 may reload in place (lift the refusal)"
    return None


def _check_memory_saver(src):
    missing = {"enable_memory_saver", "enable_weights_cpu_backup"} - server_args_fields(src)
    if missing:
        return f"ServerArgs lost {sorted(missing)}"
    return None if "weights" in string_constants(src.tree("sglang.srt.constants")) else \
        "GPU_MEMORY_ALL_TYPES no longer includes 'weights' (sleep() would not free them)"


def _check_keywords(src):
    missing = set(SERVER_ARGS) - server_args_fields(src)
    if missing:
        return f"ServerArgs lost field(s) {sorted(missing)} (Engine(**kwargs) would refuse them)"
    fields = class_fields(find_class(src.tree("sglang.srt.sampling.sampling_params"), "SamplingParams"))
    missing = set(SAMPLING_KEYS) - fields
    return f"SamplingParams lost {sorted(missing)}" if missing else None


def _check_stop_trim(src):
    manager = find_class(src.tree("sglang.srt.managers.detokenizer_manager"), "DetokenizerManager")
    trim = find_function(manager, "trim_matched_stop")
    if trim is None or "no_stop_trim" not in parameters(trim):
        return "DetokenizerManager.trim_matched_stop(output, finished_reason, no_stop_trim) is gone (re-read how " \
               "stop strings are trimmed)"
    handler = find_function(manager, "handle_batch_token_id_out")
    return None if "output_token_logprobs_idx" in names_used(handler) else \
        "handle_batch_token_id_out no longer passes output_token_logprobs_idx through (are the ids trimmed now?)"


def _check_context_refusal(src):
    for rel in src.glob("sglang/srt/managers/*.py"):  # tokenizer_manager.py or one of its mixins
        texts = string_constants(src.tree(rel.removesuffix(".py").replace("/", ".")))
        if any(t.startswith("Requested token count exceeds") for t in texts):
            return None
    return "srt/managers no longer refuses prompt + max_new_tokens past the context (the adapter's cut may be moot)"


def _check_cancel_aborts(src):
    manager = find_class(src.tree("sglang.srt.managers.tokenizer_manager"), "TokenizerManager")
    generate = find_function(manager, "generate_request")
    release = find_function(manager, "_release_req_states_on_failure")
    if generate is None or release is None:
        return "TokenizerManager.generate_request or _release_req_states_on_failure is gone (re-read how a " \
               "cancelled async_generate is aborted)"
    handlers = [h for node in ast.walk(generate) if isinstance(node, ast.Try) for h in node.handlers]
    if not any(isinstance(h.type, ast.Name) and h.type.id == "BaseException" and
               "_release_req_states_on_failure" in names_used(h) for h in handlers):
        return "generate_request no longer releases its requests on BaseException (a cancelled task's request may " \
               "keep running)"
    return None if "abort_request" in names_used(release) else \
        "_release_req_states_on_failure no longer aborts dispatched requests"


INTERNALS: tuple[Internal, ...] = (
    Internal("tempered_logprobs", "sglang.srt.layers.sampler.SGLANG_RETURN_ORIGINAL_LOGPROB",
             "logprobs are log(softmax(logits / T)) unless this env var is set (then T=1); the adapter refuses it",
             f"{_ADAPTER}:SGLangEngine.__init__", _check_return_original_logprob),
    Internal("flash_rl_architectures", "sglang.srt.models.*.load_weights.supports_quantized_rl_reload",
             f"load_format='flash_rl' loads only models whose load_weights carry the mark: "
             f"{', '.join(FLASH_RL_ARCHITECTURES)}", "portable_rl/engines/sglang_internals.py:FLASH_RL_ARCHITECTURES",
             _check_flash_rl),
    Internal("seeds_need_deterministic_inference", "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo",
             "a request's sampling_seed is read only with enable_deterministic_inference=True",
             f"{_ADAPTER}:SGLangEngine.__init__ (deterministic)", _check_seeds),
    Internal("weight_update_session", "sglang.srt.entrypoints.engine.Engine.begin_weight_update",
             "update_weights_from_tensor(named_tensors, flush_cache) loads only between begin_ and end_weight_update "
             "(which restore and re-pack quantized weights)", f"{_ADAPTER}:SGLangEngine.update_weights",
             _check_session),
    Internal("int8_w8a8_not_reloadable", "sglang.srt.layers.quantization.w8a8_int8.W8A8Int8LinearMethod",
             "its processed int8 weight has no weight_loader and no restore_weights_before_loading, so a push would "
             "kill the engine: INT8 is refused", f"{_ADAPTER}:SGLangEngine.__init__ (INT8 refusal)",
             _check_int8_not_reloadable),
    Internal("memory_saver", "sglang.srt.server_args.ServerArgs.enable_memory_saver",
             "with enable_memory_saver + enable_weights_cpu_backup, release_memory_occupation frees weights, KV "
             "cache and CUDA graphs and resume restores the weights", f"{_ADAPTER}:SGLangEngine.sleep",
             _check_memory_saver),
    Internal("stop_strings_keep_ids", "sglang.srt.managers.detokenizer_manager.DetokenizerManager.trim_matched_stop",
             "a matched stop string is trimmed from the text only (not with no_stop_trim=True), never from the "
             "returned output_token_logprobs ids", f"{_ADAPTER}:SGLangEngine.generate (stop)", _check_stop_trim),
    Internal("context_length_refusal", "sglang.srt.managers.tokenizer_manager (_validate_one_request)",
             "a request with prompt + max_new_tokens >= context_length is refused", f"{_ADAPTER}:SGLangEngine.generate "
             "(max_new_tokens cut to max_model_len)", _check_context_refusal),
    Internal("cancel_aborts", "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
             "cancelling an async_generate task aborts its request in the scheduler (the BaseException cleanup, "
             "_release_req_states_on_failure → abort_request)", f"{_ADAPTER}:SGLangEngine.serving",
             _check_cancel_aborts),
    Internal("engine_keywords", "sglang.srt.server_args.ServerArgs / sglang.srt.sampling.sampling_params.SamplingParams",
             f"ServerArgs has {', '.join(SERVER_ARGS)}; SamplingParams has {', '.join(SAMPLING_KEYS)}",
             f"{_ADAPTER}:SGLangEngine", _check_keywords),
)


def check_internals(where: str | None = None) -> list[Problem]:
    """One Problem per internal that SGLang's source at `where` (a wheel, a directory holding sglang/, None: the
    installed one) breaks."""
    src = PackageSource("sglang", where)
    return canary.check_internals(INTERNALS, src, "SGLang")


if __name__ == "__main__":
    sys.exit(canary.main(check_internals, f"all {len(INTERNALS)} SGLang internals hold", sys.argv[1:]))
