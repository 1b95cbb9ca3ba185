"""Training entry point (T5X style): `python -m portable_rl.train --gin_file=gin/dapo_fp8.gin`.

One RL step (`rl_step`, docs/training.md "What one step does"):

    rollouts      task prompts → n trajectories per prompt: the engine samples each turn with its logprobs, the
                  environment answers it (one turn for single-turn tasks; rl/turns.py) → rewards →
                  dynamic sampling → overlong shaping → group advantages → the batch       (rl/roles.py, rl/dapo.py)
    old logprobs  the learner scores the batch (the first mini-batch's: its own update's forward)
    correction    rollout correction weights from old vs rollout logprobs                    (tis/)
    update        mini-batch PPO updates                                                     (rl/learner.py)
    push          the new weights into the engine                                            (rl/sync.py)
    diagnostics   update survival, the post-sync probe, the mismatch split                   (rl/diagnostics.py)

`train()` is a plain keyword-only function of config objects (rl/config.py, rl/dapo.py, learner_jax/memory.py,
tis/), a loop over `build_run` (the learner's half of a `Run`), `build_engine_side` (the engine's half),
`rl_step` and `maybe_checkpoint`; gin binds the configs' fields (gin_utils registers it). Rerunning the same
command resumes from the newest checkpoint in `run_dir/checkpoints`; SIGTERM finishes the current step,
checkpoints it and exits (rl/preemption.py). `RunConfig.async_rollouts` overlaps generation of step k+1 with training on step k, one
step off-policy (rl/async_rollout.py). Several JAX processes (`python -m portable_rl.launch`): process 0 owns the
engine and the logs, the others follow it (rl/roles.py); every process runs the same sharded step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from portable_rl.errors import ConfigError
from portable_rl.learner_jax.memory import MemoryConfig
from portable_rl.rl.config import DiagnosticsConfig, EnvironmentConfig, PrecisionConfig, RunConfig
from portable_rl.rl.dapo import DapoConfig
from portable_rl.tis.config import RolloutCorrectionConfig

if TYPE_CHECKING:  # the loop's types; imported where they are built, so `--help` starts without JAX
    from flax import nnx

    from portable_rl.learner_jax.checkpoint import Checkpointer
    from portable_rl.learner_jax.config import ModelConfig
    from portable_rl.learner_jax.model import Transformer
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.colocation import TimeSharing
    from portable_rl.rl.diagnostics import Diagnostic
    from portable_rl.rl.learner import Learner
    from portable_rl.rl.multihost import Processes
    from portable_rl.rl.roles import EngineSide, FollowerSide
    from portable_rl.rl.update_survival import UpdateSurvival


class PhaseClock:
    """Seconds per phase of one step, reported as time/<phase>: `with clock("train"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{phase}": s for phase, s in self.seconds.items()}


@dataclasses.dataclass
class Run:
    """What the loop works with: the learner's half, built on every process by `build_run`, and the engine's
    half, built by `build_engine_side` (the engine and its side, the post-push diagnostics, the time sharing)."""
    config: RunConfig
    dapo: DapoConfig
    procs: Processes              # this process's role among the JAX processes
    codec: TextCodec              # prompts ↔ token ids (chat template or not)
    model: Transformer            # restored when resuming
    model_config: ModelConfig
    optimizer: nnx.Optimizer      # restored when resuming
    learner: Learner
    ckpts: Checkpointer
    start_step: int               # 0, or the restored checkpoint's step
    survival: Optional[UpdateSurvival]  # its W_0: the starting checkpoint; None when disabled
    # the engine's half (build_engine_side)
    timeshare: Optional[TimeSharing] = None  # sleep_engine: the engine's memory lent to the learner each step
    side: Optional[Union[EngineSide, FollowerSide]] = None
    hooks: list[Diagnostic] = dataclasses.field(default_factory=list)  # the post-push diagnostics, in order


def build_run(*, run_config: RunConfig, dapo: DapoConfig, correction: RolloutCorrectionConfig,
              optimizer_factory: Optional[Callable], precision: PrecisionConfig, memory: MemoryConfig,
              diagnostics: DiagnosticsConfig, mesh, warmstart_fn: Optional[Callable]) -> Run:
    """Warm start, model, optimizer, learner, the update-survival reference and the checkpoint restore, in the
    order they depend on each other. Runs on every process, after the memory plan set XLA's allocator."""
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl.convert.hf import load_hf_model
    from portable_rl.learner_jax.checkpoint import Checkpointer
    from portable_rl.learner_jax.optim import make_optimizer, with_master_weights
    from portable_rl.learner_jax.sharding import make_mesh
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.learner import Learner
    from portable_rl.rl.multihost import Processes

    run_dir, model_path = Path(run_config.run_dir), run_config.model_path
    run_dir.mkdir(parents=True, exist_ok=True)
    procs = Processes.current()  # several JAX processes: process 0 drives the engine (rl/multihost.py)
    if procs.multiple and mesh is None:
        raise ValueError(f"{procs.count} JAX processes need a device mesh over all of them: compose "
                         "--gin_file=gin/learner/mesh.gin (or set train.mesh)")
    if not (Path(model_path) / "config.json").exists():
        if warmstart_fn is None:
            raise FileNotFoundError(f"no HF checkpoint at {model_path}; set MODEL_PATH or configure train.warmstart_fn")
        if procs.is_driver:  # written once; the other processes wait for it
            print(f"[train] starting checkpoint {model_path} missing: running the warm start")
            warmstart_fn(output_dir=model_path)
        procs.barrier("warm start written")

    model, model_config = load_hf_model(model_path, param_dtype=jnp.dtype(precision.param_dtype),
                                        compute_dtype=jnp.dtype(precision.compute_dtype), **memory.model_kwargs())
    tx = (optimizer_factory or make_optimizer)()
    if precision.master_dtype and jnp.dtype(precision.master_dtype) != jnp.dtype(precision.param_dtype):
        # bf16 params + f32 master params in the optimizer state: small steps are kept, and the weight push
        # hands engines the model's own bf16 buffers without a cast (optim.with_master_weights).
        tx = with_master_weights(tx, jnp.dtype(precision.master_dtype))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    # Before the restore below, so a checkpoint lands directly in the sharded layout.
    learner = Learner(model, optimizer, dapo, correction, mesh=make_mesh(mesh) if mesh is not None else None,
                      memory=memory, routing=precision.routing, compare_routing=precision.compare_routing)
    survival = None
    if diagnostics.enabled("update_survival"):  # its reference is the starting checkpoint, taken before a restore
        from portable_rl.rl.update_survival import UpdateSurvival, learner_weights

        survival = UpdateSurvival(model_config, channel_stride=diagnostics.update_survival_stride)
        survival.reference(learner_weights(model, optimizer))
    codec = TextCodec(model_path, chat_template=run_config.chat_template)
    ckpts = Checkpointer(run_dir / "checkpoints", max_to_keep=run_config.keep_checkpoints)
    start_step = 0
    if ckpts.latest_step() is not None:
        start_step = ckpts.restore(model, optimizer).step
        print(f"[train] resumed from {run_dir / 'checkpoints'} at step {start_step}")
    return Run(config=run_config, dapo=dapo, procs=procs, codec=codec, model=model, model_config=model_config,
               optimizer=optimizer, learner=learner, ckpts=ckpts, start_step=start_step, survival=survival)


def build_engine_side(run: Run, *, engine_factory: Callable, task, reward_fn, held_out: list, budget,
                      precision: PrecisionConfig, diagnostics: DiagnosticsConfig,
                      environment: EnvironmentConfig) -> float:
    """The time sharing (`budget`: the memory plan, or None), then the engine started (the driver owns it;
    rl/roles.py), what it serves known on every process, this process's side, the restored (or smoothed) policy
    pushed, the post-push diagnostics: `run.timeshare`, `run.side`, `run.hooks`. Returns when that first sync
    began (perf_counter), for the first row's time/sync."""
    from portable_rl.engines.base import SamplingConfig
    from portable_rl.rl.colocation import TimeSharing
    from portable_rl.rl.diagnostics import make_diagnostics
    from portable_rl.rl.metrics import MetricsWriter
    from portable_rl.rl.roles import EngineSide, FollowerSide
    from portable_rl.rl.sync import Serving, smoothquant_for_run
    from portable_rl.rl.turns import token_limit

    config, procs, codec, gen = run.config, run.procs, run.codec, run.dapo.generation
    run.timeshare = TimeSharing(enabled=budget is not None and budget.sleep_engine,
                                async_rollouts=config.async_rollouts)
    engine = engine_factory(model_path=config.model_path, **(budget.engine_kwargs() if budget else {})) \
        if procs.is_driver else None
    try:
        if engine is not None:  # a trajectory budget the engine cannot hold fails here, not at a later turn
            token_limit(environment, engine)
        quantization = procs.broadcast(getattr(engine, "quantization", None))
        serving = Serving(quantization, smoothquant_for_run(
            precision.smoothquant_alpha, model=run.model, codec=codec, task=task, run_dir=config.run_dir,
            engine_quantization=quantization, procs=procs))
        if precision.engine_routing and not procs.broadcast(getattr(engine, "returns_routed_experts", False)):
            raise ConfigError(f"rl.PrecisionConfig.routing={precision.routing!r} needs the engine's routing but "
                              f"{type(engine).__name__} does not return it; start a vLLM engine with "
                              "return_routed_experts=True (gin/experiments/tiny_moe_replay.gin), or set routing='own'")
        if precision.learner_precision == "engine":  # every process: its forwards use the served weights
            run.learner.serve_weights_as(serving.quantization, serving.smoothing)
    except BaseException:
        if engine is not None:
            engine.close()
        raise
    if engine is not None:  # the engine, the task draws, evaluation and the logs
        run.side = EngineSide(
            engine=engine, serving=serving, writer=MetricsWriter(config.run_dir, resume_step=run.start_step or -1),
            codec=codec, task=task, reward_fn=reward_fn, dapo=run.dapo, seed=config.seed, held_out=held_out,
            async_rollouts=config.async_rollouts, procs=procs, environment=environment,
            return_routed_experts=precision.engine_routing,
            greedy=SamplingConfig(temperature=0.0, n=1, max_tokens=config.eval_max_tokens or gen.max_response_tokens,
                                  stop_token_ids=(codec.eos_id,)))
    else:  # receives the driver's batches and joins every collective
        run.side = FollowerSide(procs, serving=serving, dapo=run.dapo, pad_id=codec.pad_id)
    try:
        run.timeshare.attach(engine)  # only the engine's owner sleeps and wakes it
        sync_started = time.perf_counter()
        if run.start_step or serving.smoothing is not None:  # the engine loaded the starting checkpoint
            run.side.push(run.model, run.model_config)        # unsmoothed: give it the restored/smoothed policy
        run.hooks = make_diagnostics(
            diagnostics, engine=engine, learner=run.learner, model=run.model, optimizer=run.optimizer,
            survival=run.survival, serving=serving, staleness=config.async_rollouts, procs=procs,
            probe_prompts=[codec.encode_prompt(e.prompt) for e in held_out[:diagnostics.probe_prompts]],
            temperature=gen.temperature, max_tokens=gen.max_response_tokens, pad_id=codec.pad_id)
    except BaseException:
        run.side.close()
        raise
    return sync_started


def rl_step(step: int, run: Run, *, prefetch_next: bool) -> dict:
    """One RL step (module doc) → its metrics row."""
    from portable_rl.rl.rollout import check_nonfinite_fraction

    clock, learner, side, timeshare = PhaseClock(), run.learner, run.side, run.timeshare
    wait = "wait_rollouts" if run.config.async_rollouts else "rollouts"  # async: the main thread's idle time
    with clock("step"):
        with clock(wait):
            batch, m, generate_seconds = side.rollouts(step, prefetch_next=prefetch_next)  # the same on every process
        m["time/generate"] = generate_seconds  # async: measured in the generating thread
        # NaN/inf rollout logprobs are masked out of the loss; too many mean a broken engine: stop.
        check_nonfinite_fraction(m, run.dapo.safety.max_nonfinite_fraction)
        timeshare.learner_phase()  # sleep_engine: the engine's memory is the learner's until the push
        if batch is not None:  # None: every group had equal rewards in every draw, nothing to learn from
            with clock("logprob"):
                prepared = learner.prepare(batch)  # old logprobs (none in bypass), rollout correction, micro-batches
            m.update(prepared.metrics)
            with clock("train"):
                m.update(learner.update(prepared))
        with clock(wait):
            side.wait_rollouts()  # async: the engine must be idle before its weights change
            timeshare.push_phase()  # weights back for the push; the KV cache only after it
        with clock("sync"):
            side.push(run.model, run.model_config)
        timeshare.generate_phase()
        for diagnostic in run.hooks:
            with clock(diagnostic.name):
                m.update(diagnostic.after_push())
        if run.config.eval_every and (step % run.config.eval_every == 0 or step == run.config.train_steps):
            with clock("eval"):
                m.update(side.heldout())
    return {**m, **clock.metrics(), **timeshare.metrics()}


def maybe_checkpoint(run: Run, step: int, *, stop_now: bool) -> bool:
    """Saves a checkpoint every `checkpoint_every` steps, at the last step and when stopping; True: stop now
    (a SIGTERM on some process, rl/preemption.py)."""
    config = run.config
    if step % config.checkpoint_every == 0 or step == config.train_steps or stop_now:
        run.ckpts.save(step, run.model, run.optimizer,
                       extra={"seed": config.seed, "model_path": str(config.model_path)})
    if stop_now:
        print(f"[train] stopped after step {step} (checkpoint saved); rerun the same command to resume", flush=True)
    return stop_now


def prepare_memory(memory_plan, run_config: RunConfig, precision: PrecisionConfig):
    """The memory plan decided, with XLA's allocator set (`rl.colocation.prepare`), or None when there is none.
    Before JAX starts its devices: XLA reads its allocator settings then."""
    if memory_plan is None:
        return None
    from portable_rl.rl.colocation import MemoryPlan, prepare

    if isinstance(memory_plan, MemoryPlan):  # the checkpoint and dtypes are the run's own (a Budget has them)
        memory_plan = memory_plan.for_run(model_path=run_config.model_path, precision=precision)
    return prepare(memory_plan)


def train(*, run_config: RunConfig, engine_factory: Callable, task, dapo: DapoConfig = DapoConfig(),
          correction: RolloutCorrectionConfig = RolloutCorrectionConfig(), optimizer_factory: Optional[Callable] = None,
          precision: PrecisionConfig = PrecisionConfig(), memory: MemoryConfig = MemoryConfig(),
          diagnostics: DiagnosticsConfig = DiagnosticsConfig(), environment: EnvironmentConfig = EnvironmentConfig(),
          mesh=None, memory_plan=None, warmstart_fn: Optional[Callable] = None) -> list[dict]:
    """Runs (or resumes) DAPO/GRPO training; returns the metrics rows written by this call.

    Args:
      run_config: the run: directory, steps, starting checkpoint, seeds, evaluation, checkpoints (`rl.RunConfig`).
      engine_factory: builds the rollout engine: `engine_factory(model_path=..., **memory plan kwargs)`.
      task: the prompts, answers and reward (`tasks.*`).
      dapo: DAPO / GRPO settings (`rl.DapoConfig`).
      correction: the rollout correction (TIS and masks; `tis.RolloutCorrectionConfig`); its default: none.
      optimizer_factory: builds the optax optimizer; None: `learner_jax.make_optimizer()`.
      precision: the learner's dtypes, the push's SmoothQuant, the learner's served view (`rl.PrecisionConfig`).
      memory: the learner's memory strategy; every setting computes the same update (`learner_jax.MemoryConfig`).
      diagnostics: what is measured after each push (`rl.DiagnosticsConfig`).
      environment: what each trajectory runs in and when it ends (`rl.EnvironmentConfig`); default: the task's
        prompt, one turn, scored by its reward.
      mesh: the learner's device mesh (`learner_jax.MeshConfig`); None: one device.
      memory_plan: how learner and engine share each device (`rl.colocation.MemoryPlan`, gin/colocate.gin; its checkpoint
        and dtypes are taken from `run_config` and `precision`); None: XLA's and the engine's defaults, the engine
        always awake.
      warmstart_fn: writes the starting checkpoint when `run_config.model_path` has none (`warmstart`).
    """
    from tqdm import tqdm

    from portable_rl.rl.preemption import StopRequest
    from portable_rl.rl.turns import task_reward

    budget = prepare_memory(memory_plan, run_config, precision)  # before JAX starts its devices
    held_out = list(task.eval_examples())[:run_config.eval_size]
    reward_fn = task_reward(environment, task, held_out[0])  # None: the environment scores (e.g. 'sql')
    run = build_run(run_config=run_config, dapo=dapo, correction=correction, optimizer_factory=optimizer_factory,
                    precision=precision, memory=memory, diagnostics=diagnostics, mesh=mesh, warmstart_fn=warmstart_fn)
    # Installed before the engine starts: a SIGTERM from here on stops the run after its next complete step.
    with StopRequest() as stop:
        sync_started = build_engine_side(run, engine_factory=engine_factory, task=task, reward_fn=reward_fn,
                                         held_out=held_out, budget=budget, precision=precision,
                                         diagnostics=diagnostics, environment=environment)
        try:
            rows = [] if run.start_step else [
                run.side.write(0, {**run.side.heldout(), "time/sync": time.perf_counter() - sync_started})]
            heldout = rows[-1].get("accuracy/heldout", float("nan")) if rows else float("nan")
            bar = tqdm(range(run.start_step + 1, run_config.train_steps + 1), initial=run.start_step,
                       total=run_config.train_steps, desc="train", dynamic_ncols=True,
                       disable=None if run.procs.is_driver else True)  # None: shown on a terminal only
            for step in bar:
                m = rl_step(step, run, prefetch_next=step < run_config.train_steps and not stop.requested)
                rows.append(run.side.write(step, m))
                heldout = m.get("accuracy/heldout", heldout)
                bar.set_postfix(reward=f"{m['reward/mean']:.2f}", heldout_acc=f"{heldout:.2f}")
                if maybe_checkpoint(run, step, stop_now=run.procs.any(stop.requested)):  # a SIGTERM on any process
                    break
            run.ckpts.close()
        finally:
            run.side.close()
    run.side.plots(run_config.run_dir)
    return rows


def main(configured_train: Callable = train):
    from portable_rl import gin_utils
    from portable_rl.rl.multihost import Processes

    budget = gin_utils.memory_budget()  # gin/colocate.gin; decided before JAX starts its devices
    driver = Processes.current().is_driver  # the run directory's files are written once, by process 0
    run_dir = gin_utils.query_value("rl.RunConfig.run_dir")
    if driver:
        gin_utils.write_config(run_dir, "config.gin")
    rows = configured_train(memory_plan=budget) if budget is not None else configured_train()
    if driver:
        gin_utils.write_config(run_dir, "operative_config.gin", operative=True)
    last = rows[-1] if rows else {}
    print(f"[train] done: {run_dir} (step {last.get('step')}, held-out accuracy {last.get('accuracy/heldout')})")


def register_gin() -> Callable:
    """`train` and the warm start its default run names (`train.warmstart_fn = @warmstart`) registered with gin;
    returns the configured `train` (what the CLI runs)."""
    from portable_rl import gin_utils
    from portable_rl.warmstart import warmstart

    gin_utils.register_configurable(warmstart, name="warmstart")
    return gin_utils.register_train(train)


def cli(argv=None):
    """Console entry point: parses --gin_file / --gin.NAME=VALUE flags and runs `train`. Joins the other JAX
    processes first when the environment names them (`portable_rl.launch`, docs/scaling.md)."""
    from portable_rl.engines.cpu_features import prefer_passive_omp_waits

    prefer_passive_omp_waits()  # before anything below imports torch
    from portable_rl import gin_utils
    from portable_rl.launch import fail_fast, initialize_from_environment

    several = initialize_from_environment()
    configured = register_gin()
    run_cli = lambda: gin_utils.run(lambda: main(configured), argv, description=__doc__.splitlines()[0])  # noqa: E731
    fail_fast(run_cli) if several else run_cli()  # several processes: an error must not wait for the others


if __name__ == "__main__":
    cli()
