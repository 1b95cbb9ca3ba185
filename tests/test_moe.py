"""Qwen3-MoE and Qwen2-MoE in the learner: transformers parity (logits, per-token logprobs, router logits,
load-balancing loss), gradients of the sorted ragged_dot dispatch against the dense all-experts reference,
routing replay, HF export / re-load, orbax checkpoints, and the one-line errors."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from portable_rl.convert import load_hf_model, save_hf_model
from portable_rl.convert.mapping import param_mappings
from portable_rl.convert.to_torch import iter_hf_tensors
from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.logprobs import sequence_logprobs
from portable_rl.learner_jax.model import Transformer
from portable_rl.learner_jax.moe import Experts, load_balancing_loss
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

B, T = 2, 16
DIMS = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            vocab_size=128)
# Odd shapes: 6 experts, top-3, moe_intermediate_size 13; norm_topk_prob on and off; Qwen2-MoE's shared
# expert; dense layers among the sparse ones (mlp_only_layers, decoder_sparse_step).
VARIANTS = {
    "qwen3_moe_norm": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=13,
                                         norm_topk_prob=True)),
    "qwen3_moe_nonorm_step2": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=13,
                                                 norm_topk_prob=False, num_hidden_layers=3, decoder_sparse_step=2)),
    "qwen2_moe_shared": ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=13,
                                           shared_expert_intermediate_size=21, norm_topk_prob=False)),
    "qwen2_moe_shared_norm_mlp_only": ("qwen2_moe", dict(num_experts=5, num_experts_per_tok=2,
                                                         moe_intermediate_size=11, norm_topk_prob=True,
                                                         shared_expert_intermediate_size=21, num_hidden_layers=3,
                                                         mlp_only_layers=[1])),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cache = {}

    def get(variant):
        if variant not in cache:
            family, kw = VARIANTS[variant]
            path = tmp_path_factory.mktemp(variant)
            make_tiny_checkpoint(path, family, dtype="float32", **{**DIMS, **kw})
            cache[variant] = path
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def ids():
    return np.random.RandomState(0).randint(3, 98, size=(B, T)).astype(np.int32)


def hf_model(path):
    # The eager experts loop: transformers' default grouped_mm needs 16-byte-aligned strides (odd widths fail).
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             experts_implementation="eager").eval()


def fp32_model(path):
    return load_hf_model(path, param_dtype=jnp.float32, compute_dtype=jnp.float32)


logprobs_fn = nnx.jit(lambda model, ids, mask: sequence_logprobs(model, ids, mask)[0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_logprobs_and_router_logits_match_transformers(variant, ckpts, ids):
    path = ckpts(variant)
    model, config = fp32_model(path)
    assert config.to_hf_dict() == json.loads((path / "config.json").read_text())
    mask = np.ones_like(ids)
    mask[1, 11:] = 0
    ours = np.asarray(logprobs_fn(model, jnp.asarray(ids), jnp.asarray(mask)))
    with torch.no_grad():
        out = hf_model(path)(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                             output_router_logits=True)
    ref = torch.log_softmax(out.logits[:, :-1], -1).gather(-1, torch.from_numpy(ids[:, 1:]).long()[..., None])[..., 0]
    valid = mask[:, 1:].astype(bool)
    err = np.abs(ours[:, 1:][valid] - ref.numpy()[valid]).max()
    assert err <= 1e-5, err
    # Router logits of every sparse layer (what a load-balancing loss sees), and that loss itself.
    hidden, routing = nnx.jit(lambda m, x, mask: m.hidden_states(x, mask, return_routing=True))(
        model, jnp.asarray(ids), jnp.asarray(mask))
    sparse = [i for i in range(config.num_hidden_layers) if config.is_sparse_layer(i)]
    assert routing.logits.shape == (len(sparse), B * T, config.num_experts)
    assert routing.experts.shape == (len(sparse), B * T, config.num_experts_per_tok)
    hf_router = torch.stack(out.router_logits)  # sparse layers only, in order
    real = mask.reshape(-1).astype(bool)  # padded positions see other keys and positions in transformers
    np.testing.assert_allclose(np.asarray(routing.logits)[:, real], hf_router.numpy()[:, real], atol=1e-5, rtol=0)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    hf_aux = load_balancing_loss_func(tuple(hf_router), config.num_experts, config.num_experts_per_tok,
                                      torch.from_numpy(mask).long())
    aux = load_balancing_loss(routing.logits, config.num_experts_per_tok, jnp.asarray(mask).reshape(-1))
    np.testing.assert_allclose(float(aux), float(hf_aux), rtol=1e-5)


def _dense_experts(self, x, experts, weights):
    """The all-experts reference: every expert on every token, [N, E, D], mixed with the gate weights
    scattered to [N, E] (zero for unchosen experts)."""
    gate = jnp.einsum("nd,edf->nef", x, self.gate_proj[...])
    up = jnp.einsum("nd,edf->nef", x, self.up_proj[...])
    y = jnp.einsum("nef,efd->ned", jax.nn.silu(gate) * up, self.down_proj[...])     # [N, E, D]
    dense_weights = jnp.zeros(y.shape[:2], jnp.float32).at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
    return jnp.einsum("ne,ned->nd", dense_weights, y)


def assert_grads_close(got, want):
    """Every gradient equal up to fp32 summation-order noise, relative to its largest entry."""
    flat_got, flat_want = jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    for (path, g), w in zip(flat_got, flat_want):
        g, w = np.asarray(g), np.asarray(w)
        assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), jax.tree_util.keystr(path)


def _grads(model, ids, cotangent):
    def loss(model):
        return jnp.sum(sequence_logprobs(model, ids, None)[0] * cotangent)
    return nnx.to_pure_dict(nnx.jit(nnx.grad(loss))(model))


@pytest.mark.parametrize("variant", ["qwen3_moe_norm", "qwen2_moe_shared_norm_mlp_only"])
def test_grouped_dispatch_gradients_equal_dense_all_experts_reference(variant, ckpts, ids, monkeypatch):
    model, _ = fp32_model(ckpts(variant))
    cotangent = jnp.asarray(np.random.RandomState(1).randn(B, T), jnp.float32)
    got = _grads(model, jnp.asarray(ids), cotangent)
    monkeypatch.setattr(Experts, "__call__", _dense_experts)
    want = _grads(model, jnp.asarray(ids), cotangent)
    assert_grads_close(got, want)
    router = got["layers"][0]["mlp"]["router"]["kernel"]
    assert float(jnp.abs(router).max()) > 0  # the router learns through the gate weights


def test_forced_experts_equal_own_top_k_and_router_still_gets_gradients(ckpts, ids):
    model, config = fp32_model(ckpts("qwen2_moe_shared"))
    block = model.layers[0].mlp
    x = jnp.asarray(np.random.RandomState(2).randn(B, T, config.hidden_size), jnp.float32)
    y, routing = block(x)
    y_forced, routing_forced = block(x, routing.experts)
    np.testing.assert_array_equal(np.asarray(y_forced), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(routing_forced.experts), np.asarray(routing.experts))
    # Model level: [B, T, S, K] replayed experts (here the model's own) give the same hidden states.
    hidden, own = model.hidden_states(jnp.asarray(ids), return_routing=True)
    replay = jnp.transpose(own.experts, (1, 0, 2)).reshape(B, T, -1, config.num_experts_per_tok)
    np.testing.assert_array_equal(np.asarray(model.hidden_states(jnp.asarray(ids), routed_experts=replay)),
                                  np.asarray(hidden))
    # Other experts: a different output, the block still reports its own top-k, and the router gets a
    # gradient through softmax-over-all-experts gathered at the forced ones.
    forced = (routing.experts + 1) % config.num_experts
    y_other, routing_other = block(x, forced)
    assert not np.allclose(np.asarray(y_other), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(routing_other.experts), np.asarray(routing.experts))
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)
    grads = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(x, forced)[0]))(params)
    assert float(jnp.abs(grads["router"]["kernel"][...]).max()) > 0


def test_export_reload_and_push_names_are_per_expert(ckpts, ids, tmp_path):
    src = ckpts("qwen2_moe_shared")
    model, config = fp32_model(src)
    from safetensors.numpy import load_file
    original = load_file(str(src / "model.safetensors"))
    pushed = {name: t.float().numpy() for name, t in iter_hf_tensors(model, config, dtype="float32")}
    assert "model.layers.0.mlp.experts.5.down_proj.weight" in pushed
    assert set(pushed) == set(original) == {m.hf_name for m in param_mappings(config)}
    for name, value in original.items():
        np.testing.assert_array_equal(pushed[name], value, err_msg=name)
    out = save_hf_model(model, config, tmp_path / "out", dtype="float32", max_shard_bytes=20_000)  # sharded
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    reloaded, _ = fp32_model(out)
    for a, b in zip(jax.tree.leaves(nnx.state(reloaded, nnx.Param)), jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with torch.no_grad():
        ref = hf_model(src)(torch.from_numpy(ids).long()).logits.numpy()
        again = hf_model(out)(torch.from_numpy(ids).long()).logits.numpy()
    np.testing.assert_array_equal(again, ref)  # transformers loads what the learner saved


def test_orbax_checkpoint_round_trip(ckpts, tmp_path):
    from portable_rl.learner_jax.checkpoint import Checkpointer

    model, config = fp32_model(ckpts("qwen3_moe_norm"))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, model)
    fresh = Transformer(config, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(5))
    Checkpointer(tmp_path / "ckpt").restore(fresh)
    for a, b in zip(jax.tree.leaves(nnx.state(fresh, nnx.Param)), jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_remat_and_bf16_compute(ckpts, ids):
    path = ckpts("qwen3_moe_norm")
    cotangent = jnp.ones((B, T), jnp.float32)
    base = _grads(fp32_model(path)[0], jnp.asarray(ids), cotangent)
    remat, _ = load_hf_model(path, param_dtype=jnp.float32, compute_dtype=jnp.float32, remat="full")
    assert_grads_close(_grads(remat, jnp.asarray(ids), cotangent), base)
    bf16, _ = load_hf_model(path, param_dtype=jnp.float32, compute_dtype=jnp.bfloat16)
    grads = _grads(bf16, jnp.asarray(ids), cotangent)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    experts = grads["layers"][0]["mlp"]["experts"]["gate_proj"]
    assert experts.dtype == jnp.float32 and float(jnp.abs(experts).max()) > 0


def test_unknown_moe_family_and_bad_top_k_are_one_line_errors(ckpts):
    config = json.loads((ckpts("qwen3_moe_norm") / "config.json").read_text())
    with pytest.raises(ValueError, match=r"mixture-of-experts model_type 'mixtral' is not supported.*qwen3_moe"):
        ModelConfig.from_hf_dict({**config, "model_type": "mixtral"})
    with pytest.raises(ValueError, match="num_experts_per_tok=7 must be in 1..num_experts=6"):
        ModelConfig.from_hf_dict({**config, "num_experts_per_tok": 7})


def test_router_aux_loss_coef_adds_the_load_balancing_loss_to_the_rl_loss(ckpts, ids):
    from portable_rl.rl.config import LossConfig
    from portable_rl.rl.learner import make_loss_fn

    model, config = fp32_model(ckpts("qwen3_moe_norm"))
    rng = np.random.RandomState(3)
    response = np.ones((B, T), np.float32)
    response[:, :5] = 0                                                     # the prompt
    batch = {"input_ids": ids, "segment_ids": np.ones((B, T), np.int32),
             "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)), "old_logprobs": -response,
             "advantages": rng.randn(B, T).astype(np.float32), "response_mask": response,
             "keep_mask": np.ones((B, T), np.float32), "rollout_logprobs": -response,
             "tis_weights": np.ones((B, T), np.float32), "token_weights": response / response.sum()}
    batch = {k: jnp.asarray(v) for k, v in batch.items()}

    def loss_and_router_grad(coef):
        loss_fn = make_loss_fn(LossConfig(router_aux_loss_coef=coef), 1.0)
        (loss, sums), grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(model, batch)
        return float(loss), sums, grads["layers"][0]["mlp"]["router"]["kernel"][...]

    off, sums_off, router_off = loss_and_router_grad(0.0)
    on, sums_on, router_on = loss_and_router_grad(0.5)
    _, routing = model.hidden_states(batch["input_ids"], segment_ids=batch["segment_ids"],
                                     positions=batch["positions"], return_routing=True)
    aux = float(load_balancing_loss(routing.logits, config.num_experts_per_tok))
    assert "router_aux_loss" not in sums_off
    np.testing.assert_allclose(float(sums_on["router_aux_loss"] / sums_on["tokens"]), aux, rtol=1e-6)
    np.testing.assert_allclose(on - off, 0.5 * aux, rtol=1e-5)                 # token-mean: Σ ω = 1
    assert float(jnp.abs(router_on - router_off).max()) > 0


EXPERT_PARALLEL = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from portable_rl.convert import load_hf_model
    from portable_rl.errors import ConfigError
    from portable_rl.learner_jax.logprobs import sequence_logprobs
    from portable_rl.learner_jax.sharding import MeshConfig, make_mesh, shard_batch, shard_model_and_optimizer

    def load(path, dispatch="gspmd"):
        return load_hf_model(path, param_dtype=jnp.float32, compute_dtype=jnp.float32, moe_dispatch=dispatch)[0]

    def loss(model, input_ids, mask, w):
        logp = sequence_logprobs(model, input_ids, mask)[0]
        return jnp.sum(logp * w), logp

    step = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    rng = np.random.RandomState(0)
    batch = {"input_ids": rng.randint(3, 98, size=(8, 12)).astype(np.int32), "mask": np.ones((8, 12), np.int32),
             "w": rng.randn(8, 12).astype(np.float32)}
    batch["mask"][1, 9:] = 0
    (_, logp), grads = step(load(sys.argv[1]), *batch.values())
    grads = nnx.to_pure_dict(grads)
    out = {}
    meshes = {"fsdp8": MeshConfig(fsdp=8), "fsdp2_expert4": MeshConfig(fsdp=2, expert=4),
              "data2_expert2_tensor2": MeshConfig(data=2, expert=2, tensor=2)}
    runs = [("gspmd", "fsdp2_expert4"), ("gspmd", "data2_expert2_tensor2"),
            ("local", "fsdp8"), ("local", "fsdp2_expert4"), ("local", "data2_expert2_tensor2")]
    for dispatch, name in runs:
        model, mesh = load(sys.argv[1], dispatch), make_mesh(meshes[name])
        shard_model_and_optimizer(model, None, mesh)
        gate = model.layers[0].mlp.experts.gate_proj[...]
        with jax.set_mesh(mesh):
            (_, logp_s), grads_s = step(model, *shard_batch(batch, mesh).values())
        grads_s = nnx.to_pure_dict(grads_s)
        out[f"{dispatch}_{name}"] = {
            "expert_shard": list(gate.addressable_shards[0].data.shape), "spec": str(gate.sharding.spec),
            "logp": float(np.abs(np.asarray(logp_s) - np.asarray(logp)).max()),
            "grads": max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / (np.abs(np.asarray(b)).max() + 1e-30))
                         for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads)))}
    for dispatch in ("gspmd", "local"):
        model, mesh = load(sys.argv[2], dispatch), make_mesh(MeshConfig(fsdp=2, expert=4))  # 6 experts over 4
        shard_model_and_optimizer(model, None, mesh)
        try:
            with jax.set_mesh(mesh):
                step(model, *shard_batch(batch, mesh).values())
        except ConfigError as e:
            out[f"error_{dispatch}"] = str(e)
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow  # ~2 min of CPU: six compilations of a forward + backward, five on 8 host devices
def test_expert_parallel_equals_unsharded_on_8_devices(ckpts, tmp_path):
    """Both dispatches (`Experts`: GSPMD's, and each device's own rows in a shard_map with the expert weights
    all-gathered over fsdp inside) on meshes with fsdp, expert, data and tensor axes split the experts as
    sharding.py says and give the single-device logprobs and gradients to fp32 tolerance."""
    path = make_tiny_checkpoint(tmp_path / "e8", "qwen3_moe", dtype="float32",
                                **{**DIMS, "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 14,
                                   "norm_topk_prob": True})
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", EXPERT_PARALLEL, str(path), str(ckpts("qwen3_moe_norm"))],
                          env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    shards = {"fsdp8": [8, 32 // 8, 14], "fsdp2_expert4": [8 // 4, 32 // 2, 14],
              "data2_expert2_tensor2": [8 // 2, 32, 14 // 2]}                    # [E, D, F] per device
    for name, numbers in result.items():
        if name.startswith("error"):
            continue
        assert numbers["expert_shard"] == shards[name.split("_", 1)[1]], (name, numbers)
        assert numbers["logp"] <= 1e-5, (name, numbers)
        assert numbers["grads"] <= 1e-5, (name, numbers)
    assert len(result) == 7
    for dispatch in ("gspmd", "local"):
        assert result[f"error_{dispatch}"].startswith("the mesh's expert axis (4 devices) does not divide "
                                                      "num_experts=6"), result
