"""mismatch/* (rl/mismatch_split.py) without an engine: the quantizer emulation, the split's arithmetic, staleness
and the followers' forwards, on a tiny random model and a scripted engine (tests/test_mismatch_split_vllm.py
has the real engines)."""

import copy
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from portable_rl import tis
from portable_rl.convert.hf import get_param
from portable_rl.convert.mapping import param_mappings
from portable_rl.engines.base import Rollout
from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.model import Transformer
from portable_rl.rl.dapo import dapo_config
from portable_rl.rl.learner import Learner
from portable_rl.rl.diagnostics import MismatchSplitDiagnostic, ProbeDiagnostic, probe_rows
from portable_rl.rl.sync import Serving
from portable_rl.rl.mismatch_split import quantized_learner, with_quantized_projections
from portable_rl.rl.multihost import Processes
from portable_rl.learner_jax.quantize import served_fp8_per_channel
from portable_rl.rl.served_view import projection_paths
from perturb import perturbed

CONFIG = ModelConfig(family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 20, 21, 22, 23, 24]]
RESPONSES = [[30, 31, 32, 33, 34], [40, 41, 42], [50, 51, 52, 53]]
PROBE = dict(temperature=1.0, max_tokens=8, pad_id=0)


def make_learner(param_dtype=jnp.float32):
    model = Transformer(CONFIG, param_dtype=param_dtype, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    cfg = dapo_config(prompt_batch_size=3, mini_batch_size=3, n_samples=2, max_response_tokens=8, temperature=1.0)
    return Learner(model, nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param), cfg,
                   tis.RolloutCorrectionConfig(mode="none"))


def diagnostics(engine, learner, *, split=True, staleness=False, procs=Processes(), quantization=None):
    """The probe and (with `split`) the mismatch split after it, as the step builds them (rl/diagnostics.py);
    `quantization`: what the driver's engine serves (a follower has no engine)."""
    probe = ProbeDiagnostic(engine=engine, learner=learner, prompts=PROMPTS, **PROBE, procs=procs)
    serving = Serving(engine.quantization if engine is not None else quantization)
    return [probe] + ([MismatchSplitDiagnostic(probe=probe, serving=serving, staleness=staleness)] if split else [])


def after_push(hooks) -> dict:
    return {k: v for hook in hooks for k, v in hook.after_push().items()}


def learner_logprobs(learner):
    """Per response, `learner`'s logprobs of RESPONSES (what the probe's reference computes)."""
    rows, spans = probe_rows(PROMPTS, RESPONSES, 0)
    logp = np.asarray(learner.logprobs(rows["input_ids"], rows["attention_mask"]))
    return [logp[i, s:s + n].tolist() for i, (s, n) in enumerate(spans)]


class ScriptedEngine:
    """Answers every probe with RESPONSES and the logprobs `score()` returns; reports `quantization`."""

    def __init__(self, quantization, score):
        self.quantization, self.score = quantization, score

    def generate(self, prompts, sampling):
        assert [list(p) for p in prompts] == PROMPTS
        return [Rollout(i, list(p), list(r), list(lp), "length")
                for i, (p, r, lp) in enumerate(zip(PROMPTS, RESPONSES, self.score()))]


def noisy(logprobs, scale, seed):
    rng = np.random.default_rng(seed)
    return [(np.asarray(s) + scale * rng.standard_normal(len(s))).tolist() for s in logprobs]


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_quantized_copy_has_fp8_projections_and_shares_the_rest(param_dtype):
    learner = make_learner(param_dtype)
    model = learner.model
    before = jax.tree.map(np.asarray, nnx.state(model))
    copy = with_quantized_projections(model, "fp8_per_channel")
    paths = set(projection_paths(CONFIG))
    assert len(paths) == 7 * CONFIG.num_hidden_layers
    for m in param_mappings(CONFIG):
        original, quantized = get_param(model, m.nnx_path)[...], get_param(copy, m.nnx_path)[...]
        assert quantized.dtype == original.dtype and quantized.shape == original.shape
        if m.nnx_path in paths:  # the exact formula (update_survival.served_fp8_per_channel, checked vs vLLM)
            np.testing.assert_array_equal(np.asarray(quantized),
                                          np.asarray(served_fp8_per_channel(original).astype(original.dtype)))
            # per output channel (column): amax / 448 scale; every value a multiple of an e4m3 value of it
            b = np.asarray(original.astype(jnp.bfloat16).astype(jnp.float32))
            scale = np.abs(b).max(axis=0) / 448.0
            units = np.asarray(quantized, np.float32) / scale
            assert np.all(np.abs(units) <= 448.0 * (1 + 2 ** -7))
            assert not np.array_equal(np.asarray(quantized, np.float32), np.asarray(original, np.float32))
        else:  # embeddings, norms, biases (lm_head is tied here): the learner's own array
            assert quantized is original
    after = jax.tree.map(np.asarray, nnx.state(model))
    jax.tree.map(np.testing.assert_array_equal, before, after)  # the learner's model is unchanged


