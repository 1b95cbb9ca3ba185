"""Trainer-side 128x128 blockwise FP8 (engines/quantize.py)."""

import json

import pytest
import torch
from safetensors import safe_open

from portable_rl.engines.quantize import (FP8_MAX, dequantize_blockwise_fp8, is_quantized_projection,
                                          quantize_blockwise_fp8, quantize_named_tensors_blockwise,
                                          write_blockwise_fp8_checkpoint)
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

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


# ------------------------------------------------------------------------------------------- INT8 W8A8
def test_int8_per_channel_is_round_half_even_of_w_over_amax_127():
    from portable_rl.engines.quantize import INT8_MAX, quantize_int8_per_channel

    w = torch.tensor([[127.0, 0.5, -1.5, 2.5, -63.5],      # amax 127: scale 1, ties go to the even integer
                      [0.0, 0.0, 0.0, 0.0, 0.0],           # all-zero channel: scale 1, all zeros
                      [-3.0, 1.0, 0.0, 1.5, 3.0]])
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (3, 1)
    assert q[0].tolist() == [127, 0, -2, 2, -64] and scale[0, 0] == 1.0
    assert q[1].tolist() == [0] * 5 and scale[1, 0] == 1.0
    assert scale[2, 0] == torch.tensor(3.0) / INT8_MAX and q[2].tolist()[0] == -127 and q[2].tolist()[-1] == 127
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different magnitude
    q, scale = quantize_int8_per_channel(w)
    assert q.abs().max() == 127 and torch.all((q.float() * scale - w).abs() <= scale / 2 * (1 + 1e-6))


def test_int8_refuses_nan_and_inf_naming_the_tensor():
    from portable_rl.engines.quantize import NonFiniteWeightError, quantize_named_tensors_int8

    for bad in (float("nan"), float("inf")):
        w = torch.ones(4, 8)
        w[2, 3] = bad
        with pytest.raises(NonFiniteWeightError, match=r"model.layers.0.mlp.up_proj.weight holds NaN or inf"):
            list(quantize_named_tensors_int8([("model.layers.0.mlp.up_proj.weight", w)]))


def test_int8_named_tensors_add_a_weight_scale_and_pass_int8_through():
    from portable_rl.engines.quantize import quantize_named_tensors_int8

    w = torch.randn(16, 8, dtype=torch.bfloat16)
    norm = torch.ones(8, dtype=torch.bfloat16)
    q8, s8 = torch.ones(16, 8, dtype=torch.int8), torch.ones(16, 1)
    out = list(quantize_named_tensors_int8([("model.layers.0.self_attn.q_proj.weight", w),
                                            ("model.layers.0.input_layernorm.weight", norm),
                                            ("model.layers.1.self_attn.q_proj.weight", q8),
                                            ("model.layers.1.self_attn.q_proj.weight_scale", s8)]))
    assert [n for n, _ in out] == ["model.layers.0.self_attn.q_proj.weight",
                                   "model.layers.0.self_attn.q_proj.weight_scale",
                                   "model.layers.0.input_layernorm.weight",
                                   "model.layers.1.self_attn.q_proj.weight",
                                   "model.layers.1.self_attn.q_proj.weight_scale"]
    assert out[0][1].dtype == torch.int8 and out[1][1].shape == (16, 1)
    assert out[2][1] is norm and out[3][1] is q8 and out[4][1] is s8


@pytest.mark.parametrize("sharded", [False, True])
def test_write_int8_checkpoint_is_compressed_tensors_w8a8(tmp_path, sharded):
    from portable_rl.engines.quantize import is_int8_checkpoint, quantize_int8_per_channel, write_int8_checkpoint

    src = make_tiny_checkpoint(tmp_path / "bf16", "qwen2")
    if sharded:  # the same tensors in two shards with an index: the index must list the new scales
        from safetensors.torch import load_file, save_file

        tensors = load_file(f"{src}/model.safetensors")
        names = sorted(tensors)
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for fname, part in halves.items():
            save_file({n: tensors[n] for n in part}, f"{src}/{fname}", metadata={"format": "pt"})
        (tmp_path / "bf16" / "model.safetensors").unlink()
        (tmp_path / "bf16" / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}))
    dst = write_int8_checkpoint(src, str(tmp_path / "int8"))
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    qc = config["quantization_config"]
    assert is_int8_checkpoint(dst) and qc["format"] == "int-quantized" and qc["ignore"][0] == "lm_head"
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and not group["weights"]["dynamic"]
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"]
    from portable_rl.engines.checkpoint import read_checkpoint_shapes

    before, after = read_checkpoint_shapes(src), read_checkpoint_shapes(dst)
    projections = [n for n in before if is_quantized_projection(n)]
    assert projections and set(after) == set(before) | {n.removesuffix("weight") + "weight_scale" for n in projections}
    if sharded:
        index = json.loads((tmp_path / "int8" / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(index) == set(after)
    name = projections[0]
    from safetensors.torch import load_file

    written = {}
    for f in (tmp_path / "int8").glob("*.safetensors"):
        written.update(load_file(str(f)))
    original = {}
    for f in (tmp_path / "bf16").glob("*.safetensors"):
        original.update(load_file(str(f)))
    q, scale = quantize_int8_per_channel(original[name])
    assert torch.equal(written[name], q) and torch.equal(written[name.removesuffix("weight") + "weight_scale"], scale)
    assert torch.equal(written["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
