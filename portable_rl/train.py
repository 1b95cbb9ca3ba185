"""Training entry point (T5X style): `python -m portable_rl.train --gin_file=gin/dapo_fp8.gin`.

One step (docs/training.md):
    prompts (task, seeded by step) → engine samples n responses with rollout logprobs → rewards →
    dynamic sampling → overlong shaping → group advantages → learner recomputes old logprobs (the first
    mini-batch's from its own update's forward) →
    rollout correction (tis/) → mini-batch PPO updates → push weights to the engine → post-sync probe.

`train()` is a plain keyword-only function; gin fills its arguments (gin_utils registers it). Rerunning
the same command resumes from the newest checkpoint in `run_dir/checkpoints`; SIGTERM finishes the
current step, checkpoints it and exits (rl/preemption.py). `async_rollouts=True` overlaps generation of
step k+1 with training on step k, one step off-policy (rl/async_rollout.py).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Optional


@dataclasses.dataclass
class RunSetup:
    """What a run starts from: built once per process by `setup_run`, then only read by the loop."""
    run_dir: Path
    procs: Any                # rl.multihost.Processes: this process's role among the JAX processes
    cfg: Any                  # rl.dapo.DapoConfig
    codec: Any                # rl.codec.TextCodec: prompts ↔ token ids (chat template or not)
    reward_fn: Callable
    model: Any                # learner_jax.model.Transformer (restored when resuming)
    model_config: Any
    optimizer: Any            # nnx.Optimizer (restored when resuming)
    learner: Any              # rl.learner.Learner
    ckpts: Any                # learner_jax.checkpoint.Checkpointer
    start_step: int           # 0, or the restored checkpoint's step
    held_out: list            # the task's first eval_size held-out examples
    budget: Any               # memory_plan.Budget or None
    survival: Any             # rl.update_survival.UpdateSurvival (its W_0: the starting checkpoint) or None


def setup_run(*, run_dir, model_path, task, algorithm, optimizer_factory, correction, eval_size,
              keep_checkpoints, warmstart_fn, chat_template, param_dtype, master_dtype, compute_dtype, mesh,
              attention_impl, pack_sequences, share_prompts, max_tokens_per_micro_batch, logprob_chunk_tokens,
              remat, memory_plan, update_survival_stride) -> RunSetup:
    """Memory plan, warm start, model, optimizer, learner, checkpoint restore and held-out set, in the order
    they depend on each other. Runs on every process. Every argument is train()'s of the same name (no
    defaults here: train()'s signature is the one place they are set)."""
    budget = None
    if memory_plan is not None:  # before JAX starts its devices: XLA reads its allocator settings then
        from portable_rl.rl.colocation import prepare

        budget = prepare(memory_plan)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from portable_rl import tis
    from portable_rl.convert.hf import load_hf_model
    from portable_rl.learner_jax.memory import MemoryConfig
    from portable_rl.learner_jax.optim import make_optimizer, with_master_weights
    from portable_rl.learner_jax.checkpoint import Checkpointer
    from portable_rl.learner_jax.sharding import make_mesh
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.dapo import DapoConfig
    from portable_rl.rl.learner import Learner
    from portable_rl.rl.multihost import Processes
    from portable_rl.tasks import get_reward

    cfg = algorithm or DapoConfig()
    memory = MemoryConfig(attention_impl=attention_impl, pack_sequences=pack_sequences, share_prompts=share_prompts,
                          max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                          logprob_chunk_tokens=logprob_chunk_tokens, remat=remat)
    correction = correction or tis.RolloutCorrectionConfig(mode="token", clip=2.0)
    run_dir = Path(run_dir)
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

    codec = TextCodec(model_path, chat_template=chat_template)
    reward_fn = get_reward(task.reward)
    model, model_config = load_hf_model(model_path, param_dtype=jnp.dtype(param_dtype),
                                        compute_dtype=jnp.dtype(compute_dtype), **memory.model_kwargs())
    tx = (optimizer_factory or make_optimizer)()
    if master_dtype and jnp.dtype(master_dtype) != jnp.dtype(param_dtype):
        # bf16 params + f32 master params in the optimizer state: small steps are kept, and the weight push
        # hands engines the model's own bf16 buffers without a cast (optim.with_master_weights).
        tx = with_master_weights(tx, jnp.dtype(master_dtype))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    # Before the restore below, so a checkpoint lands directly in the sharded layout.
    learner = Learner(model, optimizer, cfg, correction, mesh=make_mesh(mesh) if mesh is not None else None,
                      memory=memory)

    survival = None
    if update_survival_stride:  # its reference is the starting checkpoint, taken before a resume restores
        from portable_rl.rl.update_survival import UpdateSurvival, learner_weights

        survival = UpdateSurvival(model_config, channel_stride=update_survival_stride)
        survival.reference(learner_weights(model, optimizer))
    ckpts = Checkpointer(run_dir / "checkpoints", max_to_keep=keep_checkpoints)
    start_step = 0
    if ckpts.latest_step() is not None:
        start_step = ckpts.restore(model, optimizer).step
        print(f"[train] resumed from {run_dir / 'checkpoints'} at step {start_step}")
    held_out = list(task.eval_examples())[:eval_size]
    return RunSetup(run_dir=run_dir, procs=procs, cfg=cfg, codec=codec, reward_fn=reward_fn, model=model,
                    model_config=model_config, optimizer=optimizer, learner=learner, ckpts=ckpts,
                    start_step=start_step, held_out=held_out, budget=budget, survival=survival)


