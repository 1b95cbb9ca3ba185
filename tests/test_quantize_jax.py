"""The learner-side INT8 quantizer (learner_jax/quantize.py) is bit-equal to the engine side's torch formula
(engines/quantize.py), and the push exports int8 + weight_scale from it (convert.hf.export_arrays)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from portable_rl.engines.quantize import NonFiniteWeightError, quantize_int8_per_channel as torch_int8
from portable_rl.learner_jax.quantize import quantize_int8_per_channel, served_int8_per_channel


def _bf16_weights(seed: int, shape=(96, 80)) -> np.ndarray:
    """NNX kernels [in, out] on the bf16 grid, with columns of very different magnitude and exact midpoints."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * np.logspace(-4, 1, shape[1], dtype=np.float32)
    w[:, 3] = 0.0                                         # an all-zero output channel
    w[:7, 5] = [127.0, 0.5, -1.5, 2.5, -63.5, 1.0, -127.0]  # amax 127: quotients exactly on .5 midpoints
    w[7:, 5] = 0.0
    return np.array(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))  # a writable copy


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_jax_int8_equals_torch_bit_for_bit(seed):
    w = _bf16_weights(seed)
    q, scale, finite = jax.jit(quantize_int8_per_channel)(jnp.asarray(w, jnp.bfloat16))
    q_t, scale_t = torch_int8(torch.from_numpy(w.T.copy()))  # torch takes the HF layout [out, in]
    assert bool(finite) and q.dtype == jnp.int8 and scale.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(q).T, q_t.numpy())
    np.testing.assert_array_equal(np.asarray(scale), scale_t.numpy()[:, 0])
    assert np.asarray(q)[:, 5][:5].tolist() == [127, 0, -2, 2, -64]  # half to even, as torch.round
    served = np.asarray(jax.jit(served_int8_per_channel)(jnp.asarray(w)))
    np.testing.assert_array_equal(served, (q_t.float() * scale_t).numpy().T)


def test_jax_int8_flags_nan_and_inf():
    for bad in (np.nan, np.inf, -np.inf):
        w = _bf16_weights(0)
        w[10, 20] = bad
        assert not bool(jax.jit(quantize_int8_per_channel)(jnp.asarray(w))[2])


