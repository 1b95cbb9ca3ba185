"""Time-sharing contract (rl/colocation.py): with SLEEP_ENGINE the engine sleeps through the learner phase and
wakes weights first, then the KV cache, every step and across a resume; with async rollouts it is refused.

The engine is a recording adapter with vLLM's sleep semantics (generate needs weights and KV cache back,
a push needs the weights back): a loop that pushed into a sleeping engine or generated before the KV cache
returned fails here, as it would hang or crash a real GPU engine. The learner is the real one (tiny model),
its two phases recorded by wrapping `Learner.prepare` / `Learner.update`.
"""

import itertools

import pytest

from portable_rl.engines.base import EngineAdapter, Rollout, SamplingConfig
from portable_rl.errors import ConfigError, UserError
from portable_rl.rl.colocation import TimeSharing, takes_tags


class RecordingEngine(EngineAdapter):
    """vLLM-like sleep states; appends what happens to `log` and refuses what a sleeping vLLM cannot do."""

    quantization = "recorded"  # the post-sync probe reports, it does not hold a fake engine to bf16 bounds

    def __init__(self, log, eos_id: int, partial: bool = True, **engine_kwargs):
        self.log, self.eos_id, self.engine_kwargs = log, eos_id, engine_kwargs
        self.weights = self.kv_cache = True
        if not partial:  # an adapter whose wake_up takes no tags (SGLang's)
            self.wake_up = self._wake_whole

    def generate(self, prompt_token_ids, sampling):
        assert self.weights and self.kv_cache, "generate() while the engine sleeps"
        self.log.append("generate")
        return [Rollout(i, list(p), [5 + j % 3, 6, self.eos_id], [-0.1, -0.2, -0.3], "stop")
                for i, p in enumerate(prompt_token_ids) for j in range(sampling.n)]

    def update_weights(self, named_tensors):
        assert self.weights, "push into an engine whose weight memory is asleep"
        list(named_tensors)
        self.log.append("push" if not self.kv_cache else "push(kv awake)")

    def sleep(self):
        assert self.weights and self.kv_cache, "sleep() twice"
        self.weights = self.kv_cache = False
        self.log.append("sleep")

    def wake_up(self, tags=None):
        for tag in tags or ("weights", "kv_cache"):
            setattr(self, tag, True)
        self.log.append(f"wake({','.join(tags)})" if tags else "wake")

    def _wake_whole(self):
        self.weights = self.kv_cache = True
        self.log.append("wake")

    def close(self):
        pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("colocation") / "model")


def _budget(model_path, sleep_engine=True):
    """A decided plan for a pretend 4 GB device (no GPU here), with nothing taken from this environment."""
    from portable_rl.rl.colocation import MemoryPlan

    return MemoryPlan(learner_peak_gb=0.5, model_path=model_path, sleep_engine=sleep_engine, max_model_len=64,
                      device_memory_gb=4.0, engine_overhead_gb=0.5, engine_asleep_gb=0.2,
                      reserve_gb=0.5).decide(environ={})


def _run(tiny, run_dir, steps, log, budget, monkeypatch, partial=True):
    from portable_rl.rl import learner as learner_module
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.config import RunConfig
    from portable_rl.rl.config import DiagnosticsConfig
    from portable_rl.rl.dapo import dapo_config
    from portable_rl.tasks import ArithmeticTask
    from portable_rl.train import train

    for phase in ("prepare", "update"):  # the learner's two phases, recorded around the real methods
        original = getattr(learner_module.Learner, phase)

        def recorded(self, *args, _original=original, **kwargs):
            log.append("learner")
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(learner_module.Learner, phase, recorded)
    built = []

    def engine_factory(*, model_path, **kwargs):
        built.append(kwargs)
        return RecordingEngine(log, TextCodec(model_path).eos_id, partial=partial)

    cfg = dapo_config(prompt_batch_size=2, n_samples=2, dynamic_sampling=False, max_gen_batches=1,
                     max_response_tokens=4, mini_batch_size=2)
    from portable_rl.learner_jax.optim import make_optimizer

    rows = train(run_config=RunConfig(run_dir=str(run_dir), train_steps=steps, model_path=tiny, eval_every=0,
                               checkpoint_every=1),
                 engine_factory=engine_factory, optimizer_factory=lambda: make_optimizer(learning_rate=1e-4),
                 task=ArithmeticTask(num_digits=1, num_eval=2, seed=0), dapo=cfg,
                 diagnostics=DiagnosticsConfig(probe_prompts=1), memory_plan=budget)
    return rows, built


