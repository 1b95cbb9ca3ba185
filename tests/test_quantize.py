"""Trainer-side 128x128 blockwise FP8 (engines/quantize.py)."""

import json

import pytest
import torch
from safetensors import safe_open

from portable_rl.engines.quantize import (FP8_MAX, dequantize_blockwise_fp8, is_quantized_projection,
                                          quantize_blockwise_fp8, quantize_named_tensors_blockwise,
                                          write_blockwise_fp8_checkpoint)
from portable_rl.testing import make_tiny_checkpoint

# float8_e4m3fn has 3 mantissa bits: round-to-nearest relative error <= 2**-4 for normal values.
E4M3_REL_ERR = 2.0 ** -4


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (128, 64), (1, 1)])
def test_blockwise_roundtrip_error_is_bounded_per_tile(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns of very different magnitude
    q, scale_inv = quantize_blockwise_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and scale_inv.dtype == torch.float32
    w_hat = dequantize_blockwise_fp8(q, scale_inv)
    # Per tile the error is at most half an e4m3 step at the tile's largest value (subnormals: absolute step).
    scale = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    bound = torch.maximum(w.abs() * E4M3_REL_ERR, scale * 2.0 ** -9)
    assert torch.all((w_hat - w).abs() <= bound + 1e-12)
    assert (w_hat - w).abs().max() > 0 or shape == (1, 1)  # it really is quantized


def test_tile_max_maps_to_fp8_max_and_zero_tiles_stay_zero():
    w = torch.zeros(256, 256)
    w[0, 0] = 3.0
    w[200, 200] = -0.5
    q, scale_inv = quantize_blockwise_fp8(w)
    assert scale_inv[0, 0] == pytest.approx(3.0 / FP8_MAX)
    assert q[0, 0].float() == FP8_MAX and q[200, 200].float() == -FP8_MAX
    assert torch.all(dequantize_blockwise_fp8(q, scale_inv)[:128, 128:] == 0)


def test_only_decoder_projections_are_quantized():
    assert is_quantized_projection("model.layers.3.self_attn.q_proj.weight")
    assert is_quantized_projection("model.layers.0.mlp.down_proj.weight")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.self_attn.q_proj.bias", "model.norm.weight"):
        assert not is_quantized_projection(name)
    pairs = [("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 32)),
             ("model.layers.0.self_attn.q_proj.bias", torch.randn(64))]
    out = dict(quantize_named_tensors_blockwise(pairs))
    assert set(out) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv",
                        "model.layers.0.self_attn.q_proj.bias"}
    assert out["model.layers.0.self_attn.q_proj.bias"] is pairs[1][1]


def test_write_blockwise_checkpoint(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "bf16", "qwen3")
    dst = write_blockwise_fp8_checkpoint(src, str(tmp_path / "fp8"))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert (tmp_path / "fp8" / "tokenizer.json").exists()
    with safe_open(f"{src}/model.safetensors", "pt") as a, safe_open(f"{dst}/model.safetensors", "pt") as b:
        name = "model.layers.1.mlp.up_proj.weight"
        assert b.get_tensor(name).dtype == torch.float8_e4m3fn
        w_hat = dequantize_blockwise_fp8(b.get_tensor(name), b.get_tensor(name + "_scale_inv"))
        w = a.get_tensor(name).float()
        assert torch.all((w_hat - w).abs() <= w.abs() * E4M3_REL_ERR + 1e-6)
        assert torch.equal(a.get_tensor("model.embed_tokens.weight"), b.get_tensor("model.embed_tokens.weight"))
        n_proj = sum(is_quantized_projection(k) for k in a.keys())
        assert n_proj == 2 * 7 and len(list(b.keys())) == len(list(a.keys())) + n_proj
