"""The Flax decoder reproduces transformers' forward pass (qwen2, qwen3, llama), padding never
changes a logit, jit == eager, and the logprob functions follow the one definition."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from portable_rl.convert import load_hf_model
from portable_rl.learner_jax.logprobs import sequence_logprobs, token_logprobs
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

B, T = 2, 24
# qwen2 is tied; qwen3/llama untied; llama uses llama3 RoPE scaling, llama_plain plain RoPE;
# qwen3_bias has q/k/v/o biases.
VARIANTS = ["qwen2", "qwen3", "llama", "llama_plain", "qwen3_bias"]


def _make(path, variant, dtype):
    if variant == "llama_plain":
        make_tiny_checkpoint(path, "llama", dtype=dtype)
        cfg = json.loads((path / "config.json").read_text())
        cfg["rope_parameters"] = {"rope_theta": 10_000.0, "rope_type": "default"}
        (path / "config.json").write_text(json.dumps(cfg))
    elif variant == "qwen3_bias":
        make_tiny_checkpoint(path, "qwen3", dtype=dtype, attention_bias=True)
    else:
        make_tiny_checkpoint(path, variant, dtype=dtype)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """variant -> float32 checkpoint directory, each built once per module."""
    cache = {}

    def get(variant):
        if variant not in cache:
            cache[variant] = _make(tmp_path_factory.mktemp(variant), variant, "float32")
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def ids():
    return np.random.RandomState(0).randint(3, 98, size=(B, T)).astype(np.int32)


# One compiled forward per (model structure, input shape); eager JAX compiles every op separately.
forward = nnx.jit(lambda model, input_ids, mask=None: model(input_ids, mask))


def torch_logits(path, ids, dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.float().numpy()


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_logits_match_transformers(variant, ckpts, ids):
    ckpt = ckpts(variant)
    model, _ = load_hf_model(ckpt, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    ours = np.asarray(forward(model, jnp.asarray(ids)))
    ref = torch_logits(ckpt, ids, torch.float32)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4


@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "llama"])
def test_bf16_logits_match_transformers_bf16(variant, ckpts, ids):
    """Both sides bf16 params + bf16 compute (a like-for-like comparison)."""
    ckpt = ckpts(variant)
    model, _ = load_hf_model(ckpt, param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    ours = np.asarray(forward(model, jnp.asarray(ids)))
    ref = torch_logits(ckpt, ids, torch.bfloat16)
    assert ours.dtype == np.float32
    assert np.abs(ours - ref).max() <= 2e-2


@pytest.mark.parametrize("variant", ["qwen2", "llama"])
def test_padding_left_and_right_does_not_change_logits(variant, ckpts):
    path = ckpts(variant)
    model, _ = load_hf_model(path, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    rng = np.random.RandomState(1)
    lengths, width = [7, 12, 9], 15
    full = rng.randint(3, 98, size=(len(lengths), width)).astype(np.int32)
    # Causal attention: the first n logits of an unpadded row are those of its n-token prefix alone.
    unpadded = np.asarray(forward(model, jnp.asarray(full), jnp.ones_like(full)))
    for side in ("left", "right"):
        ids = np.zeros_like(full)
        mask = np.zeros_like(full)
        for i, n in enumerate(lengths):
            sl = slice(width - n, width) if side == "left" else slice(0, n)
            ids[i, sl], mask[i, sl] = full[i, :n], 1
        padded = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))
        assert np.isfinite(padded).all()
        for i, n in enumerate(lengths):
            got = padded[i][mask[i].astype(bool)]
            np.testing.assert_allclose(got, unpadded[i, :n], atol=2e-5, rtol=0,
                                       err_msg=f"{side} padding, row {i}")


@pytest.mark.parametrize("variant", ["qwen3_bias"])
def test_jit_equals_eager(variant, ckpts, ids):
    # float32 compute: in bf16, XLA fusion legitimately skips intermediate bf16 roundings.
    model, _ = load_hf_model(ckpts(variant),
                             param_dtype=jnp.float32, compute_dtype=jnp.float32)
    mask = jnp.ones((B, T), jnp.int32).at[0, :5].set(0)
    eager = model(jnp.asarray(ids), mask)
    jitted = forward(model, jnp.asarray(ids), mask)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_torch_log_softmax(temperature):
    rng = np.random.RandomState(2)
    logits = (3 * rng.randn(3, 5, 50)).astype(np.float32)
    targets = rng.randint(0, 50, size=(3, 5))
    logp, entropy = token_logprobs(jnp.asarray(logits), jnp.asarray(targets), temperature)
    ref_all = torch.log_softmax(torch.from_numpy(logits) / temperature, dim=-1)
    ref = ref_all.gather(-1, torch.from_numpy(targets)[..., None])[..., 0].numpy()
    ref_entropy = -(ref_all.exp() * ref_all).sum(-1).numpy()
    assert logp.dtype == jnp.float32 and entropy.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logp), ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(entropy), ref_entropy, atol=1e-5, rtol=0)


def test_token_logprobs_upcast_bf16_logits():
    logits = jnp.asarray(np.random.RandomState(3).randn(2, 3, 40), jnp.bfloat16)
    logp, entropy = token_logprobs(logits, jnp.zeros((2, 3), jnp.int32), 0.7)
    ref = jax.nn.log_softmax(logits.astype(jnp.float32) / 0.7)[..., 0]
    assert logp.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logp), np.asarray(ref), atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sequence_logprobs_match_transformers(ckpts, temperature):
    path = ckpts("qwen3")
    model, _ = load_hf_model(path, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    ids = np.random.RandomState(4).randint(3, 98, size=(2, 10)).astype(np.int32)
    mask = np.ones_like(ids).copy()
    mask[1, 7:] = 0  # right padding
    logp, entropy = nnx.jit(sequence_logprobs)(model, jnp.asarray(ids), jnp.asarray(mask),
                                                jnp.float32(temperature))
    ref_logits = torch.from_numpy(torch_logits(path, ids, torch.float32)) / temperature
    ref = torch.log_softmax(ref_logits[:, :-1], -1).gather(-1, torch.from_numpy(ids[:, 1:]).long()[..., None])[..., 0]
    assert logp.shape == (2, 10) and entropy.shape == (2, 10)
    assert float(logp[0, 0]) == 0.0 and float(entropy[0, 0]) == 0.0
    valid = mask[:, 1:].astype(bool)
    np.testing.assert_allclose(np.asarray(logp)[:, 1:][valid], ref.numpy()[valid], atol=1e-4, rtol=0)
    assert (np.asarray(entropy)[:, 1:] > 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_custom_gradient_equals_autodiff(temperature):
    """The fused custom VJP of token_logprobs equals autodiff of its forward formula, for both outputs
    (logp and entropy cotangents together, as an entropy bonus would produce)."""
    from portable_rl.learner_jax.logprobs import _token_logprobs_fwd

    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    logits = 4.0 * jax.random.normal(keys[0], (3, 6, 40))
    targets = jax.random.randint(keys[1], (3, 6), 0, 40)
    g_logp, g_ent = jax.random.normal(keys[2], (3, 6)), jax.random.normal(keys[3], (3, 6))

    def grad_of(fn):
        def f(logits):
            logp, ent = fn(logits, targets, temperature)
            return jnp.sum(logp * g_logp + ent * g_ent)
        return jax.jit(jax.grad(f))(logits)

    got = grad_of(token_logprobs)
    want = grad_of(lambda *a: _token_logprobs_fwd(*a)[0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
