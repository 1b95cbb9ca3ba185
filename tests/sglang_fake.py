"""A strict in-memory stand-in for sglang 0.5.23's `Engine`, for CPU tests of the SGLang adapter.

sglang needs CUDA, so it cannot run here; `scripts/gpu_check_sglang.py` runs the adapter against the real
engine on a GPU box. This fake is as strict as the real API where the adapter touches it, with every rule
taken from the 0.5.23 source (paths relative to sglang/srt/) or from the recorded table
`tests/fixtures/sglang_api_0.5.23.json` (`tests/sglang_api.py` reads it from the wheel):

  keywords      `Engine(**kwargs)` accepts exactly the ServerArgs fields (a msgspec Struct: an unknown keyword
                is a TypeError); each method binds its arguments against the recorded signature (TypeError
                for unknown ones); sampling_params keys must be SamplingParams fields.
  seeds         `sampling_seed` is used only with enable_deterministic_inference=True (a request without one
                then gets 42: sampling/sampling_batch_info.py); otherwise all requests draw from one engine
                RNG, so the same seed gives different samples.
  weight sync   update_weights_from_tensor outside begin/end_weight_update replies (False, message) and
                loads nothing; a load that raises inside the engine (unknown name, wrong shape or dtype,
                non-canonical name or partial fused q/k/v / gate-up update under flash_rl with per-tensor
                FP8: model_loader/loader.py) kills the process tree — here `EngineProcessDied`, a
                BaseException no `except Exception` catches, as nothing catches a SIGKILL.
  stop strings  matched on the decoded text (here one letter per token, `fake_text`); the returned ids keep the
                token completing the string, the text is cut before it unless no_stop_trim (detokenizer_manager.py).
  context       a prompt of context_length (else the config's max_position_embeddings) tokens or more, or
                prompt + max_new_tokens past it, is a ValueError (tokenizer_manager.py, _validate_one_request).
  flush_cache   returns an object with .success / .message (FlushCacheReqOutput).
  memory        release_memory_occupation is a no-op without enable_memory_saver; with it, the default tags
                (kv_cache, weights, cuda_graph) are freed and the weights come back as garbage (here: zeros)
                unless enable_weights_cpu_backup is set.
  loading       load_format="flash_rl" rejects non-Qwen2/Qwen3 models; a config with weight_block_size needs
                FP8-serialized projection weights (layers/quantization/fp8.py).

Its "model" is a bigram on the tied embedding (logits = E[prev] · Eᵀ · 10), so pushed weights visibly matter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import os

import torch
from safetensors.torch import load_file

from portable_rl.engines.buckets import fused_group
from portable_rl.engines.sglang_internals import FLASH_RL_ARCHITECTURES  # checked against the source there
from sglang_api import load_recorded

API = load_recorded("0.5.23")
SERVER_ARGS = frozenset(API["server_args"])
SAMPLING_PARAMS = frozenset(API["sampling_params"])
UNSEEDED_DEFAULT = 42  # sampling_batch_info.py: deterministic mode, request without sampling_seed


def fake_text(ids) -> str:
    """The fake's detokenizer: token t reads as one letter, chr(97 + t % 26)."""
    return "".join(chr(97 + t % 26) for t in ids)


class EngineProcessDied(BaseException):
    """The scheduler raised inside a load: SIGQUIT → kill_process_tree, the trainer's process included."""


@dataclasses.dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


def recorded_signature(method: str) -> inspect.Signature:
    """The 0.5.23 signature of `Engine.<method>` from the recorded table."""
    params = []
    for name, default in API["engine"][method]:
        if name.startswith("**"):
            params.append(inspect.Parameter(name[2:], inspect.Parameter.VAR_KEYWORD))
        elif name.startswith("*"):
            params.append(inspect.Parameter(name[1:], inspect.Parameter.VAR_POSITIONAL))
        else:
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
            params.append(inspect.Parameter(name, kind) if default is None
                          else inspect.Parameter(name, kind, default=eval(default)))  # literals only
    return inspect.Signature(params)


