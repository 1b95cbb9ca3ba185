"""vLLM worker extension: the weight-sync entry point inside each vLLM worker, and its CPU kernel patches.

vLLM mixes this class into its Worker (`LLM(worker_extension_cls=...)`), and the adapter reaches it with
`llm.collective_rpc("portable_rl_reload_weights", kwargs=...)`. In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0
and one worker) the tensors arrive by reference, so nothing is copied before vLLM's own weight loaders run.
A worker in another process gets `portable_rl_reload_shared_weights` with a shared-memory manifest instead
(engines/shared_weights.py): it maps the adapter's segment and reloads from views of it, again no copy before
the loaders.

The reload is vLLM's layerwise one (`vllm_internals.reload_weights_layerwise`): each layer is restored to its
checkpoint-format parameters, the weight loaders fill it (fusing q/k/v and gate/up), and once a layer is
complete its quantization method runs `process_weights_after_loading`, so an FP8 engine re-quantizes from the
pushed bf16 weights and writes into its existing buffers. It must run ONCE per sync with every weight:
calling it per bucket would finalize half-loaded layers.

CPU patches (`vllm_internals.install_cpu_patches`) and the AMX permission (`cpu_features.allow_amx_tiles`).
vLLM imports this module in every worker to find the extension; importing it changes nothing. On CPU the
adapter installs both in its own process before the engine starts (an in-process worker, or forked ones), and
right after the start in every worker through `portable_rl_prepare_cpu_worker` (a spawned worker), before any
generate or reload.

Routing capture (vllm_moe.py, vLLM-CPU): `portable_rl_capture_routing` installs a `RoutingCapture` on the
worker's model runner; `portable_rl_take_routed_experts` hands over (and forgets) what it recorded.
"""

from __future__ import annotations

from typing import Iterable

from portable_rl.engines import shared_weights, vllm_internals, vllm_moe
from portable_rl.engines.cpu_features import allow_amx_tiles


class PortableRLWorkerExtension:
    """Methods added to every vLLM worker (`self` is the worker: it has `model_runner`, `vllm_config`)."""

    def portable_rl_prepare_cpu_worker(self) -> None:
        """The worker's process as the adapter prepares its own before a CPU engine starts: AMX tiles allowed
        (`cpu_features.allow_amx_tiles`) and `vllm_internals.install_cpu_patches`; the CPU adapter calls it right
        after engine start."""
        allow_amx_tiles()
        vllm_internals.install_cpu_patches()

    def portable_rl_capture_routing(self) -> int:
        """Starts recording every MoE layer's top-k per (request, position); returns the MoE layer count."""
        self._portable_rl_routing = vllm_moe.RoutingCapture(self.model_runner)
        return self._portable_rl_routing.num_layers

    def portable_rl_take_routed_experts(self) -> list:
        """What the capture recorded since the last call (`RoutingCapture.take`)."""
        return self._portable_rl_routing.take()

    def portable_rl_reload_weights(self, weights: Iterable) -> int:
        """Loads checkpoint-format `(hf_name, tensor)` pairs with the layerwise reload; returns their count."""
        weights = list(weights)
        vllm_internals.reload_weights_layerwise(self, weights)
        return len(weights)

    def portable_rl_reload_shared_weights(self, manifest: dict) -> int:
        """`portable_rl_reload_weights` on views of the adapter's shared-memory segment (shared_weights.py)."""
        return self.portable_rl_reload_weights(shared_weights.shared_tensors(manifest))
