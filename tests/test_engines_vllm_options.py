"""How the vLLM adapter chooses `enforce_eager`: eager on CPU, vLLM's own default on GPU, overridable from gin.

Forcing eager everywhere turned off CUDA graphs on GPU (vLLM's default is enforce_eager=False), which slows
decode there. No GPU here, so the GPU branch is checked by what the adapter would hand to `vllm.LLM`:
`vllm_adapter.llm_kwargs` (pure: it starts nothing) is asked for both platforms.
"""

import pytest

pytest.importorskip("vllm")

import gin  # noqa: E402

from portable_rl import gin_utils  # noqa: E402
from portable_rl.engines.vllm_adapter import llm_kwargs, resolve_enforce_eager  # noqa: E402

pytestmark = pytest.mark.vllm


def test_resolve_enforce_eager():
    assert resolve_enforce_eager(None, on_cpu=True) is True
    assert resolve_enforce_eager(None, on_cpu=False) is None  # pass nothing: vLLM's default (CUDA graphs)
    for forced in (True, False):
        assert resolve_enforce_eager(forced, on_cpu=True) is forced
        assert resolve_enforce_eager(forced, on_cpu=False) is forced


def test_engine_passes_eager_on_cpu_and_vllms_default_on_gpu():
    assert llm_kwargs("/ckpt", on_cpu=True)["enforce_eager"] is True
    gpu = llm_kwargs("/ckpt", on_cpu=False)
    assert "enforce_eager" not in gpu and gpu["dtype"] == "bfloat16"
    assert llm_kwargs("/ckpt", on_cpu=False, enforce_eager=True)["enforce_eager"] is True
    assert llm_kwargs("/ckpt", on_cpu=True, enforce_eager=False)["enforce_eager"] is False


def test_llm_kwargs_defaults_overrides_and_refusals(monkeypatch):
    """What reaches vllm.LLM besides enforce_eager (module doc, "CPU defaults", INT8): no engine is started."""
    from portable_rl.errors import ConfigError

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cpu = llm_kwargs("/ckpt", on_cpu=True, dtype="bfloat16", seed=3)
    assert cpu["model"] == "/ckpt" and cpu["seed"] == 3 and cpu["logprobs_mode"] == "processed_logprobs"
    assert cpu["enable_chunked_prefill"] is False and cpu["kv_cache_memory_bytes"] == 256 << 20
    assert cpu["block_size"] == 32 and "enable_prefix_caching" not in cpu  # vLLM's default: on (module doc)
    assert llm_kwargs("/ckpt", on_cpu=True, engine_init_kwargs={"block_size": 128})["block_size"] == 128
    assert llm_kwargs("/ckpt", on_cpu=True, dtype="float32")["kv_cache_memory_bytes"] == 512 << 20  # same tokens
    gpu = llm_kwargs("/ckpt", on_cpu=False)
    assert "kv_cache_memory_bytes" not in gpu and "enable_chunked_prefill" not in gpu and "block_size" not in gpu
    int8 = llm_kwargs("/int8_copy", on_cpu=True, engine_init_kwargs={"quantization": "int8_per_channel"})
    assert "quantization" not in int8 and int8["model"] == "/int8_copy"  # served from the checkpoint
    fp8 = llm_kwargs("/ckpt", on_cpu=True, engine_init_kwargs={"quantization": "fp8_per_channel", "max_logprobs": 9})
    assert fp8["quantization"] == "fp8_per_channel" and fp8["dtype"] == "bfloat16" and fp8["max_logprobs"] == 9
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert "kv_cache_memory_bytes" not in llm_kwargs("/ckpt", on_cpu=True)
    with pytest.raises(ConfigError, match="vLLM-CPU has no sleep mode"):
        llm_kwargs("/ckpt", on_cpu=True, enable_sleep_mode=True)
    with pytest.raises(ValueError, match="rollout logprobs must be 'processed_logprobs'"):
        llm_kwargs("/ckpt", on_cpu=False, engine_init_kwargs={"logprobs_mode": "raw_logprobs"})
    # a multi-process push goes through this host's shared memory: workers on other hosts are refused
    assert llm_kwargs("/ckpt", on_cpu=False, engine_init_kwargs={"tensor_parallel_size": 2})["tensor_parallel_size"] == 2
    for multi_host in ({"tensor_parallel_size": 16, "nnodes": 2}, {"distributed_executor_backend": "ray"}):
        with pytest.raises(ConfigError, match="this host's shared memory"):
            llm_kwargs("/ckpt", on_cpu=False, engine_init_kwargs=multi_host)


def test_gin_exposes_enforce_eager():
    gin.clear_config()
    try:
        gin_utils.parse_gin(["gin/engines/vllm.gin"], ["SEED = 0"])
        assert gin_utils.query_value("vllm/engines.create_engine.enforce_eager") is None  # the platform's choice
        gin.clear_config()
        gin_utils.parse_gin(["gin/engines/vllm.gin"], ["SEED = 0", "ENFORCE_EAGER = False"])
        assert gin_utils.query_value("vllm/engines.create_engine.enforce_eager") is False
    finally:
        gin.clear_config()


def test_vllm_outside_the_tested_minor_release_is_refused_in_one_line():
    import vllm

    from portable_rl.engines.vllm_internals import check_vllm_version
    from portable_rl.errors import ConfigError

    check_vllm_version(vllm.__version__)  # the installed one is supported
    for version in ("0.32.0", "0.32.4+cpu", "0.32.1rc1"):
        check_vllm_version(version)
    for version in ("0.31.2", "0.33.0", "1.0.0", "dev"):
        with pytest.raises(ConfigError, match=rf"^vLLM {version} is installed, .* tested with 0.32.x only; "
                                              r"pip install 'vllm==0.32.\*'") as err:
            check_vllm_version(version)
        assert "\n" not in str(err.value)
