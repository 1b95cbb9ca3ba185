"""`fake_quant` engine: any registered engine, serving fake-quantized weights.

    engine = create_engine("fake_quant", model_path=..., engine="vllm", scheme="mxfp4",
                           engine_kwargs={"engine_init_kwargs": {"quantization": None}, "max_model_len": 64})

The wrapped engine runs in its own dtype (bf16); every decoder projection it receives is first replaced by

    W' = dequantize(quantize(W, scheme))        (engines.quantize.fake_quantize; same shape and dtype)

so it samples from, and returns the logprobs of, the policy a weight-only `scheme` engine would serve.
This emulates rollout precisions the CPU engine cannot run natively (MXFP4 / NVFP4 / per-tensor FP8:
`engines.quantize.FAKE_QUANT_SCHEMES`). On construction the checkpoint at `model_path` is read, its
projections fake-quantized and pushed, so rollouts are quantized from the first step on; every
`update_weights` fake-quantizes the pushed projections before forwarding them.

What is quantized: the q/k/v/o and gate/up/down projection weights of every layer, the matrices a
quantized checkpoint or vLLM's online quantization stores in low precision. Embeddings, the (often tied)
lm_head, norms and biases stay in the engine dtype, as in published FP8/FP4 checkpoints (they are small,
and the lm_head/embedding are the most precision-sensitive).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from portable_rl.engines.base import EngineAdapter, NamedTensor, Rollout, SamplingConfig, named_tensor_pairs
from portable_rl.engines.checkpoint import safetensors_files
from portable_rl.engines.registry import create_engine, register


def read_checkpoint_tensors(model_path: str) -> list:
    """Every (hf_name, tensor) of the safetensors files in `model_path`."""
    from safetensors.torch import load_file

    return [pair for path in safetensors_files(model_path) for pair in load_file(path).items()]


@register("fake_quant")
class FakeQuantEngine(EngineAdapter):
    """A registered engine serving its decoder projections fake-quantized with `scheme` (module doc).

    Args:
      model_path: the HF checkpoint the inner engine starts from; its projections are fake-quantized and
        pushed at construction.
      engine: the registered engine that serves the weights (any but "fake_quant").
      scheme: the weight-only scheme emulated: "fp8_e4m3_tensor" (one FP8 scale per tensor), "mxfp4" (FP4,
        a power-of-two scale per 32 inputs) or "nvfp4" (FP4, an FP8 scale per 16 inputs under one tensor
        scale).
      engine_kwargs: the inner engine's constructor keywords besides model_path; None: none.
    """

    def __init__(self, *, model_path: str, engine: str = "vllm", scheme: str = "mxfp4",
                 engine_kwargs: dict[str, Any] | None = None):
        from portable_rl.engines.quantize import FAKE_QUANT_SCHEMES  # torch: imported when an engine is built

        if scheme not in FAKE_QUANT_SCHEMES:
            raise ValueError(f"unknown fake-quantization scheme {scheme!r}; use one of {FAKE_QUANT_SCHEMES}")
        if engine == "fake_quant":
            raise ValueError("fake_quant cannot wrap itself; set engine='vllm' (or another registered engine)")
        self.scheme = scheme
        self.quantization = f"fake_{scheme}"  # read by the post-sync probe: a quantized engine
        self.inner = create_engine(engine, model_path=model_path, **(engine_kwargs or {}))
        self.update_weights(read_checkpoint_tensors(model_path))

    @property
    def returns_sampling_support(self) -> bool:
        return self.inner.returns_sampling_support

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 seeds: Sequence[int] | None = None) -> list[Rollout]:
        return self.inner.generate(prompt_token_ids, sampling, seeds=seeds)

    def serving(self, requests):
        return self.inner.serving(requests)  # the inner engine's batching (vLLM: continuous)

    def update_weights(self, named_tensors: Iterable[NamedTensor]) -> None:
        """Fake-quantizes the flat pairs lazily and hands the inner engine the same flat shape (it buckets)."""
        from portable_rl.engines.quantize import fake_quantize_named_tensors

        self.inner.update_weights(fake_quantize_named_tensors(named_tensor_pairs(named_tensors), self.scheme))

    def sleep(self) -> None:
        self.inner.sleep()

    def wake_up(self) -> None:
        self.inner.wake_up()

    def close(self) -> None:
        inner = getattr(self, "inner", None)
        if inner is not None:
            inner.close()
