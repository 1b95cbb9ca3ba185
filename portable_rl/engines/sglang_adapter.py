"""SGLang adapter: an in-process `sglang.Engine` behind `EngineAdapter` (written against sglang 0.5.23).

Logprobs. `generate(input_ids=..., sampling_params=..., return_logprob=True)` returns, per request,
`meta_info["output_token_logprobs"]` = [(logprob, token_id, text|None), ...]. With top_p=1, top_k=-1 SGLang's
sampler computes them as log(softmax(logits / T)) — the tempered sampling distribution, the learner's
definition — unless the env var SGLANG_RETURN_ORIGINAL_LOGPROB is set (then they are T=1 logprobs), which
this adapter refuses.

Weight sync (0.5.23). Every `update_weights_from_tensor` must run inside a session:

    begin_weight_update()                      # restores in-place-packed (e.g. FP8) weights
    update_weights_from_tensor(bucket_k) ...   # bucketed, flush_cache=False
    end_weight_update()                        # post-processes / re-packs quantized weights
    flush_cache()                              # radix (prefix) cache was built with the old weights

Outside a session 0.5.23 answers (success=False, "...must run between begin_weight_update() and
end_weight_update()") and loads nothing; every reply is checked and a failure raises after the session is
closed. FP8 comes in two flavours, chosen by `fp8_mode`:
  - "flash_rl": engine started with quantization="fp8", load_format="flash_rl"; it keeps the bf16 loaders
    and re-quantizes the pushed bf16 weights. 0.5.23 supports only Qwen2/Qwen3 (their `load_weights` carry
    the `supports_quantized_rl_reload` mark) and names must be canonical (`model.`-prefixed).
  - "blockwise": trainer-side 128x128 FP8 (`portable_rl.convert.quantize.quantize_named_tensors_blockwise`:
    `weight` in float8_e4m3fn + `weight_scale_inv`); the engine must be started from a checkpoint written
    by `portable_rl.convert.quantize.write_blockwise_fp8_checkpoint` (config with `weight_block_size`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, Sequence

from portable_rl.engines.base import (EngineAdapter, NamedTensors, Rollout, SamplingConfig, check_prompts,
                                      flatten_named_tensors)
from portable_rl.convert.buckets import bucketed
from portable_rl.engines.registry import register

FP8_MODES = (None, "flash_rl", "blockwise")
FLASH_RL_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")  # sglang 0.5.23, models/qwen2.py, qwen3.py


class SGLangWeightUpdateError(RuntimeError):
    """SGLang answered success=False to a weight-update call."""


def _ok(reply: Any) -> tuple[bool, str]:
    """SGLang 0.5.x replies with (success, message); some versions return an object with .success."""
    if isinstance(reply, tuple):
        return bool(reply[0]), str(reply[1]) if len(reply) > 1 else ""
    return bool(getattr(reply, "success", reply)), str(getattr(reply, "message", ""))


@register("sglang")
class SGLangEngine(EngineAdapter):
    """`engine_factory` defaults to `sglang.Engine`; tests pass a recording fake with the same API."""

    def __init__(self, *, model_path: str, engine_init_kwargs: dict[str, Any] | None = None, seed: int = 0,
                 dtype: str = "bfloat16", fp8_mode: str | None = None, bucket_bytes: int = 512 << 20,
                 engine_factory: Callable[..., Any] | None = None):
        if fp8_mode not in FP8_MODES:
            raise ValueError(f"fp8_mode={fp8_mode!r}; expected one of {FP8_MODES}")
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
            raise ValueError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return T=1 logprobs, not the "
                             "tempered ones the learner uses; unset it")
        self.model_path = str(model_path)
        self.fp8_mode = fp8_mode
        self.bucket_bytes = int(bucket_bytes)
        with open(os.path.join(self.model_path, "config.json")) as f:
            hf_config = json.load(f)
        kwargs: dict[str, Any] = dict(model_path=self.model_path, random_seed=seed, dtype=dtype)
        if fp8_mode == "flash_rl":
            archs = hf_config.get("architectures") or []
            if not set(archs) & set(FLASH_RL_ARCHITECTURES):
                raise ValueError(f"fp8_mode='flash_rl' supports only {FLASH_RL_ARCHITECTURES} in sglang 0.5.23, "
                                 f"this checkpoint is {archs}; use fp8_mode='blockwise'")
            kwargs.update(quantization="fp8", load_format="flash_rl")
        elif fp8_mode == "blockwise":
            block = (hf_config.get("quantization_config") or {}).get("weight_block_size")
            if block != [128, 128]:
                raise ValueError("fp8_mode='blockwise' needs a checkpoint quantized 128x128 "
                                 "(portable_rl.convert.quantize.write_blockwise_fp8_checkpoint); "
                                 f"{self.model_path} has weight_block_size={block}")
        kwargs.update(engine_init_kwargs or {})
        self.engine_init_kwargs = dict(kwargs)
        if engine_factory is None:
            import sglang

            engine_factory = sglang.Engine
        self._engine = engine_factory(**kwargs)

    # ----------------------------------------------------------------------------------------- rollouts
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[Rollout]:
        engine = self._require_engine()
        prompts = check_prompts(prompt_token_ids)
        # n samples as n requests (prompt-major) so the order and the per-sample seeds are ours, not SGLang's.
        input_ids, params, owners = [], [], []
        for i, prompt in enumerate(prompts):
            for j in range(sampling.n):
                p = dict(temperature=sampling.temperature, max_new_tokens=sampling.max_tokens,
                         top_p=sampling.top_p, top_k=sampling.top_k)
                if sampling.stop_token_ids:
                    p["stop_token_ids"] = list(sampling.stop_token_ids)
                if sampling.seed is not None:
                    p["sampling_seed"] = sampling.seed + i * sampling.n + j
                input_ids.append(prompt)
                params.append(p)
                owners.append(i)
        outputs = engine.generate(input_ids=input_ids, sampling_params=params, return_logprob=True)
        if isinstance(outputs, dict):  # a single request comes back unwrapped
            outputs = [outputs]
        rollouts = []
        for i, out in zip(owners, outputs, strict=True):
            meta = out["meta_info"]
            token_logprobs = meta["output_token_logprobs"]
            finish = meta["finish_reason"]
            finish_type = finish.get("type") if isinstance(finish, dict) else finish
            if finish_type not in ("stop", "length"):
                raise RuntimeError(f"SGLang finished a request with {finish!r}")
            rollouts.append(Rollout(
                prompt_index=i, prompt_token_ids=prompts[i],
                response_token_ids=[int(tok) for _, tok, *_ in token_logprobs],
                response_logprobs=[float(lp) for lp, *_ in token_logprobs], finish_reason=finish_type))
        return rollouts

    # ----------------------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: NamedTensors) -> None:
        engine = self._require_engine()
        pairs: Iterable = flatten_named_tensors(named_tensors)
        if self.fp8_mode == "flash_rl":
            pairs = list(pairs)
            bad = [n for n, _ in pairs if not n.startswith(("model.", "lm_head."))]
            if bad:  # 0.5.23 raises inside the engine for these; say it before opening a session
                raise ValueError(f"fp8_mode='flash_rl' needs canonical 'model.'-prefixed HF names, got {bad[:3]}")
        elif self.fp8_mode == "blockwise":
            from portable_rl.convert.quantize import quantize_named_tensors_blockwise

            pairs = quantize_named_tensors_blockwise(pairs)
        self._check(engine.begin_weight_update(), "begin_weight_update")
        try:
            for bucket in bucketed(pairs, self.bucket_bytes):
                self._check(engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False),
                            "update_weights_from_tensor")
        finally:
            self._check(engine.end_weight_update(), "end_weight_update")
        engine.flush_cache()

    @staticmethod
    def _check(reply: Any, what: str) -> None:
        success, message = _ok(reply)
        if not success:
            raise SGLangWeightUpdateError(f"SGLang {what} failed: {message}")

    # ----------------------------------------------------------------------------------------- lifecycle
    def sleep(self) -> None:
        self._require_engine().release_memory_occupation()

    def wake_up(self) -> None:
        self._require_engine().resume_memory_occupation()

    def close(self) -> None:
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            engine.shutdown()

    def _require_engine(self):
        if self._engine is None:
            raise RuntimeError("this SGLangEngine is closed; create a new one")
        return self._engine
