"""The rollout engine's memory per device from config.json's dimensions (no checkpoint needed).

D = hidden_size, I = intermediate_size, L = layers, H / K = attention / KV heads, d = head_dim, V = vocab,
t = the engine's tensor_parallel_size:

    projections   P_proj = L · (D·H·d + 2·D·K·d + H·d·D + 3·D·I)          q, k, v, o, gate, up, down
    the rest      P_rest = V·D (embedding) + V·D (lm_head, unless tied) + L·(2·D [+ 2·d qk-norm] [+ (H+2K)·d bias]) + D
    weights       (P_proj · b_proj + P_rest · 2) / t      b_proj = 2 (bf16) | 1 (every FP8 and INT8 scheme)
    KV cache      2 (K and V) · L · K · d · 2 bytes (bf16) / t   per token

The quantized schemes' scales (per tensor, per 128 × 128 block, per channel) are < 1 % of the weights and
are left out; embeddings, norms and lm_head stay bf16 in every scheme (`rl.colocation.checkpoint_bytes` reads
the same split from a checkpoint's headers). The activation reserve is vLLM's profile run at its batched-token
budget, its sampler and CUDA graphs: `rl.MemoryPlan.engine_overhead_gb`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

QUANTIZATIONS = {  # the engine's `QUANTIZATION` → bytes per projection weight
    None: 2, "fp8": 1, "fp8_per_block": 1, "fp8_per_channel": 1, "int8_per_channel": 1,
    "blockwise": 1, "flash_rl": 1,   # SGLang's SGLANG_FP8_MODE values
}


def head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def param_counts(c: dict) -> tuple[int, int]:
    """(projection params, the rest) of an HF config.json dict (module doc)."""
    d, i, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    h, hd = c["num_attention_heads"], head_dim(c)
    k = c.get("num_key_value_heads", h)
    proj = layers * (d * h * hd + 2 * d * k * hd + h * hd * d + 3 * d * i)
    per_layer = 2 * d + (2 * hd if c["model_type"] == "qwen3" else 0)
    if c["model_type"] == "qwen2" or c.get("attention_bias"):
        per_layer += (h + 2 * k) * hd + (d if c["model_type"] != "qwen2" else 0)
    rest = v * d * (1 if c.get("tie_word_embeddings") else 2) + layers * per_layer + d
    return proj, rest


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What an engine's settings say about memory (the run's engine binding, gin/engines/*.gin)."""

    name: str
    quantization: Optional[str]
    tensor_parallel: int
    max_model_len: int
    memory_fraction: Optional[float]   # vLLM gpu_memory_utilization / SGLang mem_fraction_static; None: default
    sleep_capable: bool


@dataclasses.dataclass(frozen=True)
class EngineMemory:
    """One engine's memory per device, in bytes (module doc)."""

    params: int
    weights: float
    kv_per_token: float
    tensor_parallel: int
    quantization: Optional[str]


def engine_memory(c: dict, quantization: Optional[str], tensor_parallel: int) -> EngineMemory:
    """`EngineMemory` of config.json dict `c` served with `quantization` over `tensor_parallel` devices."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not one the planner sizes; one of "
                         f"{sorted(str(q) for q in QUANTIZATIONS)}")
    proj, rest = param_counts(c)
    t = max(1, int(tensor_parallel))
    kv = 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim(c) * 2
    return EngineMemory(params=proj + rest, weights=(proj * QUANTIZATIONS[quantization] + rest * 2) / t,
                        kv_per_token=kv / t, tensor_parallel=t, quantization=quantization)