def test_export_pushes_int8_and_scales_for_projections_only(tmp_path):
    from portable_rl.convert.hf import load_hf_model
    from portable_rl.convert.to_torch import iter_hf_tensors
    from portable_rl.engines.checkpoint import read_checkpoint_shapes
    from portable_rl.engines.quantize import is_quantized_projection, write_int8_checkpoint
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "bf16", "qwen2")
    model, config = load_hf_model(src, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    bf16 = dict(iter_hf_tensors(model, config))
    int8 = dict(iter_hf_tensors(model, config, quantization="int8_per_channel"))
    # exactly the names and shapes of the INT8 checkpoint the engine starts on
    expected = read_checkpoint_shapes(write_int8_checkpoint(src, str(tmp_path / "int8")))
    assert {n: tuple(t.shape) for n, t in int8.items()} == expected
    for name, tensor in bf16.items():
        if is_quantized_projection(name):
            q, scale = torch_int8(tensor.float())
            assert torch.equal(int8[name], q) and torch.equal(int8[name.removesuffix("weight") + "weight_scale"], scale)
        else:
            assert torch.equal(int8[name], tensor)
    projection_bytes = sum(t.numel() * t.element_size() for n, t in bf16.items() if is_quantized_projection(n))
    pushed = sum(t.numel() * t.element_size() for n, t in int8.items() if is_quantized_projection(n)
                 or n.endswith("weight_scale"))
    assert pushed < 0.55 * projection_bytes  # int8 + one f32 scale per row: about half of bf16


def test_export_refuses_nan_before_yielding_it(tmp_path):
    from portable_rl.convert.hf import get_param, load_hf_model
    from portable_rl.convert.mapping import param_mappings
    from portable_rl.convert.to_torch import iter_hf_tensors
    from portable_rl.engines.quantize import is_quantized_projection
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    model, config = load_hf_model(make_tiny_checkpoint(tmp_path / "bf16", "qwen2"), param_dtype=jnp.float32,
                                  compute_dtype=jnp.float32)
    bad = [m for m in param_mappings(config) if is_quantized_projection(m.hf_name)][3]
    param = get_param(model, bad.nnx_path)
    param[...] = param[...].at[0, 0].set(jnp.nan)
    names = []
    with pytest.raises(NonFiniteWeightError, match=bad.hf_name.replace(".", r"\.") + " holds NaN or inf"):
        for name, _ in iter_hf_tensors(model, config, quantization="int8_per_channel"):
            names.append(name)
    assert bad.hf_name not in names


def _fake_quant_weights(seed: int, shape=(128, 48)) -> np.ndarray:
    """bf16-grid kernels [in, out] whose groups span many magnitudes, with e2m1 ties and saturation in them."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * np.logspace(-6, 2, shape[0], dtype=np.float32)[:, None]
    w[:32, 0] = 0.0                                             # an all-zero MXFP4 group and NVFP4 blocks
    w[:32, 1] = [4.0] + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4 + [-0.25, -2.5, -5.0]  # ties at scale 1
    w[32:64, 2] = np.ldexp(1.0, np.arange(-16, 16))              # powers of two: scale exponents exact
    return np.array(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4", "fp8_e4m3_tensor"])
def test_jax_fake_quantizers_equal_the_fake_quant_engines_bit_for_bit(scheme, seed):
    """The learner's view of the `fake_quant` engine (SERVED_WEIGHTS['fake_<scheme>']) is exactly what the engine
    serves for the bf16 push: engines.quantize.fake_quantize on torch's [out, in] layout."""
    from portable_rl.engines.quantize import fake_quantize
    from portable_rl.learner_jax.quantize import SERVED_WEIGHTS

    w = _fake_quant_weights(seed)
    served = np.asarray(jax.jit(SERVED_WEIGHTS[f"fake_{scheme}"])(jnp.asarray(w)))
    engine = fake_quantize(torch.from_numpy(w.T.copy()).to(torch.bfloat16), scheme).float().numpy().T
    np.testing.assert_array_equal(served, engine)
    assert len(np.unique(served)) > 50                          # not a degenerate grid
    stacked = np.asarray(jax.jit(SERVED_WEIGHTS[f"fake_{scheme}"])(jnp.stack([jnp.asarray(w), 3 * jnp.asarray(w)])))
    np.testing.assert_array_equal(stacked[0], served)            # a stack quantizes each matrix alone


def test_e2m1_rounds_to_nearest_ties_to_even():
    from portable_rl.learner_jax.quantize import round_to_e2m1

    x = jnp.asarray([0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.75, -5.0, 0.0])
    assert np.asarray(round_to_e2m1(x)).tolist() == [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0,
                                                     -1.0, -4.0, 0.0]


def test_moe_export_quantizes_every_expert_as_the_engine_and_keeps_routers_float(tmp_path):
    """INT8 push of a tiny Qwen3-MoE: each expert's int8 + scale is the engine's torch formula on that expert's
    bf16 matrix (the stack is quantized once, per expert and channel), the routers stay float, and the names and
    shapes are the INT8 start checkpoint's."""
    from portable_rl.convert.hf import load_hf_model
    from portable_rl.convert.to_torch import iter_hf_tensors
    from portable_rl.engines.checkpoint import read_checkpoint_shapes
    from portable_rl.engines.quantize import is_quantized_weight, write_int8_checkpoint
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe")
    model, config = load_hf_model(src, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    bf16 = dict(iter_hf_tensors(model, config))
    int8 = dict(iter_hf_tensors(model, config, quantization="int8_per_channel"))
    assert {n: tuple(t.shape) for n, t in int8.items()} == read_checkpoint_shapes(
        write_int8_checkpoint(src, str(tmp_path / "int8")))
    experts = [n for n in bf16 if ".mlp.experts." in n]
    assert len(experts) == 3 * config.num_experts * config.num_hidden_layers
    for name in experts:
        assert is_quantized_weight(name) and int8[name].dtype == torch.int8
        q, scale = torch_int8(bf16[name].float())
        assert torch.equal(int8[name], q) and torch.equal(int8[name.removesuffix("weight") + "weight_scale"], scale)
    routers = [n for n in bf16 if n.endswith(".mlp.gate.weight")]
    assert routers and all(not is_quantized_weight(n) and torch.equal(int8[n], bf16[n]) for n in routers)


def test_moe_export_names_the_expert_holding_nan(tmp_path):
    from portable_rl.convert.hf import get_param, load_hf_model
    from portable_rl.convert.to_torch import iter_hf_tensors
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    model, config = load_hf_model(make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe"), param_dtype=jnp.float32,
                                  compute_dtype=jnp.float32)
    param = get_param(model, ("layers", 1, "mlp", "experts", "up_proj"))
    param[...] = param[...].at[2, 0, 0].set(jnp.inf)
    with pytest.raises(NonFiniteWeightError, match=r"model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight holds NaN"):
        for _ in iter_hf_tensors(model, config, quantization="int8_per_channel"):
            pass
