"""HF parameter names <-> NNX parameter paths, one readable table per model family.

Every entry is (HF name, NNX path, transpose). `{i}` is the layer index. HF `nn.Linear` weights
are [out, in]; NNX `Linear` kernels are [in, out], so linear weights are transposed both ways.
Embeddings, norms and biases keep their shape.

    HF name                                   NNX path                         T
    model.embed_tokens.weight                 embed.embedding                  -
    model.layers.{i}.input_layernorm.weight   layers.{i}.input_norm.scale      -
    model.layers.{i}.self_attn.q_proj.weight  layers.{i}.attn.q_proj.kernel    yes
    ...                                       (see the tables below)
    model.norm.weight                         final_norm.scale                 -
    lm_head.weight                            lm_head.kernel                   yes   (absent when tied)
"""

from __future__ import annotations

import dataclasses

from portable_rl.learner_jax.config import ModelConfig

T, KEEP = True, False

_LAYER = [
    ("model.layers.{i}.input_layernorm.weight",          "layers.{i}.input_norm.scale",      KEEP),
    ("model.layers.{i}.self_attn.q_proj.weight",         "layers.{i}.attn.q_proj.kernel",    T),
    ("model.layers.{i}.self_attn.k_proj.weight",         "layers.{i}.attn.k_proj.kernel",    T),
    ("model.layers.{i}.self_attn.v_proj.weight",         "layers.{i}.attn.v_proj.kernel",    T),
    ("model.layers.{i}.self_attn.o_proj.weight",         "layers.{i}.attn.o_proj.kernel",    T),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attn_norm.scale",  KEEP),
    ("model.layers.{i}.mlp.gate_proj.weight",            "layers.{i}.mlp.gate_proj.kernel",  T),
    ("model.layers.{i}.mlp.up_proj.weight",              "layers.{i}.mlp.up_proj.kernel",    T),
    ("model.layers.{i}.mlp.down_proj.weight",            "layers.{i}.mlp.down_proj.kernel",  T),
]
_QKV_BIAS = [
    ("model.layers.{i}.self_attn.q_proj.bias",           "layers.{i}.attn.q_proj.bias",      KEEP),
    ("model.layers.{i}.self_attn.k_proj.bias",           "layers.{i}.attn.k_proj.bias",      KEEP),
    ("model.layers.{i}.self_attn.v_proj.bias",           "layers.{i}.attn.v_proj.bias",      KEEP),
]
_O_BIAS = [
    ("model.layers.{i}.self_attn.o_proj.bias",           "layers.{i}.attn.o_proj.bias",      KEEP),
]
_QK_NORM = [
    ("model.layers.{i}.self_attn.q_norm.weight",         "layers.{i}.attn.q_norm.scale",     KEEP),
    ("model.layers.{i}.self_attn.k_norm.weight",         "layers.{i}.attn.k_norm.scale",     KEEP),
]
_GLOBAL = [
    ("model.embed_tokens.weight",                        "embed.embedding",                  KEEP),
    ("model.norm.weight",                                "final_norm.scale",                 KEEP),
]
_LM_HEAD = [
    ("lm_head.weight",                                   "lm_head.kernel",                   T),
]


@dataclasses.dataclass(frozen=True)
class ParamMapping:
    hf_name: str
    nnx_path: tuple          # e.g. ("layers", 0, "attn", "q_proj", "kernel")
    transpose: bool


def _layer_rules(config: ModelConfig) -> list[tuple[str, str, bool]]:
    """The per-layer rows for a family (which optional rows apply depends on the config)."""
    rows = list(_LAYER)
    if config.qkv_bias:       # qwen2 always; llama / qwen3 when attention_bias
        rows += _QKV_BIAS
    if config.o_proj_bias:    # llama / qwen3 when attention_bias
        rows += _O_BIAS
    if config.qk_norm:        # qwen3
        rows += _QK_NORM
    return rows


def _to_path(dotted: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in dotted.split("."))


def param_mappings(config: ModelConfig) -> list[ParamMapping]:
    """All (HF name, NNX path, transpose) rows for `config`, in HF checkpoint order."""
    rows = [_GLOBAL[0]]
    for i in range(config.num_hidden_layers):
        rows += [(hf.format(i=i), nnx_path.format(i=i), t) for hf, nnx_path, t in _layer_rules(config)]
    rows.append(_GLOBAL[1])
    if not config.tie_word_embeddings:
        rows += _LM_HEAD
    return [ParamMapping(hf, _to_path(p), t) for hf, p, t in rows]
