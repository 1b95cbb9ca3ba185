"""Fake quantizers (engines.quantize.fake_quantize) and the `fake_quant` engine wrapper (engines/fake_quant.py).

Quantizer tests are pure torch. The engine tests start one module-scoped pair of real vLLM engines: the
wrapper around a bf16 engine on a tiny random checkpoint, and a plain bf16 engine started on a copy of that
checkpoint whose projections were fake-quantized offline. Seeded sampling from both must agree exactly,
after construction and after a push, while the unquantized weights give different logprobs.
"""

import shutil

import numpy as np
import pytest
import torch

from portable_rl.engines.quantize import (E2M1_GRID, FAKE_QUANT_SCHEMES, fake_quantize, fake_quantize_mxfp4,
                                          fake_quantize_named_tensors, fake_quantize_nvfp4, round_to_e2m1)


def random_weight(out=64, inp=128, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # heavy-ish tails and very different row scales, as in trained projections
    w = torch.randn(out, inp, generator=g) * torch.logspace(-3, 0, out)[:, None]
    return w.to(dtype)


# ------------------------------------------------------------------------------------------ e2m1 rounding
def test_e2m1_grid_points_are_fixed_and_ties_go_to_even():
    grid = torch.tensor(E2M1_GRID)
    assert torch.equal(round_to_e2m1(grid), grid)
    assert torch.equal(round_to_e2m1(-grid), -grid)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert round_to_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # even mantissa wins
    assert round_to_e2m1(torch.tensor([7.0, -100.0, 0.3, 2.6])).tolist() == [6.0, -6.0, 0.5, 3.0]


# ------------------------------------------------------------------------------------------ quantizers
def test_mxfp4_is_nearest_grid_value_times_a_power_of_two_scale_per_group_of_32():
    w = random_weight()
    q = fake_quantize_mxfp4(w)
    groups, qgroups = w.view(64, 4, 32), q.view(64, 4, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 2)                 # OCP MX: 2^(floor(log2 amax) - emax)
    candidates = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID[1:]))   # 15 FP4 values
    grid = candidates * scale                                               # [64, 4, 15]
    nearest = grid.gather(-1, (groups[..., None] - grid[..., None, :]).abs().argmin(-1))
    assert torch.equal(qgroups, nearest)      # every element: the nearest representable value of its group
    assert ((qgroups / scale).abs() <= 6).all()


@pytest.mark.parametrize("scheme,rel_err_max", [("fp8_e4m3_tensor", 0.05), ("nvfp4", 0.15), ("mxfp4", 0.2)])
def test_error_bounds(scheme, rel_err_max):
    w = random_weight(seed=1)
    q = fake_quantize(w, scheme)
    assert q.shape == w.shape and q.dtype == w.dtype
    rel = ((q - w).norm() / w.norm()).item()
    assert 1e-3 < rel < rel_err_max, rel


def test_nvfp4_elementwise_bound_is_one_block_step():
    """|W − W'| ≤ 1 · s_b·g: half the largest e2m1 gap (4 → 6), including the e4m3 rounding of s_b."""
    w = random_weight(seed=2)
    q = fake_quantize_nvfp4(w)
    blocks, qblocks = w.view(64, 8, 16), q.view(64, 8, 16)
    g = w.abs().max() / (448 * 6)
    s = (blocks.abs().amax(-1, keepdim=True) / (6 * g)).to(torch.float8_e4m3fn).float() * g
    assert ((blocks - qblocks).abs() <= s * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", FAKE_QUANT_SCHEMES)
def test_quantizing_twice_equals_once(scheme, dtype):
    once = fake_quantize(random_weight(seed=3, dtype=dtype), scheme)
    torch.testing.assert_close(fake_quantize(once, scheme), once, rtol=1e-6, atol=0)
    if scheme == "mxfp4":  # power-of-two scales: exactly idempotent
        assert torch.equal(fake_quantize(once, scheme), once)


def test_only_decoder_projections_are_quantized():
    pairs = [("model.embed_tokens.weight", random_weight(seed=4)),
             ("model.layers.0.self_attn.q_proj.weight", random_weight(seed=5)),
             ("model.layers.0.self_attn.q_proj.bias", torch.randn(64)),
             ("model.layers.1.mlp.down_proj.weight", random_weight(seed=6)),
             ("model.norm.weight", torch.randn(128)), ("lm_head.weight", random_weight(seed=7))]
    out = dict(fake_quantize_named_tensors(pairs, "mxfp4"))
    for name, tensor in pairs:
        changed = not torch.equal(out[name], tensor)
        assert changed == name.endswith("proj.weight"), name


def test_bad_input_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match="use one of"):
        fake_quantize(random_weight(), "int3")
    with pytest.raises(ValueError, match="must divide"):
        fake_quantize(torch.randn(4, 40), "mxfp4")
    with pytest.raises(ValueError, match="2-D"):
        fake_quantize(torch.randn(4, 4, 32), "mxfp4")


