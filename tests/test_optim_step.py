"""Learning-rate schedules, AdamW + clipping composition, weight-decay mask, and the jitted train step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.logprobs import sequence_logprobs
from portable_rl.learner_jax.model import Transformer
from portable_rl.learner_jax.optim import make_optimizer, make_schedule, with_master_weights
from portable_rl.learner_jax.step import make_train_step

TINY = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def test_constant_schedule_with_warmup():
    lr = make_schedule(1e-3, warmup_steps=4, schedule="constant")
    got = [float(lr(s)) for s in range(7)]
    np.testing.assert_allclose(got, [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3, 1e-3], rtol=1e-6)
    assert float(make_schedule(1e-3, warmup_steps=0)(0)) == pytest.approx(1e-3)


def test_cosine_schedule_decays_to_zero():
    lr = make_schedule(1.0, warmup_steps=2, total_steps=12, schedule="cosine")
    assert float(lr(0)) == pytest.approx(0.5)
    assert float(lr(2)) == pytest.approx(1.0)
    assert float(lr(7)) == pytest.approx(0.5, abs=1e-6)   # halfway through the decay
    assert float(lr(12)) == pytest.approx(0.0, abs=1e-7)
    assert float(lr(100)) == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="total_steps"):
        make_schedule(1.0, schedule="cosine")
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule(1.0, schedule="linear")


def test_optimizer_is_clip_then_adamw():
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    grads = {"w": jnp.full((2, 3), 3.0), "b": jnp.full((3,), -4.0)}
    ours = make_optimizer(learning_rate=0.1, weight_decay=0.01, max_grad_norm=1.0)
    mask = {"w": True, "b": False}
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.1, weight_decay=0.01, mask=mask))
    s1, s2 = ours.init(params), ref.init(params)
    for _ in range(3):
        u1, s1 = ours.update(grads, s1, params)
        u2, s2 = ref.update(grads, s2, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), u1, u2)


def test_weight_decay_skips_norms_and_biases():
    model = Transformer(TINY, rngs=nnx.Rngs(0))
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    optimizer = nnx.Optimizer(model, make_optimizer(learning_rate=0.1, weight_decay=0.5), wrt=nnx.Param)
    nnx.jit(lambda m, o: o.update(m, jax.tree.map(jnp.zeros_like, nnx.state(m, nnx.Param))))(model, optimizer)
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert jnp.array_equal(after["final_norm"]["scale"], before["final_norm"]["scale"])
    assert jnp.array_equal(after["layers"][0]["attn"]["q_norm"]["scale"], before["layers"][0]["attn"]["q_norm"]["scale"])
    np.testing.assert_allclose(after["embed"]["embedding"], before["embed"]["embedding"] * (1 - 0.1 * 0.5), rtol=1e-6)


def test_train_step_reduces_loss_and_reports_lr_and_grad_norm():
    model = Transformer(TINY, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    schedule = make_schedule(3e-3, warmup_steps=3, total_steps=20, schedule="cosine")
    optimizer = nnx.Optimizer(model, make_optimizer(learning_rate=3e-3, warmup_steps=3, total_steps=20,
                                                    schedule="cosine"), wrt=nnx.Param)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 64, size=(4, 10)), jnp.int32)
    batch = {"ids": ids, "mask": jnp.ones_like(ids)}

    def loss_fn(model, batch):  # maximise the likelihood of a fixed batch
        logp, entropy = sequence_logprobs(model, batch["ids"], batch["mask"], 1.0)
        return -logp[:, 1:].mean(), {"entropy": entropy[:, 1:].mean()}

    @nnx.jit
    def grad_norm(model):
        return optax.tree.norm(nnx.grad(lambda m: loss_fn(m, batch)[0])(model))

    step = make_train_step(loss_fn)
    expected_norm = float(grad_norm(model))
    history = []
    for s in range(8):
        metrics = step(model, optimizer, batch)
        assert set(metrics) == {"loss", "entropy", "grad_norm", "learning_rate"}
        assert float(metrics["learning_rate"]) == pytest.approx(float(schedule(s)), rel=1e-6)
        if s == 0:
            assert float(metrics["grad_norm"]) == pytest.approx(expected_norm, rel=1e-4)
        history.append(float(metrics["loss"]))
    assert int(optimizer.step[...]) == 8
    assert history[-1] < history[0] - 0.1
    assert all(b < a for a, b in zip(history, history[1:]))


def test_remat_gives_the_same_gradients():
    ids = jnp.asarray(np.random.RandomState(1).randint(0, 64, size=(2, 6)), jnp.int32)

    @nnx.jit
    def grads(model):
        return nnx.grad(lambda m: sequence_logprobs(m, ids, None, 1.0)[0].sum())(model)

    plain = Transformer(TINY, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    remat = Transformer(TINY, compute_dtype=jnp.float32, rngs=nnx.Rngs(0), remat="full")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5),
                 nnx.to_pure_dict(grads(plain)), nnx.to_pure_dict(grads(remat)))

    def grad_jaxpr(model):
        graphdef, state = nnx.split(model)
        return str(jax.make_jaxpr(jax.grad(lambda s: sequence_logprobs(nnx.merge(graphdef, s), ids)[0].sum()))(state))

    # remat='full': the backward holds the layer's recomputation (jax.checkpoint).
    # That it really lowers the compiled memory is tests/test_remat.py.
    assert remat.remat == "full" and plain.remat == "none"
    assert "remat" in grad_jaxpr(remat) and "remat" not in grad_jaxpr(plain)


def _adam_trajectory(tx, params, grads_seq):
    state = tx.init(params)
    for g in grads_seq:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_master_weights_follow_the_f32_trajectory_and_params_are_its_bf16_rounding():
    rng = np.random.default_rng(0)
    w32 = {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)}
    w32 = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), w32)   # same start on both sides
    # One bf16-representable gradient, 100 times: both optimizers see identical inputs, and each AdamW step
    # (≈ lr = 1e-4) is below half a bf16 ulp for most weights (|w| > 0.06), while 100 of them are not.
    grads = [{"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.bfloat16)}] * 100
    tx = make_optimizer(learning_rate=1e-4, max_grad_norm=None)

    ref, _ = _adam_trajectory(tx, w32, [jax.tree.map(lambda g: g.astype(jnp.float32), g) for g in grads])
    mixed, state = _adam_trajectory(with_master_weights(tx), jax.tree.map(lambda x: x.astype(jnp.bfloat16), w32),
                                    grads)
    assert mixed["w"].dtype == jnp.bfloat16 and state.master["w"].dtype == jnp.float32
    np.testing.assert_allclose(state.master["w"], ref["w"], rtol=0, atol=1e-7)
    np.testing.assert_array_equal(mixed["w"], ref["w"].astype(jnp.bfloat16))   # bit for bit
    # Plain AdamW on bf16 params drops every step smaller than half an ulp (most of them at |w| ~ 1);
    # with the master, the bf16 params are off the f32 trajectory by one final rounding only.
    plain, _ = _adam_trajectory(tx, jax.tree.map(lambda x: x.astype(jnp.bfloat16), w32), grads)
    plain_err = float(jnp.abs(plain["w"].astype(jnp.float32) - ref["w"]).mean())
    mixed_err = float(jnp.abs(mixed["w"].astype(jnp.float32) - ref["w"]).mean())
    assert plain_err > 3 * mixed_err, (plain_err, mixed_err)


def test_bf16_model_with_master_weights_trains_and_reports_lr():
    config = ModelConfig(family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = Transformer(config, param_dtype=jnp.bfloat16, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, with_master_weights(make_optimizer(learning_rate=3e-3)), wrt=nnx.Param)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (4, 10)), jnp.int32)

    def loss_fn(m, batch):
        logp, _ = sequence_logprobs(m, batch, jnp.ones_like(batch), 1.0)
        return -logp[:, 1:].mean(), {}

    step = make_train_step(loss_fn)
    losses = [float(step(model, optimizer, ids)["loss"]) for _ in range(15)]
    metrics = step(model, optimizer, ids)
    assert losses[-1] < losses[0] - 0.1
    assert float(metrics["learning_rate"]) == pytest.approx(3e-3) and metrics["grad_norm"].dtype == jnp.float32
    master = optimizer.opt_state.master
    for param, m in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(master)):
        assert param.dtype == jnp.bfloat16 and m.dtype == jnp.float32
        np.testing.assert_array_equal(param, m.astype(jnp.bfloat16))


def test_train_step_donates_params_but_never_a_dlpack_exported_buffer():
    """make_train_step updates params and moments in place (the old buffers are donated), and a
    param still viewed by torch through DLPack is left intact: the view keeps the pre-step values."""
    import torch

    from portable_rl.learner_jax.step import make_train_step

    cfg = ModelConfig(family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = Transformer(cfg, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_optimizer(learning_rate=1e-2), wrt=nnx.Param)
    ids = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 64

    def loss_fn(model, batch):
        return jnp.mean(model(batch) ** 2), {}

    step = make_train_step(loss_fn)
    step(model, optimizer, ids)                                   # compile; moments now exist
    up = model.layers[0].mlp.up_proj.kernel[...]
    exported = model.layers[0].mlp.down_proj.kernel[...]
    view = torch.from_dlpack(exported)
    before = view.clone()
    step(model, optimizer, ids)
    assert up.is_deleted()                                        # donated: updated in place
    assert not exported.is_deleted()                              # held by torch: copied, not donated
    assert torch.equal(view, before)                              # the view still reads the old values
    new = np.asarray(model.layers[0].mlp.down_proj.kernel[...])
    assert not np.array_equal(new, before.numpy())                # while the model moved on


def test_read_only_steps_return_no_copy_of_the_params():
    """The gradient step adds ∇loss into the donated accumulator in place and returns only its metrics; the
    learner's forward returns only logprobs. nnx.jit's default would also return the params (a copy on every
    call) and, for the gradient step, the accumulator a second time (learner_jax/step.py)."""
    from portable_rl.learner_jax.step import make_grad_step, zero_grads
    from portable_rl.rl.learner import _jitted, _LossSettings
    from portable_rl import tis

    model = Transformer(TINY, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 8)), jnp.int32)
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids)}

    def loss_fn(m, b):
        logp, _ = sequence_logprobs(m, b["input_ids"], b["attention_mask"])
        return -logp.mean(), {}

    params_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    grads = zero_grads(model)
    grad_step = make_grad_step(loss_fn)
    memory = grad_step.lower(model, batch, grads).compile().memory_analysis()
    assert memory.alias_size_in_bytes == params_bytes                           # the f32 accumulator, in place
    assert memory.output_size_in_bytes - memory.alias_size_in_bytes < 1024       # + the scalar metrics

    # accumulating twice gives twice the gradient
    grad_step(model, batch, grads)
    grad_step(model, batch, grads)
    want = nnx.grad(lambda m: loss_fn(m, batch)[0])(model)
    for got, one in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), 2 * np.asarray(one), rtol=1e-5, atol=1e-7)

    settings = _LossSettings(0.2, 0.28, None, "decoupled")
    fns = _jitted(settings, 1.0, None, tis.RolloutCorrectionConfig(mode="token", clip=2.0))
    memory = fns["logprobs"].lower(model, ids, jnp.ones_like(ids)).compile().memory_analysis()
    assert memory.output_size_in_bytes == ids.size * 4                          # [B, T] f32 logprobs only


def _adam_moments(state):
    """(mu, nu) of the optax AdamW state inside `state` (under inject_hyperparams, the chain, the master)."""
    adam = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
    assert len(adam) == 1
    return adam[0].mu, adam[0].nu


def test_bf16_first_moment_is_stored_in_bf16_and_follows_the_f32_trajectory():
    rng = np.random.default_rng(0)
    w0 = {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.bfloat16)}
    grads = [{"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.bfloat16)} for _ in range(20)]
    kw = dict(learning_rate=1e-2, weight_decay=0.1, max_grad_norm=None)
    f32 = with_master_weights(make_optimizer(**kw))
    bf16 = with_master_weights(make_optimizer(**kw, moment1_dtype="bfloat16"))   # composes with the master
    _, ref = _adam_trajectory(f32, w0, grads)
    _, got = _adam_trajectory(bf16, w0, grads)
    (mu_ref, nu_ref), (mu, nu) = _adam_moments(ref), _adam_moments(got)
    assert mu_ref["w"].dtype == jnp.float32 and mu["w"].dtype == jnp.bfloat16
    assert nu["w"].dtype == jnp.float32 and got.master["w"].dtype == jnp.float32
    # mu within bf16 roundings of the f32 one (~1% in norm here; a mu never updated is off by 100%); nu is f32
    # on both sides and sees the same gradients.
    rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))  # noqa: E731
    assert rel(mu["w"], mu_ref["w"]) < 3e-2 and rel(nu["w"], nu_ref["w"]) < 1e-3
    # The master's 20-step movement (~0.05 per weight) matches to 2%: a mu never updated (zero steps) or
    # one not decayed would be off by ~100%.
    moved = jnp.abs(ref.master["w"] - w0["w"].astype(jnp.float32)).mean()
    off = jnp.abs(got.master["w"] - ref.master["w"]).mean()
    assert moved > 0.03 and off < 0.02 * moved, (float(moved), float(off))


def test_moment1_dtype_rejects_unknown_dtypes():
    with pytest.raises(ValueError, match="moment1_dtype='bf16'.*'bfloat16'"):
        make_optimizer(learning_rate=1e-3, moment1_dtype="bf16")


@pytest.mark.parametrize("param_dtype, master, moment1_dtype", [(jnp.float32, False, None), (jnp.bfloat16, True, None),
                                                                (jnp.bfloat16, True, "bfloat16"),
                                                                (jnp.bfloat16, False, None)])
def test_update_by_layer_equals_the_whole_tree_update(param_dtype, master, moment1_dtype):
    """MemoryConfig.update_by_layer: the per-layer update (one layer's temporaries at a time) is the whole
    tree's, to rounding, over steps that clip (norm above max_grad_norm) and steps that do not; the reported
    grad_norm is the f32 gradient's in both, bf16 params without a master copy included."""
    from portable_rl.learner_jax.step import make_apply_step
    config = dataclasses.replace(TINY, num_hidden_layers=2)

    def build():
        model = Transformer(config, param_dtype=param_dtype, rngs=nnx.Rngs(0))
        tx = make_optimizer(learning_rate=1e-2, warmup_steps=2, weight_decay=0.1, max_grad_norm=1.0,
                            moment1_dtype=moment1_dtype)
        return model, nnx.Optimizer(model, with_master_weights(tx) if master else tx, wrt=nnx.Param)

    arms = {False: (*build(), make_apply_step()), True: (*build(), make_apply_step(by_layer=True))}
    params = jax.tree.map(jnp.copy, nnx.state(arms[False][0], nnx.Param))  # a snapshot: the steps donate
    for step, scale in enumerate([10.0, 0.01, 3.0]):  # global norms ~40, ~0.04, ~12 against max 1.0
        keys = iter(jax.random.split(jax.random.key(step), len(jax.tree.leaves(params))))
        grads = jax.tree.map(lambda p: scale * jax.random.normal(next(keys), p.shape, jnp.float32), params)
        metrics = {by_layer: apply_step(model, optimizer, jax.tree.map(jnp.copy, grads))
                   for by_layer, (model, optimizer, apply_step) in arms.items()}
        assert float(metrics[True]["grad_norm"]) == float(metrics[False]["grad_norm"])
        assert float(metrics[True]["learning_rate"]) == float(metrics[False]["learning_rate"])
        for whole, by_layer in zip(jax.tree.leaves(nnx.state(arms[False][:2])), jax.tree.leaves(nnx.state(arms[True][:2])),
                                   strict=True):
            assert whole.dtype == by_layer.dtype and whole.shape == by_layer.shape
            # XLA fuses a group's elementwise ops apart from the others', so an op may round differently:
            # measured, the embedding, head and final norm differ by < 1 eps of the leaf's largest value, the
            # decoder layers not at all. The bound is 2 eps of the stored dtype (bf16 params: one rounding).
            eps = float(jnp.finfo(whole.dtype).eps) if jnp.issubdtype(whole.dtype, jnp.floating) else 0.0
            whole, by_layer = np.asarray(whole, np.float32), np.asarray(by_layer, np.float32)
            assert np.abs(whole - by_layer).max(initial=0.0) <= 2 * eps * np.abs(whole).max(initial=0.0)
    moved = jax.tree.leaves(nnx.state(arms[True][0], nnx.Param))
    assert any(not jnp.array_equal(a, b) for a, b in zip(moved, jax.tree.leaves(params)))


def test_update_by_layer_needs_make_optimizers_optimizer():
    from portable_rl.learner_jax.step import make_apply_step
    model = Transformer(TINY, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    grads = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    with pytest.raises(ValueError, match="make_optimizer; set update_by_layer=False"):
        make_apply_step(by_layer=True)(model, optimizer, grads)