def test_bf16_engine_is_all_kernels():
    learner = make_learner()
    own = learner_logprobs(learner)
    engine = ScriptedEngine(None, lambda: noisy(own, 0.01, seed=0))
    m = after_push(diagnostics(engine, learner))
    assert m["mismatch/quantization"] == 0.0 and m["mismatch/quantization_max_abs_diff"] == 0.0
    assert m["mismatch/kernels"] == m["probe/kl"] > 0 and m["mismatch/interaction"] == 0.0
    assert m["mismatch/kernels_max_abs_diff"] == m["probe/max_abs_diff"]
    assert "mismatch/staleness" not in m


def test_engine_serving_quantized_weights_is_all_quantization():
    learner = make_learner()
    served = learner_logprobs(quantized_learner(learner, "fp8_per_channel"))  # what an exact fp8 engine returns
    m = after_push(diagnostics(ScriptedEngine("fp8_per_channel", lambda: served), learner))
    assert m["mismatch/kernels"] == 0.0 and m["mismatch/kernels_max_abs_diff"] == 0.0
    assert m["mismatch/quantization"] == pytest.approx(m["probe/kl"], rel=1e-12) and m["probe/kl"] > 0


def test_parts_add_up_to_probe_kl():
    learner = make_learner()
    served = learner_logprobs(quantized_learner(learner, "fp8_per_channel"))
    engine = ScriptedEngine("fp8_per_channel", lambda: noisy(served, 0.02, seed=1))
    m = after_push(diagnostics(engine, learner))
    parts = m["mismatch/quantization"] + m["mismatch/kernels"] + m["mismatch/interaction"]
    assert m["mismatch/quantization"] > 0 and m["mismatch/kernels"] > 0
    assert parts == pytest.approx(m["probe/kl"], rel=1e-9, abs=1e-15)


def test_unmodelled_scheme_reports_probe_only_and_warns():
    learner = make_learner()
    own = learner_logprobs(learner)
    with pytest.warns(UserWarning, match="not modelled"):
        m = after_push(diagnostics(ScriptedEngine("fp8", lambda: own), learner))
    assert "probe/kl" in m and not any(k.startswith("mismatch/") for k in m)
    assert "mismatch/quantization" not in after_push(diagnostics(ScriptedEngine(None, lambda: own), learner, split=False))


def test_staleness_is_the_previous_probe_rescored():
    learner = make_learner()
    engine = ScriptedEngine(None, lambda: learner_logprobs(learner))
    hooks = diagnostics(engine, learner, staleness=True)
    first = after_push(hooks)
    assert "mismatch/staleness" not in first  # nothing to compare with yet
    same = after_push(hooks)
    assert same["mismatch/staleness"] == 0.0  # no update between the probes
    learner.model = perturbed(learner.model, seed=1, scale=0.05)  # an update θ_{k−1} → θ_k
    moved = after_push(hooks)
    assert moved["mismatch/staleness"] > 1e-4
    synchronous = diagnostics(engine, learner)
    after_push(synchronous)
    assert "mismatch/staleness" not in after_push(synchronous)


def test_quantized_learner_scores_the_quantized_copy():
    """The fused path (quantize inside the learner's jitted forward) = the learner on a quantized model copy."""
    learner = make_learner()
    rows, _ = probe_rows(PROMPTS, RESPONSES, 0)
    fused = quantized_learner(learner, "fp8_per_channel").logprobs(rows["input_ids"], rows["attention_mask"])
    on_copy = copy.copy(learner)
    on_copy.model = with_quantized_projections(learner.model, "fp8_per_channel")
    np.testing.assert_allclose(fused, on_copy.logprobs(rows["input_ids"], rows["attention_mask"]), rtol=0, atol=1e-6)
    assert not np.allclose(fused, learner.logprobs(rows["input_ids"], rows["attention_mask"]), rtol=0, atol=1e-6)


def test_served_view_of_a_smoothed_int8_push_is_its_weights():
    """With SmoothQuant factors the served view scores the smoothed, int8-quantized weights the push sends."""
    import torch

    from portable_rl.convert.mapping import param_mappings
    from portable_rl.convert.smoothing import calibrate
    from portable_rl.convert.to_torch import iter_hf_tensors

    learner = make_learner()
    rows, _ = probe_rows(PROMPTS, RESPONSES, 0)
    smoothing = calibrate(learner.model, PROMPTS)
    served = quantized_learner(learner, "int8_per_channel", smoothing.factors).logprobs(
        rows["input_ids"], rows["attention_mask"])
    pushed = dict(iter_hf_tensors(learner.model, CONFIG, quantization="int8_per_channel", smoothing=smoothing))
    on_copy = copy.copy(learner)
    on_copy.model = copy.deepcopy(learner.model)
    for m in param_mappings(CONFIG):  # the pushed tensors, dequantized, as the copy's parameters
        t = pushed[m.hf_name].float()
        if pushed[m.hf_name].dtype == torch.int8:
            t = t * pushed[m.hf_name.removesuffix("weight") + "weight_scale"]
        get_param(on_copy.model, m.nnx_path)[...] = jnp.asarray((t.T if m.transpose else t).numpy())
    np.testing.assert_allclose(served, on_copy.logprobs(rows["input_ids"], rows["attention_mask"]), rtol=0,
                               atol=2e-3)  # the push also rounds norms and embeddings to bf16
    plain = quantized_learner(learner, "int8_per_channel").logprobs(rows["input_ids"], rows["attention_mask"])
    assert not np.allclose(served, plain, rtol=0, atol=1e-5)  # the factors change what is served