def train(*, run_dir: str, train_steps: int, model_path: str, engine_factory: Callable, task,
          algorithm=None, optimizer_factory: Optional[Callable] = None, correction=None, seed: int = 0,
          eval_every: int = 10, eval_max_tokens: Optional[int] = None, eval_size: Optional[int] = None,
          checkpoint_every: int = 10, keep_checkpoints: int = 2, warmstart_fn: Optional[Callable] = None,
          chat_template: bool = False, probe_prompts: int = 4, param_dtype: str = "float32",
          master_dtype: Optional[str] = "float32",
          compute_dtype: str = "bfloat16", async_rollouts: bool = False,
          mesh=None, attention_impl: str = "auto", pack_sequences: bool = True, share_prompts: bool = False,
          max_tokens_per_micro_batch: Optional[int] = None, logprob_chunk_tokens: Optional[int] = None,
          remat: str = "none", progress: bool = True, memory_plan=None,
          update_survival_stride: int = 16, mismatch_split: bool = True,
          smoothquant_alpha: Optional[float] = None) -> list[dict]:
    """Runs (or resumes) DAPO/GRPO training; returns the metrics rows written by this call.

    `mesh`: a `learner_jax.sharding.MeshConfig` (data / fsdp / tensor axes over the local devices, or all
    hosts' after `jax.distributed.initialize`); None runs the learner on one device. docs/scaling.md.
    Several JAX processes (`python -m portable_rl.launch`): process 0 owns the engine and the logs, the
    others follow it (rl/roles.py); every process runs the same sharded step and checkpoint.
    Memory knobs (`learner_jax.memory.MemoryConfig`, docs/training.md "Memory knobs"): `attention_impl`
    ('auto' | 'blockwise' | 'dense' | 'cudnn' | 'splash'), `pack_sequences`, `share_prompts` (a prompt's
    answers share one copy of its tokens), `max_tokens_per_micro_batch`
    (per batch shard; None: one call per mini-batch), `logprob_chunk_tokens` (None: whole head at once),
    `remat` ('none' | 'full' | a checkpoint-policy name). Every setting computes the same update.
    `update_survival_stride`: every k-th output channel of each projection is tracked across pushes for
    `sync/quantized_changed_frac` / `sync/update_lost_frac` (rl/update_survival.py, docs/training.md); 0: off.
    `mismatch_split`: with a probe (`probe_prompts` > 0), split its KL into `mismatch/quantization`,
    `mismatch/kernels` (and, async, `mismatch/staleness`): one more learner forward on the probe rows
    (rl/mismatch_split.py, docs/tis.md); False: off.
    `smoothquant_alpha`: with an INT8 W8A8 engine, SmoothQuant factors (convert/smoothing.py) calibrated once
    on the first training prompts and applied to every push (0.5 is SmoothQuant's default); None: off.
    `memory_plan`: a `memory_plan.MemoryPlan` (or the `Budget` the CLI decided from gin/colocate.gin): the
    learner's and the engine's share of each device, and with `sleep_engine` the engine sleeps through the
    learner phase (rl/colocation.py). None: XLA's and the engine's defaults, the engine always awake.
    """
    from tqdm import tqdm

    from portable_rl.engines.base import SamplingConfig
    from portable_rl.rl.colocation import TimeSharing
    from portable_rl.rl.metrics import MetricsWriter
    from portable_rl.rl.preemption import StopRequest
    from portable_rl.rl.roles import EngineSide, FollowerSide
    from portable_rl.rl.sync import smoothquant_for_run
    from portable_rl.rl.rollout import check_nonfinite_fraction
    from portable_rl.rl.update_survival import learner_weights

    run = setup_run(run_dir=run_dir, model_path=model_path, task=task, algorithm=algorithm,
                    optimizer_factory=optimizer_factory, correction=correction, eval_size=eval_size,
                    keep_checkpoints=keep_checkpoints, warmstart_fn=warmstart_fn, chat_template=chat_template,
                    param_dtype=param_dtype, master_dtype=master_dtype, compute_dtype=compute_dtype, mesh=mesh,
                    attention_impl=attention_impl, pack_sequences=pack_sequences, share_prompts=share_prompts,
                    max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                    logprob_chunk_tokens=logprob_chunk_tokens, remat=remat, memory_plan=memory_plan,
                    update_survival_stride=update_survival_stride)
    cfg, procs, codec, budget = run.cfg, run.procs, run.codec, run.budget
    model, model_config, optimizer, learner, ckpts = run.model, run.model_config, run.optimizer, run.learner, run.ckpts
    start_step, held_out, run_dir = run.start_step, run.held_out, run.run_dir
    timeshare = TimeSharing(enabled=budget is not None and budget.sleep_engine, async_rollouts=async_rollouts)
    # Installed before the engine starts: a SIGTERM from here on stops the run after its next complete step.
    with StopRequest() as stop:
        if procs.is_driver:  # the engine, the task draws, evaluation and the logs (rl/roles.py)
            side = EngineSide(
                writer=MetricsWriter(run_dir, resume_step=start_step if start_step else -1),  # fresh run: clear rows
                engine=engine_factory(model_path=model_path, **(budget.engine_kwargs() if budget else {})),
                codec=codec, task=task, reward_fn=run.reward_fn,
                cfg=cfg, seed=seed, held_out=held_out,
                probe_ids=[codec.encode_prompt(e.prompt) for e in held_out[:probe_prompts]],
                greedy=SamplingConfig(temperature=0.0, n=1, max_tokens=eval_max_tokens or cfg.max_response_tokens,
                                      stop_token_ids=(codec.eos_id,)),
                async_rollouts=async_rollouts, procs=procs,
                mismatch_split=mismatch_split)
        else:  # receives the driver's batches and joins every collective
            side = FollowerSide(procs, cfg=cfg, pad_id=codec.pad_id)
        timeshare.attach(getattr(side, "engine", None))  # only the engine's owner sleeps and wakes it
        engine_quantization = procs.broadcast(getattr(getattr(side, "engine", None), "quantization", None))
        if isinstance(side, FollowerSide):  # its share of the push quantizes as the driver's does
            side.engine_quantization = engine_quantization
        side.smoothing = smoothquant_for_run(smoothquant_alpha, model=model, codec=codec, task=task, run_dir=run_dir,
                                             engine_quantization=engine_quantization, procs=procs)
        survival = run.survival
        if survival:  # every process computes it (the tracked weights are sharded like the params)
            survival.serving(engine_quantization if side.smoothing is None else f"{engine_quantization}+smoothquant")
            if survival.note and procs.is_driver:
                print(survival.note, flush=True)
        rows = []
        try:
            t_sync = time.perf_counter()
            if survival:  # the weights of the first push: the reference of the next one
                survival.measure(learner_weights(model, optimizer))
            if start_step or side.smoothing is not None:  # the engine loaded the starting checkpoint unsmoothed;
                side.push(model, model_config)              # give it the restored (or smoothed) policy
            if not start_step:
                rows.append(side.write(0, {**side.heldout(), "time/sync": time.perf_counter() - t_sync}))
            last_heldout = rows[-1].get("accuracy/heldout", float("nan")) if rows else float("nan")
            bar = tqdm(range(start_step + 1, train_steps + 1), initial=start_step, total=train_steps,
                       desc="train", disable=not progress or not procs.is_driver, dynamic_ncols=True)
            for step in bar:
                t0 = time.perf_counter()
                # The same batch and step metrics on every process (the driver's broadcast).
                batch, m, gen_seconds = side.rollouts(step, prefetch_next=step < train_steps and not stop.requested)
                # NaN/inf rollout logprobs are masked out of the loss; too many mean a broken engine: stop.
                check_nonfinite_fraction(m, cfg.max_nonfinite_fraction)
                timeshare.learner_phase()  # sleep_engine: the engine's memory is the learner's until the push
                t1 = time.perf_counter()
                if batch is not None:
                    prepared = learner.prepare(batch)   # old logprobs (none in bypass), rollout correction, micro-batches
                    m.update(prepared.metrics)
                    t2 = time.perf_counter()
                    m.update(learner.update(prepared))
                else:  # every group had equal rewards in every draw: nothing to learn from this step
                    t2 = time.perf_counter()
                t3 = time.perf_counter()
                side.wait_rollouts()  # async: the engine must be idle before its weights change
                timeshare.push_phase()  # weights back for the push; the KV cache only after it
                t_push = time.perf_counter()
                side.push(model, model_config)
                t4 = time.perf_counter()
                if survival:  # of the weights just pushed; outside time/sync and time/wait_rollouts
                    m.update(survival.measure(learner_weights(model, optimizer)))
                    m["time/update_survival"] = time.perf_counter() - t4
                timeshare.generate_phase()
                if probe_prompts:
                    m.update(side.probe(learner))
                if eval_every and (step % eval_every == 0 or step == train_steps):
                    m.update(side.heldout())
                m.update({"time/generate": gen_seconds, "time/logprob": t2 - t1, "time/train": t3 - t2,
                          "time/sync": t4 - t_push, "time/step": time.perf_counter() - t0})
                m.update(timeshare.metrics())
                if async_rollouts:  # time the main thread sat idle waiting for rollouts
                    m["time/wait_rollouts"] = (t1 - t0) + (t_push - t3)
                rows.append(side.write(step, m))
                last_heldout = m.get("accuracy/heldout", last_heldout)
                bar.set_postfix(reward=f"{m['reward/mean']:.2f}", heldout_acc=f"{last_heldout:.2f}")
                stop_now = procs.any(stop.requested)  # a SIGTERM on any process stops all at this step
                if step % checkpoint_every == 0 or step == train_steps or stop_now:
                    ckpts.save(step, model, optimizer, extra={"seed": seed, "model_path": str(model_path)})
                if stop_now:
                    print(f"[train] stopped after step {step} (checkpoint saved); rerun the same command to "
                          "resume", flush=True)
                    break
            ckpts.close()
        finally:
            side.close()
    side.plots(run_dir)
    return rows


