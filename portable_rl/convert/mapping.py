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

Mixture-of-experts layers (qwen3_moe, qwen2_moe; `ModelConfig.is_sparse_layer`) replace the three dense
MLP rows with the router and one row per expert `{e}`: the hub's (and vLLM's loader's) per-expert names
all map to ONE stacked NNX array [E, in, out], and the row's `expert` index selects its slice. Loading
stacks the E transposed HF matrices; exporting yields each expert's slice transposed back.

    model.layers.{i}.mlp.gate.weight                    layers.{i}.mlp.router.kernel            yes
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight   layers.{i}.mlp.experts.gate_proj [e]    yes
    model.layers.{i}.mlp.shared_expert.*.weight         layers.{i}.mlp.shared_expert.*.kernel   yes  (qwen2_moe)
    model.layers.{i}.mlp.shared_expert_gate.weight      layers.{i}.mlp.shared_expert_gate.kernel yes (qwen2_moe)
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
]
_DENSE_MLP = [
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
# Qwen3-MoE and Qwen2-MoE sparse layers. Expert rows: {e} is the expert, the NNX array is stacked [E, ...].
_ROUTER = [
    ("model.layers.{i}.mlp.gate.weight",                 "layers.{i}.mlp.router.kernel",     T),
]
_EXPERTS = [
    ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "layers.{i}.mlp.experts.gate_proj", T),
    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight",   "layers.{i}.mlp.experts.up_proj",   T),
    ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", "layers.{i}.mlp.experts.down_proj", T),
]
_SHARED_EXPERT = [  # qwen2_moe
    ("model.layers.{i}.mlp.shared_expert.gate_proj.weight", "layers.{i}.mlp.shared_expert.gate_proj.kernel", T),
    ("model.layers.{i}.mlp.shared_expert.up_proj.weight",   "layers.{i}.mlp.shared_expert.up_proj.kernel",   T),
    ("model.layers.{i}.mlp.shared_expert.down_proj.weight", "layers.{i}.mlp.shared_expert.down_proj.kernel", T),
    ("model.layers.{i}.mlp.shared_expert_gate.weight",      "layers.{i}.mlp.shared_expert_gate.kernel",      T),
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
    expert: int | None = None  # an expert row: its slice of the stacked [E, ...] array at nnx_path


def _layer_rules(config: ModelConfig, i: int) -> list[tuple[str, str, bool, int | None]]:
    """Layer `i`'s rows (HF name, NNX path, transpose, expert), formatted; which apply depends on the config."""
    rows = [(*row, None) for row in _LAYER]
    if not config.is_sparse_layer(i):
        rows += [(*row, None) for row in _DENSE_MLP]
    else:
        rows += [(*row, None) for row in _ROUTER]
        # Parameter-major (all experts' gate_proj, then up_proj, ...): an exporter slices one stacked
        # array E times in a row.
        rows += [(hf, nnx_path, t, e) for hf, nnx_path, t in _EXPERTS for e in range(config.num_experts)]
        if config.shared_expert_intermediate_size:
            rows += [(*row, None) for row in _SHARED_EXPERT]
    if config.qkv_bias:       # qwen2 always; llama / qwen3 when attention_bias
        rows += [(*row, None) for row in _QKV_BIAS]
    if config.o_proj_bias:    # llama / qwen3 when attention_bias
        rows += [(*row, None) for row in _O_BIAS]
    if config.qk_norm:        # qwen3
        rows += [(*row, None) for row in _QK_NORM]
    return [(hf.format(i=i, e=e), nnx_path.format(i=i), t, e) for hf, nnx_path, t, e in rows]


def _to_path(dotted: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in dotted.split("."))


def param_mappings(config: ModelConfig) -> list[ParamMapping]:
    """All (HF name, NNX path, transpose) rows for `config`, in HF checkpoint order."""
    rows = [(*_GLOBAL[0], None)]
    for i in range(config.num_hidden_layers):
        rows += _layer_rules(config, i)
    rows.append((*_GLOBAL[1], None))
    if not config.tie_word_embeddings:
        rows += [(*row, None) for row in _LM_HEAD]
    return [ParamMapping(hf, _to_path(p), t, e) for hf, p, t, e in rows]