def test_async_forwards_in_one_call_equal_the_two_separate_ones():
    """Async mode runs the quantized forward and staleness's in one call (rows of different widths stacked):
    each part equals its own separate call."""
    from portable_rl.rl.mismatch_split import extra_forwards, scoring_learner

    learner = make_learner()
    rows, _ = probe_rows(PROMPTS, RESPONSES, 0)
    previous, _ = probe_rows(PROMPTS[:2], [r + [3, 4, 5] for r in RESPONSES[:2]], 0)
    assert previous["input_ids"].shape[1] != rows["input_ids"].shape[1] or len(previous["input_ids"]) != len(rows["input_ids"])
    message = dict(rows, mismatch={"quantizer": "fp8_per_channel", "previous_rows": previous})
    got = extra_forwards(learner, message)
    want_q = quantized_learner(learner, "fp8_per_channel").logprobs(rows["input_ids"], rows["attention_mask"])
    want_c = scoring_learner(learner).logprobs(previous["input_ids"], previous["attention_mask"])
    np.testing.assert_allclose(got["quantized"], want_q, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got["current_on_previous"], want_c, rtol=0, atol=1e-6)


def count_logprobs(monkeypatch):
    """Every `Learner.logprobs` call (its rows' shape, and whether a `scoring_learner` makes it) into a list."""
    calls, original = [], Learner.logprobs

    def counted(self, input_ids, attention_mask):
        calls.append((np.shape(input_ids), getattr(self._logprobs, "__name__", "") == "forward_of_state"))
        return original(self, input_ids, attention_mask)

    monkeypatch.setattr(Learner, "logprobs", counted)
    return calls


@pytest.mark.parametrize("quantization", [None, "fp8_per_channel", "fp8"])
def test_followers_run_the_drivers_forwards(quantization, monkeypatch):
    """Multihost invariant: a follower, given the driver's broadcast, runs the same learner forwards."""
    learner = make_learner()
    own = learner_logprobs(learner)
    sent = []  # what the driver broadcast, in order; the follower receives it in the same order

    class Driver:
        is_driver, multiple = True, True

        def broadcast(self, tree=None):
            sent.append(tree)
            return tree

    class Follower:
        is_driver, multiple = False, True

        def broadcast(self, tree=None):
            return sent.pop(0)

    driver = diagnostics(ScriptedEngine(quantization, lambda: own), learner, staleness=True, procs=Driver())
    follower = diagnostics(None, learner, staleness=True, procs=Follower(), quantization=quantization)
    calls = count_logprobs(monkeypatch)
    for _ in range(2):  # the second probe has staleness's forward too
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "fp8": not modelled (tested above)
            after_push(driver)
        driver_calls, calls[:] = list(calls), []
        assert after_push(follower) == {}
        assert calls == driver_calls and not sent
        calls.clear()
    # the probe, then one wrapped call: staleness's forward, and with a modelled quantizer the quantized one too
    assert [q for _, q in driver_calls] == [False, True]


@pytest.mark.parametrize("quantization", ["fp8_per_channel", "int8_per_channel"])
def test_moe_experts_are_served_quantized_and_routers_are_not(quantization):
    """A tiny Qwen3-MoE: the quantized copy holds Q(W) for every stacked expert array (per expert and output
    channel: the same as quantizing each expert alone) and the learner's own routers; the split's quantized
    forward moves the logprobs."""
    from portable_rl.learner_jax.quantize import SERVED_WEIGHTS

    config = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    model = Transformer(config, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    copy = with_quantized_projections(model, quantization)
    served = SERVED_WEIGHTS[quantization]
    experts = [p for p in projection_paths(config) if "experts" in p]
    assert len(experts) == 3 * config.num_hidden_layers
    for path in experts:
        w, q = get_param(model, path)[...], np.asarray(get_param(copy, path)[...])
        assert w.shape == (config.num_experts,) + w.shape[1:] and not np.array_equal(q, np.asarray(w))
        for e in range(config.num_experts):
            np.testing.assert_array_equal(q[e], np.asarray(served(w[e])))
    for i in range(config.num_hidden_layers):
        router = ("layers", i, "mlp", "router", "kernel")
        assert get_param(copy, router)[...] is get_param(model, router)[...]
    ids = jnp.asarray([[1, 5, 6, 7, 30, 31]], jnp.int32)
    assert not np.allclose(np.asarray(model(ids)), np.asarray(copy(ids)))
