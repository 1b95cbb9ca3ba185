"""sync/quantized_changed_frac and sync/update_lost_frac (rl/update_survival.py) on a tiny model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.model import Transformer
from portable_rl.learner_jax.quantize import served_fp8_per_channel
from portable_rl.rl.update_survival import UpdateSurvival

CONFIG = ModelConfig(family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _model(seed=0, on_bf16_grid=True):
    """A float32 model; `on_bf16_grid`: every weight a bf16 value, as when loaded from a bf16 checkpoint."""
    model = Transformer(CONFIG, compute_dtype=jnp.float32, rngs=nnx.Rngs(seed))
    if on_bf16_grid:
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), state))
    return model


def _moved(model, scale, seed=1):
    """Every parameter w -> w + scale * |w| * N(0, 1): a relative update of size `scale`."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jnp.abs(x) * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@pytest.mark.parametrize("quantization", [None, "fp8_per_channel"])
def test_same_weights_zero_large_update_survives_tiny_update_lost(quantization):
    model = _model()
    tracker = UpdateSurvival(CONFIG, quantization, channel_stride=1)
    assert tracker.measure(model) == {}  # the first push has nothing to compare with
    same = tracker.measure(model)
    assert same["sync/quantized_changed_frac"] == 0.0 and same["sync/update_lost_frac"] == 0.0
    assert same["sync/bf16_changed_frac"] == 0.0 and same["sync/cumulative_update_lost_frac"] == 0.0

    large = tracker.measure(_moved(model, 0.5))          # 50 % of each weight: far above any ulp
    assert large["sync/quantized_changed_frac"] > 0.95
    assert abs(large["sync/update_lost_frac"]) < (0.01 if quantization is None else 0.05)

    tracker.measure(model)
    tiny = tracker.measure(_moved(model, 1e-4))          # 0.01 %: far below half a bf16 ulp (0.2-0.4 %)
    assert tiny["sync/bf16_changed_frac"] < 0.01 and tiny["sync/quantized_changed_frac"] < 0.01
    assert tiny["sync/update_lost_frac"] > 0.95          # from the bf16 grid none of it reaches the engine
    if quantization is None:  # a bf16 engine serves the bf16 stage: the same numbers under both names
        assert tiny["sync/quantized_changed_frac"] == tiny["sync/bf16_changed_frac"]


def test_small_steps_add_up_and_mid_cell_weights_deliver_on_average():
    """Masters keep what rounding drops: repeated sub-ulp steps in one direction cross the boundary."""
    model = _model()
    tracker = UpdateSurvival(CONFIG, None, channel_stride=1)
    tracker.measure(model)
    graphdef, state = nnx.split(model)
    step = jax.tree.map(lambda x: 3e-4 * jnp.abs(x), state)  # 0.03 % up, every step
    per_step = []
    for k in range(1, 31):
        per_step.append(tracker.measure(nnx.merge(graphdef, jax.tree.map(lambda x, d: x + k * d, state, step))))
    assert per_step[0]["sync/update_lost_frac"] > 0.95          # the first small step is lost ...
    assert per_step[-1]["sync/cumulative_update_lost_frac"] < 0.5  # ... 30 of them (~1 ulp) mostly arrive
    assert max(r["sync/quantized_changed_frac"] for r in per_step) > 0.02
    # Weights off the grid (an fp32 run's weights after some training): the same tiny step, delivered on average.
    off_grid = UpdateSurvival(CONFIG, None, channel_stride=1)
    fp32_model = _model(on_bf16_grid=False)
    off_grid.measure(fp32_model)
    got = off_grid.measure(_moved(fp32_model, 1e-3))
    assert abs(got["sync/update_lost_frac"]) < 0.5 and got["sync/bf16_changed_frac"] > 0.01


def test_channel_subset_tracks_the_same_fractions():
    import dataclasses

    config = dataclasses.replace(CONFIG, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                                 num_key_value_heads=4, head_dim=32)
    graphdef, state = nnx.split(Transformer(config, compute_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), state))
    moved = _moved(model, 2e-3)
    full, sub = UpdateSurvival(config, "fp8_per_channel", channel_stride=1), UpdateSurvival(config, "fp8_per_channel")
    assert sub.stride == 16  # the default
    for t in (full, sub):
        t.measure(model)
    a, b = full.measure(moved), sub.measure(moved)
    assert 0.05 < a["sync/quantized_changed_frac"] < 0.95  # a partly surviving update, so the check means something
    for k in a:
        assert abs(a[k] - b[k]) < 0.05, (k, a[k], b[k])


def test_unmodelled_scheme_reports_the_bf16_stage_only():
    model = _model()
    tracker = UpdateSurvival(CONFIG, "fp8_blockwise")
    assert "fp8_blockwise" in tracker.note
    tracker.measure(model)
    got = tracker.measure(_moved(model, 0.5))
    assert set(got) == {"sync/bf16_changed_frac", "sync/bf16_update_lost_frac"}  # no sync/quantized_* guess
    with pytest.raises(ValueError, match="update_survival_stride=0"):
        UpdateSurvival(CONFIG, None, channel_stride=0)