def strict(fn):
    """Binds a call against the recorded signature of the method of the same name (TypeError like Python's)."""
    signature = recorded_signature(fn.__name__)

    def arguments(self, args, kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop("self")
        return arguments

    if fn.__name__ in API["engine_coroutines"]:  # `async def` in SGLang: binds when called, runs when awaited
        assert inspect.iscoroutinefunction(fn), fn.__name__

        async def wrapper(self, *args, **kwargs):
            return await fn(self, **arguments(self, args, kwargs))
    else:
        def wrapper(self, *args, **kwargs):
            return fn(self, **arguments(self, args, kwargs))

    wrapper.__name__ = fn.__name__
    wrapper.__signature__ = signature
    return wrapper


class FakeSGLangEngine:
    """Records every call; behaves like sglang 0.5.23's Engine for the calls the adapter makes."""

    per_tensor_fp8 = True  # flash_rl without cutlass FP8: per-tensor scales (the strict case)

    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - SERVER_ARGS)
        if unknown:  # msgspec.Struct's message
            raise TypeError(f"Unexpected keyword argument '{unknown[0]}'")
        if "model_path" not in kwargs:
            raise TypeError("Missing required argument 'model_path'")
        self.kwargs = kwargs
        self.calls = []
        path = kwargs["model_path"]
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        if kwargs.get("load_format") == "flash_rl" and config["architectures"][0] not in FLASH_RL_ARCHITECTURES:
            raise ValueError(f"FlashRL does not support {config['architectures'][0]}.load_weights")
        self.weights = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                self.weights.update(load_file(os.path.join(path, f)))
        block = (config.get("quantization_config") or {}).get("weight_block_size")
        if block is not None and self.weights["model.layers.0.self_attn.q_proj.weight"].dtype != torch.float8_e4m3fn:
            raise ValueError("The block-wise quantization only supports fp8-serialized checkpoint for now.")
        self.context_len = int(kwargs.get("context_length") or config["max_position_embeddings"])
        self.deterministic = bool(kwargs.get("enable_deterministic_inference", False))
        self.global_rng = torch.Generator().manual_seed(int(kwargs.get("random_seed") or 0))
        self.session = None
        self.released = set()
        self.memory_freed = False
        self.loop = asyncio.new_event_loop()  # Engine.loop: generate and async_generate run on it
        self.running = self.aborted = 0  # async_generate requests in the scheduler; cancelled ones

    # --------------------------------------------------------------------------------------------- model
    def _logits(self, prev):
        embed = self.weights["model.embed_tokens.weight"].float()  # [V, D]
        return embed[prev] @ embed.T * 10.0  # [V]

    @strict
    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False, **unmodelled):
        self.calls.append(("generate", dict(input_ids=input_ids, sampling_params=sampling_params,
                                            return_logprob=return_logprob)))
        self._modelled("generate", prompt, unmodelled)
        single = isinstance(input_ids[0], int)
        batch = [input_ids] if single else input_ids
        params = [sampling_params] * len(batch) if isinstance(sampling_params, dict) else sampling_params
        outs = []
        for ids, p in zip(batch, params, strict=True):
            decode = self._decode(ids, p)
            while True:
                try:
                    next(decode)
                except StopIteration as done:
                    outs.append(done.value)
                    break
        return outs[0] if single else outs

    @strict
    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             **unmodelled):
        """One request (the adapter's serving sends one per sample) as the scheduler serves it: one token per
        turn of the event loop, so a short request finishes before a long one sent with it; a cancelled task
        is aborted (tokenizer_manager.generate_request's cleanup)."""
        self.calls.append(("async_generate", dict(input_ids=input_ids, sampling_params=sampling_params,
                                                  return_logprob=return_logprob)))
        self._modelled("async_generate", prompt, unmodelled)
        if asyncio.get_running_loop() is not self.loop:  # the tokenizer manager's handle loop is the engine's
            raise RuntimeError("async_generate awaited outside Engine.loop")
        if not isinstance(input_ids[0], int) or not isinstance(sampling_params, dict):
            raise NotImplementedError("the fake's async_generate models one request per call")
        self.running += 1
        try:
            decode = self._decode(input_ids, sampling_params)
            while True:
                try:
                    next(decode)
                except StopIteration as done:
                    return done.value
                await asyncio.sleep(0)  # one decode step; the other running requests take theirs
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.running -= 1

    def _modelled(self, method, prompt, unmodelled):
        changed = {k: v for k, v in unmodelled.items() if v != recorded_signature(method).parameters[k].default}
        if prompt is not None or changed:
            raise NotImplementedError(f"the fake models input_ids/sampling_params/return_logprob only: {changed}")

    def _decode(self, ids, p):
        """One request, a generator: yields after each token, returns SGLang's output dict."""
        unknown = sorted(set(p) - SAMPLING_PARAMS)
        if unknown:
            raise TypeError(f"Unexpected keyword argument '{unknown[0]}'")
        if self.deterministic:
            gen = torch.Generator().manual_seed(int(p.get("sampling_seed", UNSEEDED_DEFAULT)))
        else:  # sampling_seed is ignored
            gen = self.global_rng
        limit = p.get("max_new_tokens", 128)
        if len(ids) >= self.context_len or limit + len(ids) > self.context_len:  # _validate_one_request
            raise ValueError(f"Requested token count exceeds the model's maximum context length of "
                             f"{self.context_len} tokens.")
        prev, toks, lps, finish = ids[-1], [], [], {"type": "length", "length": limit}
        for _ in range(limit):
            logp = torch.log_softmax(self._logits(prev) / p.get("temperature", 1.0), -1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
            toks.append(tok)
            lps.append((float(logp[tok]), tok, None))
            prev = tok
            if tok in (p.get("stop_token_ids") or ()):
                finish = {"type": "stop", "matched": tok}
                break
            matched = [s for s in p.get("stop") or () if s in fake_text(toks)]
            if matched:  # the scheduler's check on the decoded text; the ids keep the completing token
                finish = {"type": "stop", "matched": matched[0]}
                break
            yield
        text = fake_text(toks)
        if finish.get("matched") in (p.get("stop") or ()) and not p.get("no_stop_trim"):
            text = text[:text.find(finish["matched"])]  # detokenizer_manager.trim_matched_stop: the text only
        return {"text": text, "output_ids": toks, "meta_info": {"output_token_logprobs": lps, "finish_reason": finish}}

    # --------------------------------------------------------------------------------------------- weights
    @strict
    def begin_weight_update(self, selector):
        self.calls.append(("begin_weight_update", selector))
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = {"loaded": False}
        return True, "Success"

    @strict
    def update_weights_from_tensor(self, named_tensors, load_format, flush_cache):
        self.calls.append(("update_weights_from_tensor",
                           dict(names=[n for n, _ in named_tensors], flush_cache=flush_cache,
                                tensors=list(named_tensors),
                                nbytes=sum(t.numel() * t.element_size() for _, t in named_tensors))))
        if self.session is None:
            return False, API["outside_session"]
        self._load_or_die(named_tensors)
        self.session["loaded"] = True
        return True, "Success"

    def _load_or_die(self, named_tensors):
        """model.load_weights: any exception in here kills the engine's whole process tree."""
        def die(why):
            raise EngineProcessDied(f"scheduler died in load_weights ({why}); SIGQUIT killed the process tree")

        flash_rl = self.kwargs.get("load_format") == "flash_rl"
        names = [n for n, _ in named_tensors]
        for name, tensor in named_tensors:
            if flash_rl and name.startswith(("layers.", "embed_tokens.", "norm.")):
                die(f"FlashRL reload requires canonical checkpoint names: {name!r}")
            if name == "lm_head.weight" and "lm_head.weight" not in self.weights:
                continue  # tied: the real loaders skip it
            if name not in self.weights:
                die(f"KeyError: {name!r}")
            if tuple(tensor.shape) != tuple(self.weights[name].shape):
                die(f"{name}: shape {tuple(tensor.shape)} != {tuple(self.weights[name].shape)}")
            if tensor.dtype != self.weights[name].dtype:
                die(f"{name}: dtype {tensor.dtype} != {self.weights[name].dtype}")
        if flash_rl and self.per_tensor_fp8:
            for name in names:
                group = fused_group(name)
                if group != name and not name.endswith(".bias"):
                    members = [n for n in self.weights if fused_group(n) == group]
                    if not set(members) <= set(names):
                        die(f"Partial per-tensor FP8 update for {group}: supply all destination rows in the "
                            "same update call")
        for name, tensor in named_tensors:
            if name in self.weights:
                self.weights[name] = tensor.to("cpu", copy=True)

    @strict
    def end_weight_update(self):
        self.calls.append(("end_weight_update", None))
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = None
        return True, "Success"

    @strict
    def flush_cache(self):
        self.calls.append(("flush_cache", None))
        return FlushCacheReqOutput(success=True)

    # --------------------------------------------------------------------------------------------- memory
    @strict
    def release_memory_occupation(self, tags):
        self.calls.append(("release_memory_occupation", tags))
        if not self.kwargs.get("enable_memory_saver"):
            return None  # the memory saver adapter is a no-op: nothing is freed
        self.released = set(tags or API["memory_tags"])
        self.memory_freed = True
        if "weights" in self.released:
            self._backup = ({n: t.clone() for n, t in self.weights.items()}
                            if self.kwargs.get("enable_weights_cpu_backup") else None)
        return None

    @strict
    def resume_memory_occupation(self, tags):
        self.calls.append(("resume_memory_occupation", tags))
        if not self.kwargs.get("enable_memory_saver"):
            return None
        if "weights" in self.released:
            self.weights = self._backup if self._backup is not None else {
                n: torch.zeros_like(t) for n, t in self.weights.items()}  # contents lost
        self.released, self.memory_freed = set(), False
        return None

    @strict
    def shutdown(self):
        self.calls.append(("shutdown", None))
