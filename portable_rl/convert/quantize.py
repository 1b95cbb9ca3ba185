"""Trainer-side FP8 quantizers (torch only; no JAX here).

128×128 blockwise FP8 (the DeepSeek-V3 / Qwen3-FP8 checkpoint format that SGLang and vLLM load as
`quant_method="fp8"` with `weight_block_size=[128, 128]`): for a linear weight W [out, in], every 128×128 tile
b gets one scale

    s_b = max|W_b| / 448                  (448 = largest finite float8_e4m3fn)
    Q_b = round_to_e4m3(W_b / s_b)        (float8_e4m3fn)
    W_b ≈ Q_b * s_b                       (dequantization; s is stored as `weight_scale_inv`, [ceil(out/128), ceil(in/128)] f32)

The name `weight_scale_inv` is the checkpoint convention: it multiplies Q back to W (it is the inverse of
the quantization scale 448 / amax). Only the decoder's projection matrices are quantized; embeddings,
norms, biases and lm_head stay in bf16, as in published FP8 checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Iterable, Iterator

import torch

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = (128, 128)
QUANTIZED_PROJECTIONS = re.compile(
    r"\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")


def quantize_blockwise_fp8(weight: torch.Tensor, block: tuple[int, int] = BLOCK
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """W [M, N] → (Q [M, N] float8_e4m3fn, scale_inv [ceil(M/bm), ceil(N/bn)] float32) with W ≈ Q * scale_inv."""
    if weight.dim() != 2:
        raise ValueError(f"blockwise FP8 needs a 2-D weight, got shape {tuple(weight.shape)}")
    m, n = weight.shape
    bm, bn = block
    gm, gn = -(-m // bm), -(-n // bn)
    w = torch.zeros(gm * bm, gn * bn, dtype=torch.float32, device=weight.device)  # zero-pad to whole tiles
    w[:m, :n] = weight.to(torch.float32)
    tiles = w.view(gm, bm, gn, bn)  # [gm, bm, gn, bn]
    amax = tiles.abs().amax(dim=(1, 3))  # [gm, gn]
    scale_inv = (amax / FP8_MAX).clamp(min=1e-12)  # an all-zero tile keeps a tiny positive scale
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(gm * bm, gn * bn)[:m, :n].contiguous(), scale_inv


def dequantize_blockwise_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_blockwise_fp8` (up to FP8 rounding)."""
    m, n = q.shape
    scale = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:m, :n]
    return (q.to(torch.float32) * scale).to(dtype)


def is_quantized_projection(name: str) -> bool:
    return QUANTIZED_PROJECTIONS.search(name) is not None


def quantize_named_tensors_blockwise(pairs: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] = BLOCK
                                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs → projections as (name, fp8) + (name_scale_inv, f32); the rest unchanged."""
    for name, tensor in pairs:
        if is_quantized_projection(name):
            q, scale_inv = quantize_blockwise_fp8(tensor, block)
            yield name, q
            yield name + "_scale_inv", scale_inv  # "...proj.weight" → "...proj.weight_scale_inv"
        else:
            yield name, tensor


def blockwise_quantization_config(block: tuple[int, int] = BLOCK) -> dict:
    """The `quantization_config` entry of config.json for a blockwise FP8 checkpoint."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block)}


def write_blockwise_fp8_checkpoint(src: str, dst: str, block: tuple[int, int] = BLOCK) -> str:
    """Copies the HF checkpoint `src` to `dst` with its projections quantized 128×128 (FP8 + weight_scale_inv)."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for fname in os.listdir(src):
        path = os.path.join(src, fname)
        if fname.endswith(".safetensors"):
            tensors = dict(quantize_named_tensors_blockwise(load_file(path).items(), block))
            save_file(tensors, os.path.join(dst, fname), metadata={"format": "pt"})
        elif fname == "model.safetensors.index.json":
            with open(path) as f:
                index = json.load(f)
            weight_map = index["weight_map"]
            for name in list(weight_map):
                if is_quantized_projection(name):
                    weight_map[name + "_scale_inv"] = weight_map[name]
            with open(os.path.join(dst, fname), "w") as f:
                json.dump(index, f, indent=2)
        elif fname == "config.json":
            with open(path) as f:
                config = json.load(f)
            config["quantization_config"] = blockwise_quantization_config(block)
            with open(os.path.join(dst, fname), "w") as f:
                json.dump(config, f, indent=2)
        elif os.path.isfile(path):
            shutil.copy(path, os.path.join(dst, fname))
    return dst
