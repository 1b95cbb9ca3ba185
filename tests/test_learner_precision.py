"""rl.PrecisionConfig.learner_precision = 'engine' (rl/learner.py `serve_weights_as`, rl/served_view.py): the
learner's forwards use the weights the engine serves, with straight-through gradients to the masters."""

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from portable_rl import gin_utils, tis
from portable_rl.errors import ConfigError
from portable_rl.learner_jax.model import Transformer
from portable_rl.learner_jax.step import zero_grads
from portable_rl.rl.config import PrecisionConfig
from portable_rl.rl.diagnostics import probe_rows
from portable_rl.rl.learner import Learner
from portable_rl.rl.mismatch_split import MismatchSplit, extra_forwards, quantized_learner, with_quantized_projections
from portable_rl.rl.dapo import dapo_config
from test_micro_batches import ragged_batch
from test_mismatch_split import CONFIG, PROMPTS, RESPONSES

QUANTIZERS = ["fp8_per_channel", "int8_per_channel", "fake_mxfp4", "fake_nvfp4", "fake_fp8_e4m3_tensor"]


def make_learner(model=None):
    model = model or Transformer(CONFIG, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    cfg = dapo_config(prompt_batch_size=3, mini_batch_size=3, n_samples=4, max_response_tokens=32, temperature=1.0)
    return Learner(model, nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param), cfg,
                   tis.RolloutCorrectionConfig(mode="none"))


@pytest.mark.parametrize("quantization", QUANTIZERS)
def test_engine_learner_scores_as_the_quantized_learner(quantization):
    learner = make_learner()
    rows, _ = probe_rows(PROMPTS, RESPONSES, 0)
    master = learner.logprobs(rows["input_ids"], rows["attention_mask"])
    want = quantized_learner(learner, quantization).logprobs(rows["input_ids"], rows["attention_mask"])
    learner.serve_weights_as(quantization)
    got = learner.logprobs(rows["input_ids"], rows["attention_mask"])
    np.testing.assert_array_equal(got, want)
    assert np.abs(got - master).max() > 1e-5  # the quantizer does change the forward
    # the mismatch split runs no second quantized forward for it: q = a, so mismatch/quantization is 0 exactly
    plan = MismatchSplit().plan(quantization)
    assert extra_forwards(learner, {**rows, "mismatch": plan}) == {}


@pytest.mark.parametrize("quantization", ["fp8_per_channel", "int8_per_channel", "fake_mxfp4"])  # the form is scheme-free
def test_straight_through_gradient_is_the_gradient_at_the_served_weights(quantization):
    """∇ of the 'engine' learner's loss w.r.t. the masters W == ∇ of the unquantized forward w.r.t. its kernels,
    evaluated at Q(W); the old logprobs of both agree too."""
    batch = ragged_batch(n=12, seed=1)
    engine = make_learner()
    engine.serve_weights_as(quantization)
    at_served = make_learner(with_quantized_projections(engine.model, quantization))
    prepared, want_prepared = engine.prepare(batch), at_served.prepare(batch)
    np.testing.assert_allclose(prepared.old_logprobs, want_prepared.old_logprobs, rtol=0, atol=1e-6)
    mb, want_mb = prepared.micro_batches[0][0], want_prepared.micro_batches[0][0]
    grads, want = zero_grads(engine.model), zero_grads(at_served.model)
    engine._grad_step(engine.model, mb, grads)
    at_served._grad_step(at_served.model, want_mb, want)
    for (path, g), (want_path, w) in zip(jax.tree_util.tree_leaves_with_path(grads),
                                         jax.tree_util.tree_leaves_with_path(want)):
        assert path == want_path
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7, err_msg=str(path))
    # not the masters' gradient: the quantizer moved the point where it is taken
    master = make_learner(engine.model)
    master_grads = zero_grads(master.model)
    master._grad_step(master.model, master.prepare(batch).micro_batches[0][0], master_grads)
    leaves = lambda t: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(t)}
    served, own = leaves(grads), leaves(master_grads)
    kernels = [k for k in served if "proj" in k and "kernel" in k]
    assert len(kernels) == 7 * CONFIG.num_hidden_layers, kernels
    assert max(np.abs(served[k] - own[k]).max() / np.abs(own[k]).max() for k in kernels) > 1e-3


def test_master_is_the_default_and_unchanged():
    learner = make_learner()
    assert PrecisionConfig().learner_precision == "master" and not learner.serves_engine_weights


@pytest.mark.parametrize("scheme", ["fake_int4", "fp8", "w4a16"])
def test_unknown_scheme_is_a_one_line_error(scheme):
    learner = make_learner()
    with pytest.raises(ConfigError) as err:
        learner.serve_weights_as(scheme)
    message = str(err.value)
    assert "\n" not in message and scheme in message
    assert "'fp8_per_channel'" in message and "'int8_per_channel'" in message
    assert not learner.serves_engine_weights


def test_config_validates_the_knob():
    with pytest.raises(ConfigError, match="learner_precision='fp8'"):
        PrecisionConfig(learner_precision="fp8")
    with pytest.raises(ConfigError, match="SmoothQuant"):
        PrecisionConfig(learner_precision="engine", smoothquant_alpha=0.5)
    with pytest.raises(ConfigError, match="SmoothQuant"):
        make_learner().serve_weights_as("int8_per_channel", smoothing=object())


def test_gin_binds_learner_precision():
    gin_utils.register_library()
    try:
        with gin.unlock_config():
            gin.clear_config()
            gin.parse_config(["rl.PrecisionConfig.learner_precision = 'engine'"])
        cfg = gin.get_configurable("rl.PrecisionConfig")()
    finally:
        gin.clear_config()
    assert cfg == PrecisionConfig(learner_precision="engine")
