"""SGLang adapter: an in-process `sglang.Engine` behind `EngineAdapter` (written against sglang 0.5.23).

Logprobs. `generate(input_ids=..., sampling_params=..., return_logprob=True)` returns, per request,
`meta_info["output_token_logprobs"]` = [(logprob, token_id, text|None), ...]. With top_p=1, top_k=-1 SGLang's
sampler computes them as log(softmax(logits / T)) — the tempered sampling distribution, the learner's
definition — unless the env var SGLANG_RETURN_ORIGINAL_LOGPROB is set (then they are T=1 logprobs), which
this adapter refuses.

Seeds. 0.5.23 reads a request's `sampling_seed` only when the engine runs with
`enable_deterministic_inference=True`; otherwise every request draws from the engine's global RNG and the
same seed gives different samples. So a seeded engine (`seed` not None, the default) starts deterministic,
and sample j of prompt i gets `sampling_seed = SamplingConfig.seed_for(i, j)`. The cost: SGLang then uses
batch-invariant kernels, the pytorch sampling backend, and only attention backends that support it
(fa3 / flashinfer / triton on NVIDIA; it picks fa3 on Hopper, flashinfer on Blackwell; some disable the
radix cache). `deterministic=False` gives the fast backends back, and seeds are then ignored (warned once).

Weight sync (0.5.23). Every `update_weights_from_tensor` must run inside a session:

    begin_weight_update()                      # restores in-place-packed (e.g. FP8) weights
    update_weights_from_tensor(bucket_k) ...   # bucketed, flush_cache=False
    end_weight_update()                        # post-processes / re-packs quantized weights
    flush_cache()                              # radix (prefix) cache was built with the old weights

A load that fails inside the engine is not an error reply: `model.load_weights` raising kills the scheduler,
which SIGQUITs its parent, whose handler kills the whole process tree — in-process, the trainer. So
everything that would make it raise is checked here before the session opens:
  - names and shapes against the checkpoint the engine started on (`engines.checkpoint`, as for vLLM);
  - in flash_rl mode, canonical `model.`-prefixed names;
  - fused groups (q/k/v, gate/up) are never split across buckets (`engines.buckets.bucketed_groups`): the
    flash_rl reload with per-tensor FP8 (no cutlass) refuses a partial update of a fused matrix.
The replies SGLang does send (outside a session, session already open, cache flush refused) are checked
and raise `SGLangWeightUpdateError` after the session is closed.

Transport. `update_weights_from_tensor` pickles the tensors to the scheduler process (CUDA IPC handles on
GPU). The learner's tensors are DLPack views of JAX-owned memory, which torch's IPC sharing cannot be
assumed to handle, so each bucket is copied into torch-owned, contiguous memory first (cost: one
device-local copy of one bucket at a time; benchmarks/weight_sync.py).

FP8 comes in two flavours, chosen by `fp8_mode`:
  - "flash_rl": engine started with quantization="fp8", load_format="flash_rl"; it keeps the bf16 loaders
    and re-quantizes the pushed bf16 weights. 0.5.23 supports only Qwen2/Qwen3 (their `load_weights` carry
    the `supports_quantized_rl_reload` mark).
  - "blockwise": trainer-side 128x128 FP8 (`engines.quantize.quantize_named_tensors_blockwise`: `weight` in
    float8_e4m3fn + `weight_scale_inv`), the verl TIS recipe's setting. SGLang serves block-wise FP8 only
    from an FP8-serialized checkpoint, so a bf16 `model_path` is converted once into
    `fp8_checkpoint_root` (`engines.quantize.ensure_blockwise_fp8_checkpoint`) and the engine starts there;
    every push is quantized the same way.

INT8 W8A8 (`quantization="int8_per_channel"`) is refused: 0.5.23 serves a compressed-tensors W8A8 INT8
checkpoint (layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_int8.py, CUDA only; or
`quantization="w8a8_int8"`, layers/quantization/w8a8_int8.py), but both linear methods' `process_weights_after_loading`
replace the int8 weight by a transposed plain Parameter without a `weight_loader` and neither defines
`restore_weights_before_loading`, so the first in-place push would raise in `load_weights` (process tree dead).

SGLang internals. What this adapter assumes about SGLang beyond its Engine API (the env var above, the
flash_rl models, when seeds count, the session contract, INT8, the memory saver) is listed in
engines/sglang_internals.py, with a canary each that reads SGLang's source.

Stop strings and length. `SamplingConfig.stop` goes to SGLang's `stop` with `no_stop_trim=True`; the ids come
from `meta_info["output_token_logprobs"]`, which the detokenizer never trims (it trims only the text, and only
without no_stop_trim), so the token completing the string is the response's last, as with vLLM. A request whose
prompt + max_new_tokens passes the context length is refused by SGLang, so each request's max_new_tokens is cut
to `max_model_len` − len(prompt) (vLLM stops there by itself).

Serving (multi-turn rollouts, base.py "Serving"). `serving` sends each sample as one `Engine.async_generate` task
on the engine's own event loop (`Engine.loop`, where `generate` runs too) and runs the loop until one finishes:
SGLang's scheduler batches them continuously, and a finished request is answered while the others keep
generating. Cancelling a task aborts its request in the scheduler (tokenizer_manager.generate_request's
cleanup), which is how a closed session leaves nothing behind.

Sleep. `sleep_mode=True` starts the engine with SGLang's memory saver and a CPU backup of the weights:
`sleep()` then frees the KV cache, the weights and the CUDA graphs, and `wake_up()` restores them with the
weights' contents intact. Without it `release_memory_occupation` frees nothing, so `sleep()` raises.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import warnings
from typing import Any, Callable, Generator, Iterable, Sequence

from portable_rl.engines.buckets import bucketed_groups
from portable_rl.engines.base import (EngineAdapter, Finished, NamedTensor, Request, Rollout, SamplingConfig,
                                      check_prompts, named_tensor_pairs, prompt_seeds)
from portable_rl.engines.checkpoint import check_named_tensors, read_checkpoint_shapes, tied_embeddings
from portable_rl.engines.registry import register
from portable_rl.engines.sglang_internals import (FLASH_RL_ARCHITECTURES, RETURN_ORIGINAL_LOGPROB_ENV,
                                                check_sglang_version)
from portable_rl.errors import ConfigError

FP8_MODES = (None, "flash_rl", "blockwise")
SCALE_SUFFIX = "_scale_inv"
INT8_W8A8 = ("int8_per_channel", "w8a8_int8")  # ours and SGLang's name; refused (module doc)


def _declares_int8_w8a8(model_path: str) -> bool:
    """True for a checkpoint whose config.json declares compressed-tensors INT8 (e.g. ours, or llm-compressor's)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            qc = json.load(f).get("quantization_config") or {}
    except OSError:
        return False  # no config.json: the engine's own start reports it
    return qc.get("quant_method") in ("compressed-tensors", "w8a8_int8") and qc.get("format", "int-quantized") \
        == "int-quantized"


class SGLangWeightUpdateError(RuntimeError):
    """SGLang answered success=False to a weight-update call."""


def _ok(reply: Any) -> tuple[bool, str]:
    """0.5.23 replies (success, message) to the session calls and an object with .success to flush_cache."""
    if isinstance(reply, tuple):
        return bool(reply[0]), str(reply[1]) if len(reply) > 1 else ""
    return bool(getattr(reply, "success", reply)), str(getattr(reply, "message", ""))


def torch_owned(pairs: list) -> list:
    """Each tensor copied into fresh torch-allocated contiguous memory on its own device (module doc)."""
    import torch

    return [(name, tensor.detach().clone(memory_format=torch.contiguous_format)) for name, tensor in pairs]


def transport_bucket(bucket: list, fp8_mode: str | None) -> list:
    """A bucket as SGLang receives it: torch-owned copies; in blockwise mode projections as FP8 + scales."""
    if fp8_mode != "blockwise":
        return torch_owned(bucket)
    from portable_rl.engines.quantize import is_quantized_projection, quantize_named_tensors_blockwise

    rest = torch_owned([(n, t) for n, t in bucket if not is_quantized_projection(n)])
    quantized = list(quantize_named_tensors_blockwise((n, t) for n, t in bucket if is_quantized_projection(n)))
    return quantized + rest  # the quantizer's outputs are fresh torch tensors already


@register("sglang")
class SGLangEngine(EngineAdapter):
    """In-process SGLang (module doc: logprobs, seeds, weight sync, FP8, sleep).

    Args:
      model_path: the HF checkpoint directory the engine starts from; pushed weights are checked against it.
      engine_init_kwargs: extra `sglang.Engine` keywords, overriding the adapter's; None: none.
      seed: SGLang's random_seed and the base of the per-request sampling seeds; None: unseeded.
      dtype: the engine's weight and activation dtype.
      fp8_mode: None (no FP8 of the adapter's), "flash_rl" (SGLang re-quantizes pushed bf16 weights to FP8;
        Qwen2/Qwen3 only) or "blockwise" (128x128 FP8, quantized by the adapter at start and on every push).
      bucket_bytes: the most bytes of one `update_weights_from_tensor` call (a fused q/k/v or gate/up group
        is never split; a larger tensor goes alone).
      deterministic: start with enable_deterministic_inference, which SGLang needs to honour sampling seeds
        (slower kernels); None: on when seed is not None.
      sleep_mode: start with SGLang's memory saver and a CPU backup of the weights, so `sleep()` frees the
        KV cache, weights and CUDA graphs.
      fp8_checkpoint_root: where fp8_mode="blockwise" writes the FP8 copy of a bf16 model_path once (gin: the
        run directory); None: model_path must already be a 128x128 FP8 checkpoint.
      validate_weights: check every pushed weight's name and shape against the start checkpoint before the
        engine sees it (a load that fails inside SGLang kills the process tree).
      engine_factory: builds the engine from the keywords; None: `sglang.Engine` (tests pass a fake).
    """

    def __init__(self, *, model_path: str, engine_init_kwargs: dict[str, Any] | None = None, seed: int | None = 0,
                 dtype: str = "bfloat16", fp8_mode: str | None = None, bucket_bytes: int = 512 << 20,
                 deterministic: bool | None = None, sleep_mode: bool = False,
                 fp8_checkpoint_root: str | None = None, validate_weights: bool = True,
                 engine_factory: Callable[..., Any] | None = None):
        if fp8_mode not in FP8_MODES:
            raise ValueError(f"fp8_mode={fp8_mode!r}; expected one of {FP8_MODES}")
        int8 = (engine_init_kwargs or {}).get("quantization") in INT8_W8A8
        if int8 or _declares_int8_w8a8(str(model_path)):
            what = f"quantization={(engine_init_kwargs or {})['quantization']!r}" if int8 else \
                f"{model_path} (an INT8 W8A8 checkpoint)"
            raise ConfigError(f"{what}: SGLang 0.5.23 cannot reload INT8 W8A8 weights in place (module doc), so the "
                              "first weight sync would kill the engine; use the 'vllm' engine for INT8 rollouts, or "
                              "FP8 with SGLang (fp8_mode='flash_rl' or 'blockwise')")
        if os.environ.get(RETURN_ORIGINAL_LOGPROB_ENV, "").lower() in ("1", "true", "yes"):
            raise ValueError(f"{RETURN_ORIGINAL_LOGPROB_ENV} is set: SGLang would return T=1 logprobs, not the "
                             "tempered ones the learner uses; unset it")
        self.source_model_path = str(model_path)
        self.model_path = self.source_model_path  # what the engine starts on (an FP8 copy in blockwise mode)
        self.fp8_mode = fp8_mode
        self.bucket_bytes = int(bucket_bytes)
        self.sleep_mode = bool(sleep_mode)
        with open(os.path.join(self.model_path, "config.json")) as f:
            hf_config = json.load(f)
        kwargs: dict[str, Any] = dict(model_path=self.model_path, random_seed=seed, dtype=dtype,
                                      enable_deterministic_inference=seed is not None if deterministic is None
                                      else bool(deterministic))
        if self.sleep_mode:
            kwargs.update(enable_memory_saver=True, enable_weights_cpu_backup=True)
        if fp8_mode == "flash_rl":
            archs = hf_config.get("architectures") or []
            if not set(archs) & set(FLASH_RL_ARCHITECTURES):
                raise ValueError(f"fp8_mode='flash_rl' supports only {tuple(FLASH_RL_ARCHITECTURES)} in sglang 0.5.23, "
                                 f"this checkpoint is {archs}; use fp8_mode='blockwise'")
            kwargs.update(quantization="fp8", load_format="flash_rl")
        elif fp8_mode == "blockwise":
            from portable_rl.engines.quantize import ensure_blockwise_fp8_checkpoint, is_blockwise_fp8_checkpoint

            if not is_blockwise_fp8_checkpoint(self.model_path):
                if fp8_checkpoint_root is None:
                    raise ValueError(
                        f"fp8_mode='blockwise': {self.model_path} is not a 128x128 FP8 checkpoint and SGLang serves "
                        "block-wise FP8 only from one; set fp8_checkpoint_root (gin: SGLANG_FP8_CHECKPOINT_ROOT = "
                        "%RUN_DIR) to have it written there once, or start from "
                        "portable_rl.engines.quantize.write_blockwise_fp8_checkpoint's output")
                self.model_path = ensure_blockwise_fp8_checkpoint(self.model_path, str(fp8_checkpoint_root))
                kwargs["model_path"] = self.model_path
        kwargs.update(engine_init_kwargs or {})
        self.engine_init_kwargs = dict(kwargs)
        self.seeds_honoured = bool(kwargs.get("enable_deterministic_inference"))
        self._warned_unseeded = False
        self.quantization = self._quantization(hf_config, kwargs)
        # SGLang refuses a prompt of context_length tokens or more, and a prompt + max_new_tokens past it
        # (tokenizer_manager's _validate_one_request). Context: the argument, else the model's
        # max_position_embeddings (what SGLang derives for Qwen/Llama); None: unknown.
        context = kwargs.get("context_length") or hf_config.get("max_position_embeddings")
        self.max_model_len = int(context) if context else None
        self._validate = validate_weights
        expected = read_checkpoint_shapes(self.model_path) if validate_weights else {}
        # The learner pushes bf16 projections; in blockwise mode this adapter derives their scales itself.
        self._expected_shapes = {n: s for n, s in expected.items() if not n.endswith(SCALE_SUFFIX)}
        # A tied model's checkpoint may omit lm_head.weight; SGLang's Qwen/Llama loaders skip it if pushed.
        self._optional_names = {"lm_head.weight"} if tied_embeddings(self.model_path) else set()
        if engine_factory is None:
            import sglang

            check_sglang_version(sglang.__version__)
            engine_factory = sglang.Engine
        self._engine = engine_factory(**kwargs)

    def _quantization(self, hf_config: dict, kwargs: dict) -> str | None:
        """fp8_mode's scheme, else the `quantization` argument, else a pre-quantized checkpoint's method."""
        if self.fp8_mode is not None:
            return f"fp8_{self.fp8_mode}"
        return kwargs.get("quantization") or (hf_config.get("quantization_config") or {}).get("quant_method")

    # ----------------------------------------------------------------------------------------- rollouts
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 seeds: Sequence[int] | None = None) -> list[Rollout]:
        engine = self._require_engine()
        prompts = check_prompts(prompt_token_ids)
        first_seeds = prompt_seeds(sampling, seeds, len(prompts))
        # n samples as n requests (prompt-major) so the order and the per-sample seeds are ours, not SGLang's.
        input_ids, params, owners = [], [], []
        for i, prompt in enumerate(prompts):
            for p in self._sample_params(i, prompt, sampling, first_seeds[i]):
                input_ids.append(prompt)
                params.append(p)
                owners.append(i)
        outputs = engine.generate(input_ids=input_ids, sampling_params=params, return_logprob=True)
        if isinstance(outputs, dict):  # a single request comes back unwrapped
            outputs = [outputs]
        return [self._rollout(i, prompts[i], out) for i, out in zip(owners, outputs, strict=True)]

    def serving(self, requests: Sequence[Request]) -> Generator[Finished, Sequence[Request], None]:
        """Continuous batching (base.py, "Serving") through SGLang's own scheduler: each sample of a request is
        one `async_generate` task on the engine's event loop; the loop runs until a task finishes, and every
        request whose samples are all done is yielded (in send order); the requests sent back join the
        scheduler's running batch while the others keep going. Closing the session cancels the tasks still
        running, which aborts their requests in the scheduler (sglang_internals, "cancel_aborts")."""
        engine = self._require_engine()
        loop = engine.loop
        tasks: dict[asyncio.Task, tuple[int, int]] = {}  # task → (send order, sample)
        sent: dict[int, tuple[Request, list[int], list]] = {}  # send order → (request, prompt, rollouts so far)
        sends = itertools.count()

        def send(batch):
            for request in batch:
                prompt = check_prompts([request.prompt_token_ids])[0]
                params = self._sample_params(0, prompt, request.sampling, request.sampling.seed)
                order = next(sends)
                sent[order] = (request, prompt, [None] * len(params))
                for j, p in enumerate(params):
                    task = loop.create_task(engine.async_generate(input_ids=prompt, sampling_params=p,
                                                                  return_logprob=True))
                    tasks[task] = (order, j)

        try:
            send(requests)
            while tasks:
                done, _ = loop.run_until_complete(asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED))
                finished = []
                for task in sorted(done, key=tasks.get):
                    order, j = tasks.pop(task)
                    request, prompt, rollouts = sent[order]
                    rollouts[j] = self._rollout(0, prompt, task.result())
                    if all(r is not None for r in rollouts):
                        finished.append(order)
                if finished:
                    send((yield [(sent[o][0], sent.pop(o)[2]) for o in sorted(finished)]))
        finally:
            if tasks:  # the caller raised or closed the session: nothing of it stays in the engine
                for task in tasks:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    def _sample_params(self, index: int, prompt: list[int], sampling: SamplingConfig, first_seed: int | None
                       ) -> list[dict]:
        """SGLang's sampling_params of each of the prompt's n samples (sample j seeded first_seed + j)."""
        self.check_sampling(sampling)  # no sampling support from SGLang: return_support is refused
        if first_seed is not None and not self.seeds_honoured and not self._warned_unseeded:
            self._warned_unseeded = True
            warnings.warn("SGLang runs without enable_deterministic_inference, so sampling seeds are ignored and "
                          "rollouts are not reproducible (resume and fleet results will differ); start the "
                          "engine with deterministic=True to honour them", RuntimeWarning, stacklevel=3)
        if sampling.stop and self.engine_init_kwargs.get("skip_tokenizer_init"):
            raise ConfigError(f"stop={sampling.stop}: SGLang matches stop strings on detokenized text, and this "
                              "engine runs with skip_tokenizer_init=True; drop it from engine_init_kwargs")
        max_new_tokens = sampling.max_tokens
        if self.max_model_len is not None:  # SGLang refuses a request past its context; vLLM stops there
            max_new_tokens = min(max_new_tokens, self.max_model_len - len(prompt))
            if max_new_tokens < 1:
                raise ValueError(f"prompt {index} has {len(prompt)} tokens; the engine serves at most "
                                 f"{self.max_model_len} (prompt + response): raise context_length or shorten it")
        params = []
        for j in range(sampling.n):
            p = dict(temperature=sampling.temperature, max_new_tokens=max_new_tokens,
                     top_p=sampling.top_p, top_k=sampling.top_k)
            if sampling.stop_token_ids:
                p["stop_token_ids"] = list(sampling.stop_token_ids)
            if sampling.min_tokens:
                p["min_new_tokens"] = sampling.min_tokens
            if sampling.stop:  # the returned ids are never trimmed; no_stop_trim keeps the text whole too
                p.update(stop=list(sampling.stop), no_stop_trim=True)
            if first_seed is not None and self.seeds_honoured:
                p["sampling_seed"] = first_seed + j
            params.append(p)
        return params

    @staticmethod
    def _rollout(index: int, prompt: list[int], out: dict) -> Rollout:
        """The Rollout of one SGLang output of prompt `index`."""
        meta = out["meta_info"]
        token_logprobs = meta["output_token_logprobs"]
        finish = meta["finish_reason"]
        finish_type = finish.get("type") if isinstance(finish, dict) else finish
        if finish_type not in ("stop", "length"):
            raise RuntimeError(f"SGLang finished a request with {finish!r}")
        return Rollout(prompt_index=index, prompt_token_ids=prompt,
                       response_token_ids=[int(tok) for _, tok, *_ in token_logprobs],
                       response_logprobs=[float(lp) for lp, *_ in token_logprobs], finish_reason=finish_type)

    # ----------------------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[NamedTensor]) -> None:
        """Full sync from the flat pairs: checked up front (module doc), then one session of this adapter's
        own `bucket_bytes` buckets, each fused group (q/k/v, gate/up) complete in one of them."""
        engine = self._require_engine()
        pairs = list(named_tensor_pairs(named_tensors))  # references only: nothing is copied yet
        if self.fp8_mode == "flash_rl":
            bad = [n for n, _ in pairs if not n.startswith(("model.", "lm_head."))]
            if bad:  # 0.5.23 raises inside the engine for these, which kills the process tree
                raise ValueError(f"fp8_mode='flash_rl' needs canonical 'model.'-prefixed HF names, got {bad[:3]}")
        if self._validate:
            check_named_tensors(pairs, self._expected_shapes, self._optional_names)
        buckets = bucketed_groups(pairs, self.bucket_bytes)
        del pairs
        self._check(engine.begin_weight_update(), "begin_weight_update")
        try:
            for bucket in buckets:
                sent = transport_bucket(bucket, self.fp8_mode)
                self._check(engine.update_weights_from_tensor(named_tensors=sent, flush_cache=False),
                            "update_weights_from_tensor")
                del sent  # one bucket's copy alive at a time
        except Exception:
            engine.end_weight_update()  # close the session so the next sync can open one; report the first error
            raise
        self._check(engine.end_weight_update(), "end_weight_update")
        self._check(engine.flush_cache(), "flush_cache")

    @staticmethod
    def _check(reply: Any, what: str) -> None:
        success, message = _ok(reply)
        if not success:
            raise SGLangWeightUpdateError(f"SGLang {what} failed: {message}")

    # ----------------------------------------------------------------------------------------- lifecycle
    def sleep(self) -> None:
        """Frees KV cache, weights and CUDA graphs (weights backed up to CPU); needs `sleep_mode=True`."""
        engine = self._require_engine()
        self._require_sleep_mode("sleep")
        engine.release_memory_occupation()

    def wake_up(self) -> None:
        """Restores what `sleep` freed, the weights' contents included."""
        engine = self._require_engine()
        self._require_sleep_mode("wake_up")
        engine.resume_memory_occupation()

    def _require_sleep_mode(self, what: str) -> None:
        if not self.sleep_mode:
            raise RuntimeError(f"SGLangEngine.{what}(): this engine was started without sleep_mode=True, so SGLang "
                               "would free nothing; create it with sleep_mode=True (memory saver + CPU weight "
                               "backup)")

    def close(self) -> None:
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            engine.shutdown()

    def _require_engine(self):
        if self._engine is None:
            raise RuntimeError("this SGLangEngine is closed; create a new one")
        return self._engine
