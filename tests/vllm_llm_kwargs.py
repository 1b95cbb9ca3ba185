"""What `VLLMEngine` hands `vllm.LLM`, without starting an engine (shared by the vLLM option tests).

`vllm.LLM` is replaced by a recorder that raises before any engine starts, and the adapter's platform
probe answers `on_cpu`, so the GPU branches of the adapter can be checked on a CPU box.
"""

import pytest

from portable_rl.engines import vllm_adapter
from portable_rl.engines.vllm_adapter import VLLMEngine


class _Stop(Exception):
    pass


def llm_kwargs(monkeypatch, ckpt, on_cpu, **kw):
    """The kwargs VLLMEngine(model_path=ckpt, **kw) passes to vllm.LLM with the platform probe saying `on_cpu`."""
    import vllm

    seen = {}

    def recorder(**kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(vllm, "LLM", recorder)
    monkeypatch.setattr(vllm_adapter, "_on_cpu", lambda: on_cpu)
    with pytest.raises(_Stop):
        VLLMEngine(model_path=ckpt, **kw)
    return seen
