"""Sharded learner (learner_jax/sharding.py): mesh sizes, logical rules, and one sharded RL step.

The 8-device checks need `XLA_FLAGS=--xla_force_host_platform_device_count=8` before JAX starts, and
this pytest process has already started JAX, so they run in a subprocess that prints JSON.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec as P

from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.model import Transformer
from portable_rl.learner_jax.sharding import (MESH_AXES, MeshConfig, gather_for_export, logical_to_spec, mesh_shape,
                                              param_logical_axes, shard_batch, state_shardings)


def test_mesh_shape_fills_one_axis_and_rejects_bad_sizes():
    assert mesh_shape(MeshConfig(), 8) == (1, 8, 1, 1)
    assert mesh_shape(MeshConfig(data=2, fsdp=-1, tensor=2), 8) == (2, 2, 1, 2)
    assert mesh_shape(MeshConfig(data=2, fsdp=4, tensor=1), 8) == (2, 4, 1, 1)
    assert mesh_shape(MeshConfig(fsdp=2, expert=-1), 8) == (1, 2, 4, 1)
    with pytest.raises(ValueError, match="do not divide the 8 devices"):
        mesh_shape(MeshConfig(data=3, fsdp=-1), 8)
    with pytest.raises(ValueError, match="needs data\\*fsdp\\*expert\\*tensor = 4 devices but there are 8"):
        mesh_shape(MeshConfig(data=2, fsdp=2, tensor=1), 8)
    with pytest.raises(ValueError, match="at most one axis"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="positive ints or -1"):
        MeshConfig(tensor=0)


def test_logical_to_spec_replicates_dims_that_do_not_divide():
    mesh = AbstractMesh((2, 2, 1, 2), MESH_AXES)
    assert logical_to_spec(("embed", "mlp"), (64, 128), mesh) == P("fsdp", "tensor")
    assert logical_to_spec(("vocab", "embed"), (125, 64), mesh) == P(None, "fsdp")   # odd vocab
    assert logical_to_spec(("batch", None), (8, 16), mesh) == P(("data", "fsdp"), None)
    assert logical_to_spec(("batch",), (6,), mesh) == P(None)                        # 6 % 4 != 0
    assert logical_to_spec(("norm",), (64,), mesh) == P(None)
    # A mesh axis splits one dimension at most: the second "tensor" user is replicated.
    assert logical_to_spec(("heads", "mlp"), (64, 64), mesh) == P("tensor", None)
    with pytest.raises(KeyError, match="no sharding rule"):
        logical_to_spec(("nope",), (4,), mesh)


def test_shard_batch_rejects_rows_that_do_not_split_and_export_keeps_single_device_arrays():
    with pytest.raises(ValueError, match="6 rows, not a multiple of the 4 batch shards"):
        shard_batch({"input_ids": np.zeros((6, 3), np.int32), "num_rows": 6}, AbstractMesh((2, 2, 1, 2), MESH_AXES))
    x = jnp.ones((4, 4), jnp.bfloat16)
    assert gather_for_export(x) is x   # the unsharded weight push stays zero-copy


@pytest.mark.parametrize("family,extra", [("qwen2", {}), ("qwen3", {"attention_bias": True}),
                                          ("llama", {"tie_word_embeddings": True}),
                                          ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=32, mlp_only_layers=(1,),
                                                             shared_expert_intermediate_size=64))])
def test_every_parameter_has_a_rule(family, extra):
    cfg = ModelConfig(family=family, vocab_size=125, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, **extra)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        dotted = ".".join(map(str, path))
        assert param_logical_axes(dotted, len(var.shape)) is not None, dotted
    # Optimizer moments mirror the parameter paths under a prefix and get the same spec.
    assert param_logical_axes("opt_state.inner_state.1.0.mu.layers.1.mlp.down_proj.kernel", 2) == ("mlp", "embed")
    assert param_logical_axes("opt_state.count", 0) is None
    specs = state_shardings(nnx.state(model, nnx.Param), AbstractMesh((1, 4, 1, 2), MESH_AXES))
    q = specs["layers"][0]["attn"]["q_proj"]["kernel"]
    assert jax.tree.leaves(q)[0].spec == P("fsdp", "tensor")


# ------------------------------------------------------------------------------ 8 host devices
SCRIPT = textwrap.dedent(r'''
    import json
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from portable_rl import tis
    from portable_rl.convert.to_torch import iter_hf_tensors
    from portable_rl.learner_jax.config import ModelConfig
    from portable_rl.learner_jax.model import Transformer
    from portable_rl.learner_jax.optim import make_optimizer
    from portable_rl.learner_jax.sharding import MeshConfig, make_mesh
    from portable_rl.rl.dapo import dapo_config
    from portable_rl.rl.batching import pack_rollouts
    from portable_rl.rl.learner import Learner

    assert len(jax.devices()) == 8, jax.devices()
    # qwen3 with all biases, q/k norms and an untied lm_head; vocab 125 is odd (replicated on "tensor").
    CFG = ModelConfig(family="qwen3", vocab_size=125, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True)
    ALG = dapo_config(prompt_batch_size=2, mini_batch_size=2, n_samples=4)      # one update of 8 rows
    CORR = tis.RolloutCorrectionConfig(mode="token", clip=2.0)

    def make_batch():  # 8 sequences of 8-16 tokens (4 prompt tokens), one per row: [8, 16]
        rng = np.random.default_rng(0)
        B, T, prompt = 8, 16, 4
        lengths = rng.integers(8, T + 1, B)
        ids = rng.integers(0, 125, (B, T))
        logp = (-2.0 + 0.3 * rng.standard_normal((B, T))).astype(np.float32)
        return pack_rollouts([ids[i, :prompt].tolist() for i in range(B)],
                             [ids[i, prompt:lengths[i]].tolist() for i in range(B)],
                             [logp[i, prompt:lengths[i]].tolist() for i in range(B)], rng.standard_normal(B),
                             min_len=T)

    def export(model, dtype):
        return {n: t.float().numpy().copy() for n, t in iter_hf_tensors(model, CFG, dtype=dtype)}

    def run(mesh_cfg):
        model = Transformer(CFG, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
        # eps=1e-3 keeps AdamW's first step lr·g/(|g|+eps) smooth in g (the default 1e-8 makes it ~lr·sign(g),
        # which turns fp32 reduction-order noise in near-zero gradients into lr-sized differences).
        tx = make_optimizer(learning_rate=1e-3, weight_decay=0.01, eps=1e-3)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        mesh = make_mesh(mesh_cfg) if mesh_cfg else None
        learner = Learner(model, optimizer, ALG, CORR, mesh=mesh)
        params_before = {"/".join(map(str, p)): np.asarray(v[...])
                         for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        out = {"export_before": export(model, "bfloat16")}
        kernel = model.layers[0].mlp.gate_proj.kernel[...]
        out["spec_before"] = str(kernel.sharding.spec) if mesh else None
        out["replicated"] = bool(kernel.sharding.is_fully_replicated)
        before = kernel.sharding
        out["embed_spec"] = str(model.embed.embedding[...].sharding.spec) if mesh else None
        opt_leaves = jax.tree.leaves(nnx.state(optimizer))
        out["opt_sharded"] = sum(not x.sharding.is_fully_replicated for x in opt_leaves)
        batch = make_batch()
        if mesh:  # 5 rows: padded to a multiple of the batch shards inside Learner.logprobs
            out["probe_logprobs"] = learner.logprobs(batch["input_ids"][:5], batch["attention_mask"][:5])
        # pre-update, on the learner's micro-batches (prepare defers ALG's one mini-batch's to its update)
        out["old_logprobs"] = learner.old_logprobs(batch)
        prepared = learner.prepare(batch)
        out["tis"] = {k: v for k, v in prepared.metrics.items() if k.startswith("tis/")}
        out["metrics"] = learner.update(prepared)
        out["same_sharding_after"] = model.layers[0].mlp.gate_proj.kernel[...].sharding.is_equivalent_to(before, 2)
        out["params_after"] = {"/".join(map(str, p)): np.asarray(v[...])
                               for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        out["params_before"] = params_before
        return out

    base = run(None)
    result = {}
    for name, mc in {"2x4x1": MeshConfig(data=2, fsdp=4, tensor=1),
                     "2x2x2": MeshConfig(data=2, fsdp=2, tensor=-1)}.items():
        got = run(mc)
        diff = lambda k: max(float(np.max(np.abs(got[k][n] - base[k][n]))) for n in base[k])
        result[name] = dict(
            spec_before=got["spec_before"], same_sharding_after=got["same_sharding_after"],
            embed_spec=got["embed_spec"],
            replicated=got["replicated"], opt_sharded=got["opt_sharded"],
            export_before_max_diff=diff("export_before"), params_after_max_diff=diff("params_after"),
            params_moved=max(float(np.max(np.abs(got["params_after"][n] - got["params_before"][n])))
                             for n in base["params_after"]),
            old_logprobs_max_diff=float(np.max(np.abs(got["old_logprobs"] - base["old_logprobs"]))),
            # old_logprobs = logprobs · response_mask (pre-update); the probe: unmasked, 5 rows, pre-update
            probe_max_diff=float(np.max(np.abs(got["probe_logprobs"] * make_batch()["response_mask"][:5]
                                               - base["old_logprobs"][:5]))),
            probe_shape=list(got["probe_logprobs"].shape),
            metrics={k: (got["metrics"][k], base["metrics"][k]) for k in base["metrics"]},
            tis={k: (got["tis"][k], base["tis"][k]) for k in base["tis"]})
    # An unsharded checkpoint restored into a sharded learner lands on the learner's shardings.
    import tempfile
    from portable_rl.learner_jax.checkpoint import Checkpointer
    saved = Transformer(CFG, rngs=nnx.Rngs(0))
    with Checkpointer(tempfile.mkdtemp()) as ckpt:
        ckpt.save(1, saved, nnx.Optimizer(saved, make_optimizer(learning_rate=1e-3), wrt=nnx.Param))
        model = Transformer(CFG, rngs=nnx.Rngs(1))
        optimizer = nnx.Optimizer(model, make_optimizer(learning_rate=1e-3), wrt=nnx.Param)
        Learner(model, optimizer, ALG, CORR, mesh=make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
        ckpt.restore(model, optimizer)
    kernel = model.layers[0].mlp.down_proj.kernel[...]
    result["restore"] = dict(spec=str(kernel.sharding.spec),
                             equal=bool(np.array_equal(kernel, saved.layers[0].mlp.down_proj.kernel[...])))
    print("RESULT " + json.dumps(result))
''')


@pytest.fixture(scope="module")
def sharded_run():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.slow  # ~45 s of CPU: three compilations of the RL step (1 device, two 8-device meshes)
@pytest.mark.parametrize("mesh", ["2x4x1", "2x2x2"])
def test_sharded_step_matches_single_device(sharded_run, mesh):
    r = sharded_run[mesh]
    # Params (and AdamW moments) really are split, and the step keeps their sharding.
    assert not r["replicated"] and r["same_sharding_after"]
    assert r["spec_before"] == {"2x4x1": "P('fsdp', None)", "2x2x2": "P('fsdp', 'tensor')"}[mesh]
    assert r["opt_sharded"] >= 2 * (7 + 2)          # mu and nu of the 7 layer matrices, embedding, lm_head
    if mesh == "2x2x2":                             # odd vocab: replicated on "tensor", split on "fsdp"
        assert r["embed_spec"] == "P(None, 'fsdp')"
    # Export of freshly sharded params is bit-identical to the unsharded export.
    assert r["export_before_max_diff"] == 0.0
    # One RL step (old logprobs, rollout correction, clipped-PPO loss, AdamW) equals the single-device one.
    assert r["old_logprobs_max_diff"] < 1e-5 and r["probe_max_diff"] < 1e-5 and r["probe_shape"] == [5, 16]
    for k, (got, want) in {**r["metrics"], **r["tis"]}.items():
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6), k
    assert r["params_moved"] > 5e-4                 # the step changed the weights (lr 1e-3, Adam ~ lr·sign)
    assert r["params_after_max_diff"] < 1e-6, r["params_after_max_diff"]


@pytest.mark.slow
def test_unsharded_checkpoint_restores_onto_the_sharded_learner(sharded_run):
    assert sharded_run["restore"] == {"spec": "P('tensor', 'fsdp')", "equal": True}
