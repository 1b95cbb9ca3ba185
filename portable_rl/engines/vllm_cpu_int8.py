"""Safe weight reloads for vLLM-CPU's INT8 W8A8 GEMM (an in-process patch, applied before engine start).

vLLM 0.32 serves INT8 W8A8 on x86 CPUs with `CPUInt8ScaledMMLinearKernel`. Without AMX it takes the oneDNN
path: `process_weights_for_onednn` prepacks the int8 weight into a oneDNN handler, sets `layer.weight =
None`, and hands the handler the layer's `weight_scale` tensor, which the handler keeps as a raw pointer.

vLLM's layerwise `reload_weights` (vllm_worker.py) loads each layer into fresh tensors, runs
`process_weights_after_loading` on them (a new handler, pointing at the fresh `weight_scale`), then copies
the processed values into the layer's ORIGINAL tensors and puts those back on the layer, so that CUDA
graphs keep their addresses. The fresh `weight_scale` then has no owner and is freed, while the new
handler still reads it:

    after a reload, every oneDNN INT8 GEMM scales its output by whatever memory the freed scale occupied

Measured with vllm-cpu 0.32 on SmolLM2-135M (AVX-512 VNNI, no AMX): after two reloads of the SAME weights
with a few MB allocated in between, greedy decoding emits token 0 forever; no error anywhere
(tests/test_engines_vllm_int8.py reproduces it with the patch removed).

The fix keeps the tensor the handler points at alive: the patched `process_weights_for_onednn` stores it
on the kernel object, next to the handler that reads it, so the two live and die together. Each reload
builds a new handler and replaces both. The AMX path (`process_weights_for_sgl`) reads its weight and
scales from the layer on every call, and the reload copies the new values into those tensors, so it needs
nothing.
"""

from __future__ import annotations

_PATCHED = False
_SCALE_ATTR = "_portable_rl_handler_weight_scale"  # on the kernel: the tensor its dnnl_handler points at


def _keep_handler_scale_alive(process_weights_for_onednn):
    def process_weights_for_onednn_keeping_scale(self, layer):
        process_weights_for_onednn(self, layer)
        _, w_s_name, _, _, _ = self.layer_param_names
        setattr(self, _SCALE_ATTR, getattr(layer, w_s_name))  # the tensor create_onednn_scaled_mm was given

    process_weights_for_onednn_keeping_scale._portable_rl_wrapped = True
    process_weights_for_onednn_keeping_scale._portable_rl_original = process_weights_for_onednn
    return process_weights_for_onednn_keeping_scale


def apply() -> bool:
    """Installs the patch once; returns False when this vLLM has no CPU INT8 kernel (nothing to do)."""
    global _PATCHED
    if _PATCHED:
        return True
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel as K
    except ImportError:
        return False
    if not getattr(K.process_weights_for_onednn, "_portable_rl_wrapped", False):
        K.process_weights_for_onednn = _keep_handler_scale_alive(K.process_weights_for_onednn)
    _PATCHED = True
    return True