# ------------------------------------------------------------------------------------------ engine wrapper
SAMPLING_KW = dict(temperature=1.0, max_tokens=10, n=2, seed=11)
PROMPTS = [[1, 40, 41, 42, 43], [1, 60, 61], [1, 70, 71, 72, 73, 74, 75, 76]]


def read_tensors(path):
    from safetensors.torch import load_file

    return list(load_file(f"{path}/model.safetensors").items())


def perturbed(pairs, scale=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(n, (t.float() + scale * t.float().std() * torch.randn(t.shape, generator=g)).to(t.dtype))
            for n, t in pairs]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    pytest.importorskip("vllm")
    from safetensors.torch import save_file

    from portable_rl.engines import create_engine
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("fake_quant")
    ckpt = make_tiny_checkpoint(root / "bf16", "qwen2")
    quantized = root / "mxfp4"
    shutil.copytree(ckpt, quantized)
    save_file(dict(fake_quantize_named_tensors(read_tensors(ckpt), "mxfp4")), str(quantized / "model.safetensors"),
              metadata={"format": "pt"})
    kwargs = dict(max_model_len=64)
    wrapped = create_engine("fake_quant", model_path=str(ckpt), engine="vllm", scheme="mxfp4",
                            engine_kwargs={"engine_init_kwargs": {"quantization": None}, **kwargs})
    reference = create_engine("vllm", model_path=str(quantized), **kwargs)
    yield wrapped, reference, read_tensors(ckpt)
    wrapped.close()
    reference.close()


def sample(engine):
    from portable_rl.engines import SamplingConfig

    rollouts = engine.generate(PROMPTS, SamplingConfig(**SAMPLING_KW))
    return [r.response_token_ids for r in rollouts], [r.response_logprobs for r in rollouts]


def assert_same(a, b):
    assert a[0] == b[0]
    np.testing.assert_array_equal(np.concatenate(a[1]), np.concatenate(b[1]))


@pytest.mark.slow
@pytest.mark.vllm
def test_wrapper_serves_fake_quantized_weights_from_the_start_and_after_pushes(engines):
    wrapped, reference, original = engines
    assert wrapped.quantization == "fake_mxfp4"  # the post-sync probe treats it as a quantized engine
    # 1. construction: the wrapper pushed the fake-quantized checkpoint weights
    assert_same(sample(wrapped), sample(reference))

    # 2. the same, unquantized weights give other logprobs (the quantization is not a no-op)
    wrapped.inner.update_weights(original)
    tokens_plain, logp_plain = sample(wrapped)
    tokens_fq, logp_fq = sample(reference)
    diffs = [abs(a - b) for ta, la, tb, lb in zip(tokens_plain, logp_plain, tokens_fq, logp_fq)
             for x, y, a, b in zip(ta, tb, la, lb) if x == y]
    assert diffs and max(diffs) > 1e-3, max(diffs, default=None)

    # 3. update_weights fake-quantizes what is pushed (new weights, one flat one-shot iterator)
    new = perturbed(original)
    wrapped.update_weights(iter(new))
    reference.update_weights(list(fake_quantize_named_tensors(new, "mxfp4")))
    assert_same(sample(wrapped), sample(reference))


# ------------------------------------------------------------------------------------------ gin recipe
def test_gin_file_selects_the_wrapper_over_an_unquantized_vllm(tmp_path):
    gin = pytest.importorskip("gin")
    from portable_rl import gin_utils
    from portable_rl.engines.registry import available_engines
    from portable_rl.train import register_gin

    gin.clear_config()
    try:
        register_gin()
        gin_utils.parse_gin(["gin/dapo_fp8.gin", "gin/engines/fake_quant.gin"],
                            [f"RUN_DIR = '{tmp_path}'", "FAKE_QUANT_SCHEME = 'nvfp4'"])
        scope = "fake_quant/engines.create_engine"
        assert gin.query_parameter(f"{scope}.name") == "fake_quant" and "fake_quant" in available_engines()
        assert gin_utils.query_value(f"{scope}.scheme") == "nvfp4"
        assert gin_utils.query_value(f"{scope}.engine") == "vllm"
        kwargs = gin_utils.query_value(f"{scope}.engine_kwargs")
        assert kwargs["engine_init_kwargs"] == {"quantization": None} and kwargs["max_model_len"] == 64
        assert gin_utils.query_value("train.engine_factory").__name__ == "create_engine"
    finally:
        gin.clear_config()