def test_fp8_per_channel_is_vllms_formula():
    torch = pytest.importorskip("torch")
    fp8 = pytest.importorskip("vllm.model_executor.layers.quantization.online.fp8")
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax

    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (48, 24)).astype(np.float32)   # NNX kernel [in, out]
    w[:, 3] = 0.0                                           # an all-zero channel
    w[5, 7] = 3.0                                           # an outlier sets its channel's scale
    ours = np.asarray(served_fp8_per_channel(jnp.asarray(w)))
    weight = torch.from_numpy(w.T.copy()).to(torch.bfloat16)  # HF [out, in], as pushed
    scale = fp8._fp8_channel_scale(weight_amax(weight, dim=-1, keepdim=True))
    theirs = (fp8._fp8_quant_per_channel(weight, scale).float() * scale).numpy().T
    # The same e4m3 value and scale for every entry, to the last bit (jitted too: XLA must not turn the
    # divisions into multiplications by a reciprocal).
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(np.asarray(jax.jit(served_fp8_per_channel)(jnp.asarray(w))), theirs)
    assert (ours[:, 3] == 0).all() and ours[5, 7] == pytest.approx(3.0, rel=1e-6)
    # bf16 weights put many quotients on an e4m3 midpoint (e.g. 84 between 80 and 88): ties, decided alike.
    w = rng.normal(0, 0.02, (512, 256)).astype(np.float32)
    weight = torch.from_numpy(w.T.copy()).to(torch.bfloat16)
    scale = fp8._fp8_channel_scale(weight_amax(weight, dim=-1, keepdim=True))
    theirs = (fp8._fp8_quant_per_channel(weight, scale).float() * scale).numpy().T
    np.testing.assert_array_equal(np.asarray(jax.jit(served_fp8_per_channel)(jnp.asarray(w))), theirs)


def test_a_resumed_tracker_reports_what_an_uninterrupted_one_does():
    """train.py sets W_0 from the starting checkpoint before a resume restores the run's weights."""
    start = _model()
    later, latest = _moved(start, 0.01, seed=2), _moved(_moved(start, 0.01, seed=2), 0.01, seed=3)
    uninterrupted = UpdateSurvival(CONFIG, "fp8_per_channel", channel_stride=1)
    uninterrupted.measure(start)
    uninterrupted.measure(later)
    want = uninterrupted.measure(latest)
    resumed = UpdateSurvival(CONFIG, "fp8_per_channel", channel_stride=1)
    resumed.reference(start)               # the starting checkpoint, before the restore
    assert resumed.measure(later) == {}    # the resume push: nothing to compare with yet
    assert resumed.measure(latest) == want
    assert want["sync/cumulative_update_lost_frac"] != want["sync/update_lost_frac"]  # W_0 is not the last push


def test_bf16_params_are_measured_through_the_optimizers_masters():
    """bf16 params with fp32 masters (optim.with_master_weights): the params are already rounded, so W is the
    masters; read from the params, a sub-ulp update would look delivered (Δ = Δ_q) when none of it is."""
    from portable_rl.learner_jax.optim import make_optimizer, with_master_weights
    from portable_rl.rl.update_survival import learner_weights

    model = Transformer(CONFIG, param_dtype=jnp.bfloat16, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, with_master_weights(make_optimizer(learning_rate=1e-7, warmup_steps=0,
                                                                        weight_decay=0.0)), wrt=nnx.Param)
    assert learner_weights(model, optimizer) is optimizer.opt_state.master
    plain = Transformer(CONFIG, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert learner_weights(plain, nnx.Optimizer(plain, make_optimizer(learning_rate=1e-6), wrt=nnx.Param)) is plain

    tracker, params_only = UpdateSurvival(CONFIG, None, channel_stride=1), UpdateSurvival(CONFIG, None, channel_stride=1)
    tracker.measure(learner_weights(model, optimizer))
    params_only.measure(model)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    optimizer.update(model, grads)  # Adam's first step moves every weight by ~lr: far below half a bf16 ulp
    got, wrong = tracker.measure(learner_weights(model, optimizer)), params_only.measure(model)
    assert got["sync/bf16_changed_frac"] < 0.05 and got["sync/update_lost_frac"] > 0.9
    assert wrong["sync/update_lost_frac"] == 0.0  # Δ = 0 on the params: the misreading the masters avoid


MOE_CONFIG = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.mark.parametrize("quantization", ["fp8_per_channel", "int8_per_channel"])
def test_moe_experts_are_tracked_and_the_router_is_not(quantization):
    """The stacked experts [E, in, out] are tracked like the dense projections (per-channel, per expert); a
    step that moves only the router reaches no tracked weight."""
    from portable_rl.convert.hf import get_param
    from portable_rl.rl.update_survival import projection_paths

    paths = projection_paths(MOE_CONFIG)
    assert ("layers", 0, "mlp", "experts", "gate_proj") in paths and len(paths) == len(set(paths)) == 2 * (4 + 3)
    assert not any("router" in p for p in paths)
    model = Transformer(MOE_CONFIG, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    tracker = UpdateSurvival(MOE_CONFIG, quantization, channel_stride=1)
    tracker.measure(model)
    graphdef, state = nnx.split(model)

    def moved(select):  # +50 % on the selected parameters only
        return nnx.merge(graphdef, nnx.map_state(lambda path, x: x * 1.5 if select(path) else x, state))

    router_only = tracker.measure(moved(lambda path: "router" in path))
    assert router_only["sync/quantized_changed_frac"] == 0.0 and router_only["sync/bf16_changed_frac"] == 0.0
    tracker.measure(model)
    experts_only = tracker.measure(moved(lambda path: "experts" in path))
    sizes = {p: get_param(model, p)[...].size for p in paths}
    experts = sum(n for p, n in sizes.items() if "experts" in p)
    # the served expert weights moved (all but int8's zeros, whose channel scale moved with them), nothing else
    share = experts / sum(sizes.values())
    assert 0.95 * share < experts_only["sync/quantized_changed_frac"] <= share * (1 + 1e-6)
    assert experts_only["sync/update_lost_frac"] < 0.05
