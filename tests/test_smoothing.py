"""SmoothQuant for INT8 pushes (convert/smoothing.py): the rescaled weights compute the same function, the
factors follow the formula, and a run keeps the factors it calibrated (a resume pushes what it pushed)."""

import jax.numpy as jnp
import numpy as np
import pytest

from portable_rl.convert.hf import get_param, load_hf_model
from portable_rl.convert.mapping import param_mappings
from portable_rl.convert.smoothing import Smoothing, calibrate, input_absmax, smoothing_factors
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

PROMPTS = [[1, 5, 9, 14, 3, 7], [1, 22, 8, 30], [1, 4, 4, 4, 4, 4, 4, 4, 12]]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)
    model, config = load_hf_model(path, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    # outlier channels, as real models have them: a few input-norm gains far above the rest
    for i in range(config.num_hidden_layers):
        gain = get_param(model, ("layers", i, "input_norm", "scale"))
        gain[...] = gain[...].at[::7].multiply(30.0)
    return model, config


def _smoothed_copy(model, config, smoothing):
    """The model whose parameters are what a smoothed push sends, before any quantization."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # new Variables, the same arrays
    for m in param_mappings(config):
        param = get_param(copy, m.nnx_path)
        param[...] = smoothing.apply(m.hf_name, get_param(model, m.nnx_path)[...])
    return copy


def test_smoothed_weights_compute_the_same_function(model):
    model, config = model
    smoothing = calibrate(model, PROMPTS)
    ids = jnp.asarray([[1, 3, 5, 7, 9, 11, 13]], jnp.int32)
    smooth = _smoothed_copy(model, config, smoothing)
    np.testing.assert_allclose(np.asarray(smooth(ids)), np.asarray(model(ids)), rtol=2e-4, atol=2e-4)
    # ... and the q/k/v inputs are flatter: the outlier channels were divided down
    before = input_absmax(model, PROMPTS)["model.layers.0.self_attn.q_proj"]
    after = input_absmax(smooth, PROMPTS)["model.layers.0.self_attn.q_proj"]
    assert after.max() / np.median(after) < before.max() / np.median(before) / 3


def test_factors_follow_the_smoothquant_formula(model):
    model, config = model
    maxima = input_absmax(model, PROMPTS)
    for alpha in (0.0, 0.5, 1.0):
        s = smoothing_factors(model, maxima, alpha).factors["model.layers.1.mlp.gate_proj"]
        a = maxima["model.layers.1.mlp.gate_proj"]
        w = np.maximum(*(np.abs(np.asarray(get_param(model, ("layers", 1, "mlp", p, "kernel"))[...])).max(axis=1)
                         for p in ("gate_proj", "up_proj")))
        np.testing.assert_allclose(s, a ** alpha / w ** (1 - alpha), rtol=1e-5)
    with pytest.raises(ValueError, match=r"alpha=1.5: use a value in \[0, 1\]"):
        smoothing_factors(model, maxima, 1.5)


def test_factors_round_trip_and_a_resumed_run_reuses_them(model, tmp_path):
    from portable_rl.rl.multihost import Processes
    from portable_rl.rl.sync import SMOOTHQUANT_FILE, smoothquant_for_run

    model, config = model

    class Codec:
        def encode_prompt(self, prompt):
            return [1] + [3 + ord(c) % 90 for c in prompt]

    class Task:
        def train_batch(self, step, draw, size):
            from portable_rl.tasks.base import Example
            return [Example(prompt=f"{step} {draw} {i} + {i}", answer=str(i)) for i in range(size)]

    kw = dict(model=model, codec=Codec(), task=Task(), run_dir=str(tmp_path), procs=Processes())
    first = smoothquant_for_run(0.5, engine_quantization="int8_per_channel", **kw)
    assert (tmp_path / SMOOTHQUANT_FILE).exists()
    get_param(model, ("layers", 0, "mlp", "up_proj", "kernel"))[...] *= 2.0  # training moved the weights
    again = smoothquant_for_run(0.5, engine_quantization="int8_per_channel", **kw)
    get_param(model, ("layers", 0, "mlp", "up_proj", "kernel"))[...] /= 2.0
    assert set(again.factors) == set(first.factors)
    for k in first.factors:
        np.testing.assert_array_equal(np.asarray(again.factors[k]), np.asarray(first.factors[k]))
    assert smoothquant_for_run(None, engine_quantization="int8_per_channel", **kw) is None
    from portable_rl.errors import ConfigError

    with pytest.raises(ConfigError, match="this engine serves 'fp8_per_channel'; set QUANTIZATION = 'int8_per_channel'"):
        smoothquant_for_run(0.5, engine_quantization="fp8_per_channel", **kw)
    loaded = Smoothing.load(str(tmp_path / SMOOTHQUANT_FILE))
    assert set(loaded.transforms) == set(first.transforms)