def _collapse(log):
    return [name for name, _ in itertools.groupby(log)]  # the learner's correct + update are one phase


CYCLE = ["sleep", "learner", "wake(weights)", "push", "wake(kv_cache)", "generate"]


@pytest.mark.slow
def test_engine_sleeps_through_the_learner_every_step_and_after_a_resume(tiny, tmp_path, monkeypatch):
    budget = _budget(tiny)
    log = []
    rows, built = _run(tiny, tmp_path / "run", 2, log, budget, monkeypatch)
    # the plan's share and sleep mode reach the engine's constructor
    assert built == [{"enable_sleep_mode": True, "gpu_memory_utilization": budget.engine_fraction}]
    assert 0 < budget.engine_fraction < 1
    events = _collapse(log)
    # fresh run: the step-0 held-out pass, then per step: generate the rollouts, then the cycle (the probe is
    # the cycle's last generate, and the next step's rollouts follow it)
    assert events == ["generate"] + CYCLE * 2, events
    assert [r["step"] for r in rows] == [0, 1, 2] and all("time/sleep_wake" in r for r in rows[1:])

    log.clear()
    _run(tiny, tmp_path / "run", 3, log, budget, monkeypatch)  # resumes from the step-2 checkpoint
    # the engine starts awake on the base checkpoint and gets the restored policy, then the same cycle
    assert _collapse(log) == ["push(kv awake)", "generate"] + CYCLE, log


def test_async_rollouts_with_sleep_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match="async_rollouts=True: async rollouts generate during the learner") as e:
        TimeSharing(enabled=True, async_rollouts=True)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    TimeSharing(enabled=False, async_rollouts=True)  # the resident plan with async rollouts is fine


def test_hooks_follow_the_engine_states_and_do_nothing_when_disabled():
    """Without a memory plan train() builds TimeSharing(enabled=False): no sleep, no wake, no new metric, and
    the engine factory gets no extra arguments (Budget is None) -- the CPU runs are unchanged."""
    log = []
    engine = RecordingEngine(log, eos_id=2)
    assert takes_tags(engine) and not takes_tags(RecordingEngine(log, eos_id=2, partial=False))
    off = TimeSharing(enabled=False)
    off.attach(engine)
    off.learner_phase(), off.push_phase(), off.generate_phase()
    assert log == [] and off.metrics() == {}
    on = TimeSharing(enabled=True)
    on.attach(None)  # a follower process owns no engine
    on.learner_phase(), on.push_phase(), on.generate_phase()
    on.attach(engine)
    on.learner_phase()
    on.generate_phase()  # no push since the sleep (e.g. a stop): everything comes back at once
    assert log == ["sleep", "wake"] and engine.weights and engine.kv_cache
    assert on.metrics()["time/sleep_wake"] >= 0 and on.metrics()["time/sleep_wake"] == 0.0


def test_an_adapter_without_wake_tags_wakes_whole_before_the_push():
    log = []
    engine = RecordingEngine(log, eos_id=2, partial=False)  # SGLang's wake_up takes no tags
    share = TimeSharing(enabled=True)
    share.attach(engine)
    share.learner_phase()
    share.push_phase()
    engine.update_weights([])
    share.generate_phase()  # nothing left asleep
    engine.generate([[1]], SamplingConfig())
    assert log == ["sleep", "wake", "push(kv awake)", "generate"]
