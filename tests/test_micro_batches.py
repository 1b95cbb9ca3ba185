"""Token-budget micro-batches with gradient accumulation (rl/learner.py, learner_jax/step.py): one optimizer
update over 64-token micro-batches equals the one-call update, for every loss aggregation and with tokens
rejected by the rollout correction; on a 2-device mesh too."""

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

from portable_rl import tis
from portable_rl.learner_jax.config import ModelConfig
from portable_rl.learner_jax.losses import AGGREGATIONS
from portable_rl.learner_jax.memory import MemoryConfig
from portable_rl.learner_jax.model import Transformer
from portable_rl.learner_jax.optim import make_optimizer
from portable_rl.rl.batching import MicroBatchBudgetError, pack_rollouts
from portable_rl.rl.dapo import dapo_config
from portable_rl.rl.learner import Learner

CFG = ModelConfig(family="qwen3", vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
# geometric TIS with IcePop token rejection (ratios of a random model against noisy rollout logprobs leave
# some tokens out) and a geometric sequence mask (rejects sequence 1, whose rollout logprobs are 3 nats high)
CORRECTION = tis.RolloutCorrectionConfig(mode="geometric", clip=2.0, token_mask_low=0.3, token_mask_high=3.0,
                                         geo_mask_low=0.2, geo_mask_high=5.0)


def ragged_batch(n=12, seed=0, rows_per_minibatch=12):
    """n sequences of 3-40 tokens (1-8 prompt tokens), one per row: the learner's per-sequence view."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 48, rng.integers(1, 9)).tolist() for _ in range(n)]
    responses = [rng.integers(1, 48, rng.integers(2, 33)).tolist() for _ in range(n)]
    logps = [(-np.log(48) + rng.standard_normal(len(r)) + 3.0 * (i == 1)).tolist() for i, r in enumerate(responses)]
    return pack_rollouts(prompts, responses, logps, rng.standard_normal(n), row_multiple=rows_per_minibatch)


# eps=1e-3: Adam's first step lr·g/(|g|+eps) stays smooth in g (eps=1e-8 is ~lr·sign(g), which turns fp32
# summation-order noise in near-zero gradients into lr-sized parameter differences). One transformation for
# every learner here: it is static in the jitted steps, so they compile once.
TX = make_optimizer(learning_rate=1e-2, eps=1e-3, weight_decay=0.01)


def run_update(memory, aggregation, batch, mesh=None):
    model = Transformer(CFG, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    alg = dapo_config(prompt_batch_size=3, mini_batch_size=3, n_samples=4, loss_aggregation=aggregation,
                     max_response_tokens=32)
    learner = Learner(model, optimizer, alg, CORRECTION, memory=memory, mesh=mesh)
    before = jax.tree.map(np.array, nnx.state(model, nnx.Param))
    prepared = learner.prepare(batch)
    metrics = learner.update(prepared)
    after = jax.tree.map(np.array, nnx.state(model, nnx.Param))
    return before, after, prepared, metrics


def assert_same_update(got, want, rel=1e-6):
    (before, after, _, _), (_, want_after, _, _) = got, want
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(want_after), jax.tree.leaves(before)))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(want_after)))
    scale = max(float(np.abs(a).max()) for a in jax.tree.leaves(want_after))
    assert moved > 1e-3, moved                         # the update did something
    assert diff <= rel * scale, (diff, scale)


@pytest.fixture(scope="module")
def batch():
    return ragged_batch()


@pytest.mark.slow  # 8 learners compiled (~40 s on 2 busy cores)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_give_the_one_call_update(aggregation, batch):
    one_call = run_update(MemoryConfig(pack_sequences=False), aggregation, batch)
    micro = run_update(MemoryConfig(max_tokens_per_micro_batch=64), aggregation, batch)
    prepared = micro[2]
    assert prepared.metrics["batch/micro_batches"] >= 3 and one_call[2].metrics["batch/micro_batches"] == 1
    assert all(mb["input_ids"].shape == (1, 64) for mb in prepared.micro_batches[0])   # one shape, one compile
    keep, mask = prepared.keep_mask, batch["response_mask"]
    # tokens AND a whole sequence rejected
    assert 0 < (keep * mask).sum() < mask.sum() and not (keep * mask).any(axis=1).all()
    np.testing.assert_allclose(prepared.old_logprobs, one_call[2].old_logprobs, rtol=1e-5, atol=1e-6)
    assert_same_update(micro, one_call)
    for k, want in one_call[3].items():  # train/* combined over micro-batches: the one-call values
        assert micro[3][k] == pytest.approx(want, rel=1e-5, abs=1e-7), k


def test_sequence_over_the_token_budget_is_a_one_line_error(batch):
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    learner = Learner(model, nnx.Optimizer(model, make_optimizer(learning_rate=1e-3), wrt=nnx.Param),
                      dapo_config(prompt_batch_size=3, mini_batch_size=3, n_samples=4), CORRECTION,
                      memory=MemoryConfig(max_tokens_per_micro_batch=16))
    longest = int(batch["seq_len"].max())
    with pytest.raises(MicroBatchBudgetError) as e:
        learner.prepare(batch)
    assert str(e.value) == (f"a sequence of {longest} tokens (prompt + response) does not fit "
                            f"learner_jax.MemoryConfig.max_tokens_per_micro_batch=16 (sequences are never split); raise it to at "
                            f"least {longest}")
    assert isinstance(e.value, ValueError)


def test_prepare_leaves_the_batch_alone_and_update_needs_the_prepared_batch(batch):
    keys = {k: v.copy() for k, v in batch.items()}
    model = Transformer(CFG, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    learner = Learner(model, nnx.Optimizer(model, make_optimizer(learning_rate=1e-3), wrt=nnx.Param),
                      dapo_config(prompt_batch_size=3, mini_batch_size=3, n_samples=4), CORRECTION)
    prepared = learner.prepare(batch)
    assert batch.keys() == keys.keys() and all(np.array_equal(batch[k], v) for k, v in keys.items())
    assert {"batch/padding_fraction", "batch/rows", "batch/row_tokens", "tis/kl"} <= prepared.metrics.keys()
    # packed rows (the default): less padding than the one-sequence-per-row view
    view_padding = 1 - batch["attention_mask"].sum() / batch["attention_mask"].size
    assert prepared.metrics["batch/padding_fraction"] < view_padding
    with pytest.raises(TypeError, match="PreparedBatch returned by Learner.prepare"):
        learner.update(batch)


# ------------------------------------------------------------------------------ 2 host devices
MESH_SCRIPT = textwrap.dedent(r'''
    import json
    import numpy as np
    from tests.test_micro_batches import MemoryConfig, ragged_batch, run_update   # cwd: the repository root
    import jax
    from portable_rl.learner_jax.sharding import MeshConfig, make_mesh

    assert len(jax.devices()) == 2
    batch = ragged_batch()
    out = {}
    for agg in ("token-mean", "seq-mean-token-mean"):
        one = run_update(MemoryConfig(pack_sequences=False), agg, batch)
        mesh = run_update(MemoryConfig(max_tokens_per_micro_batch=64), agg, batch,
                          mesh=make_mesh(MeshConfig(data=2, fsdp=1, tensor=1)))
        diff = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(mesh[1]), jax.tree.leaves(one[1])))
        moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(one[1]), jax.tree.leaves(one[0])))
        scale = max(float(np.abs(a).max()) for a in jax.tree.leaves(one[1]))
        shapes = sorted({mb["input_ids"].shape for mini in mesh[2].micro_batches for mb in mini})
        out[agg] = dict(diff=diff, moved=moved, scale=scale, shapes=shapes,
                        metrics={k: (mesh[3][k], v) for k, v in one[3].items()})
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.slow  # a subprocess with 2 host devices, 4 learners compiled (~40 s)
def test_micro_batches_on_a_2_device_mesh_give_the_one_call_update():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    for agg, r in json.loads(lines[-1].removeprefix("RESULT ")).items():
        assert r["shapes"] == [[2, 64]], r["shapes"]    # one 64-token row per device per micro-batch
        assert r["moved"] > 1e-3 and r["diff"] <= 1e-6 * r["scale"], (agg, r)
        for k, (got, want) in r["metrics"].items():
            assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (agg, k)
