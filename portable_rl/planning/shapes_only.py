"""Header-only HF checkpoints: config.json + a safetensors file whose header lists every tensor of a
Qwen2 / Qwen3 / Llama model of any size and holds no data.

What reads only headers (`engines.checkpoint.read_checkpoint_shapes`, `rl.colocation`'s memory plan) sees a real 8B
checkpoint's names and shapes in a few kilobytes; nothing can load its weights.

    per layer: q [heads·hd, H], k / v [kv·hd, H] (+ biases in qwen2), o [H, heads·hd], q/k norms [hd] (qwen3),
               gate / up [I, H], down [H, I], 2 RMSNorms [H];   embed [V, H], final norm [H], lm_head [V, H]
"""

from __future__ import annotations

import json
import os
import struct


def hf_shapes(config: dict) -> dict[str, list[int]]:
    """{hf_name: shape} of the checkpoint `config` describes."""
    h, layers, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    kv, inter, vocab = config.get("num_key_value_heads", heads), config["intermediate_size"], config["vocab_size"]
    hd = config.get("head_dim") or h // heads
    qwen2, qwen3 = config.get("model_type") == "qwen2", config.get("model_type") == "qwen3"
    shapes = {"model.embed_tokens.weight": [vocab, h], "model.norm.weight": [h]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": [heads * hd, h], p + "self_attn.k_proj.weight": [kv * hd, h],
                       p + "self_attn.v_proj.weight": [kv * hd, h], p + "self_attn.o_proj.weight": [h, heads * hd],
                       p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
                       p + "mlp.down_proj.weight": [h, inter], p + "input_layernorm.weight": [h],
                       p + "post_attention_layernorm.weight": [h]})
        if qwen2:
            shapes.update({p + "self_attn.q_proj.bias": [heads * hd], p + "self_attn.k_proj.bias": [kv * hd],
                           p + "self_attn.v_proj.bias": [kv * hd]})
        if qwen3:
            shapes.update({p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd]})
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = [vocab, h]
    return shapes


def write_shapes_only_checkpoint(path: str | os.PathLike, config: dict) -> str:
    """Writes config.json and model.safetensors (header only, bf16 entries, no data) to `path`."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    header, offset = {}, 0
    for name, shape in hf_shapes(config).items():
        size = 2
        for d in shape:
            size *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
    return str(path)
