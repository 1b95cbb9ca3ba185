"""The rollout engine's memory per device from config.json's dimensions (no checkpoint needed).

D = hidden_size, I = intermediate_size, L = layers, H / K = attention / KV heads, d = head_dim, V = vocab,
t = the engine's tensor_parallel_size:

    projections   P_proj = L · (D·H·d + 2·D·K·d + H·d·D + 3·D·I)          q, k, v, o, gate, up, down
    the rest      P_rest = V·D (embedding) + V·D (lm_head, unless tied) + L·(2·D [+ 2·d qk-norm] [+ (H+2K)·d bias]) + D
    weights       (P_proj · b_proj + P_rest · 2) / t      b_proj = 2 (bf16) | 1 (every FP8 and INT8 scheme)
    KV cache      2 (K and V) · L · K · d · 2 bytes (bf16) / t   per token

Mixture of experts (qwen3_moe, qwen2_moe): a sparse layer's 3·D·I is replaced by its E routed experts of width
F = moe_intermediate_size, 3·D·F·E (+ qwen2_moe's shared expert 3·D·F_s), all of them projections (every scheme
quantizes the experts), and its router D·E (+ the shared expert's gate D) joins the rest (routers stay bf16).
Every expert is resident, so the weights count the total; a token runs K = num_experts_per_tok of them:

    active params = P - L_sparse · 3·D·F·(E - K)          (`active_param_count`)

Layer i is sparse unless it is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (transformers' rule).

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


MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")


def sparse_layers(c: dict) -> int:
    """How many decoder layers of config.json dict `c` have routed experts (module doc)."""
    experts = c.get("num_experts", c.get("num_local_experts", 0))
    if c["model_type"] not in MOE_FAMILIES or not experts:
        return 0
    step, dense = c.get("decoder_sparse_step", 1) or 1, set(c.get("mlp_only_layers") or ())
    return sum(1 for i in range(c["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def param_counts(c: dict) -> tuple[int, int]:
    """(projection params, the rest) of an HF config.json dict (module doc), every expert counted."""
    d, i, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    h, hd = c["num_attention_heads"], head_dim(c)
    k = c.get("num_key_value_heads", h)
    sparse = sparse_layers(c)
    proj = layers * (d * h * hd + 2 * d * k * hd + h * hd * d) + (layers - sparse) * 3 * d * i
    per_layer = 2 * d + (2 * hd if c["model_type"] in ("qwen3", "qwen3_moe") else 0)
    if c["model_type"] in ("qwen2", "qwen2_moe") or c.get("attention_bias"):
        per_layer += (h + 2 * k) * hd + (d if c["model_type"] not in ("qwen2", "qwen2_moe") else 0)
    rest = v * d * (1 if c.get("tie_word_embeddings") else 2) + layers * per_layer + d
    if sparse:
        experts = c.get("num_experts", c.get("num_local_experts"))
        proj += sparse * 3 * d * c["moe_intermediate_size"] * experts
        rest += sparse * d * experts                                     # routers
        if c["model_type"] == "qwen2_moe":
            proj += sparse * 3 * d * c["shared_expert_intermediate_size"]
            rest += sparse * d                                           # the shared expert's gate
    return proj, rest


def active_param_count(c: dict) -> int:
    """Parameters one token runs through (module doc): the total less the experts it is not routed to."""
    total = sum(param_counts(c))
    sparse = sparse_layers(c)
    if not sparse:
        return total
    experts = c.get("num_experts", c.get("num_local_experts"))
    return total - sparse * 3 * c["hidden_size"] * c["moe_intermediate_size"] * (experts - c["num_experts_per_tok"])


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