def main(configured_train: Callable = train):
    from portable_rl import gin_utils
    from portable_rl.rl.multihost import Processes

    budget = gin_utils.memory_budget()  # gin/colocate.gin; decided before JAX starts its devices
    driver = Processes.current().is_driver  # the run directory's files are written once, by process 0
    run_dir = gin_utils.query_value("train.run_dir")
    if driver:
        gin_utils.write_config(run_dir, "config.gin")
    rows = configured_train(memory_plan=budget) if budget is not None else configured_train()
    if driver:
        gin_utils.write_config(run_dir, "operative_config.gin", operative=True)
    last = rows[-1] if rows else {}
    print(f"[train] done: {run_dir} (step {last.get('step')}, held-out accuracy {last.get('accuracy/heldout')})")


def cli(argv=None):
    """Console entry point: parses --gin_file / --gin.NAME=VALUE flags and runs `train`. Joins the other JAX
    processes first when the environment names them (`portable_rl.launch`, docs/scaling.md)."""
    from portable_rl.engines.cpu_features import prefer_passive_omp_waits

    prefer_passive_omp_waits()  # before anything below imports torch
    from portable_rl import gin_utils
    from portable_rl.launch import fail_fast, initialize_from_environment
    from portable_rl.warmstart import warmstart

    several = initialize_from_environment()
    configured = gin_utils.register_configurable(train, name="train")
    gin_utils.register_configurable(warmstart, name="warmstart")  # the default run's train.warmstart_fn
    run = lambda: gin_utils.run(lambda: main(configured), argv, description=__doc__.splitlines()[0])  # noqa: E731
    fail_fast(run) if several else run()  # several processes: an error must not wait for the others


if __name__ == "__main__":
    cli()
