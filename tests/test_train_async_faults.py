"""Async rollouts and fault handling, through the CLI as a user runs it (real vLLM-CPU FP8 engine).

* async: `rl.RunConfig.async_rollouts=True` (generation of step k+1 overlaps training on step k) still learns the
  default task from the default warm start.
* SIGTERM: the run finishes its step, checkpoints it, exits 0; the same command resumes.
* kill -9: the same command resumes from the newest *committed* checkpoint; a partially written step
  directory (planted here, as a kill mid-save leaves one) is moved aside, never restored.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from processes import run_warmstart

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parent.parent


def _cmd(run_dir, model_path, *extra):
    return [sys.executable, "-m", "portable_rl.train", "--gin_file=gin/dapo_fp8.gin", f"--gin.RUN_DIR='{run_dir}'",
            f"--gin.MODEL_PATH='{model_path}'", *extra]


def _rows(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _committed(run_dir):
    ckpts = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit() and (p / "COMMITTED").exists())


def _start(cmd, log):
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_step(proc, run_dir, step, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r["step"] >= step for r in _rows(run_dir)):
            return
        assert proc.poll() is None, f"training exited early with {proc.returncode}"
        time.sleep(0.2)
    raise TimeoutError(f"no metrics row for step {step} after {timeout} s")


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    return run_warmstart(tmp_path_factory.mktemp("faults") / "warmstart")  # the full 1400 steps: it must learn


def test_async_rollouts_learn_the_default_task(warm_start, tmp_path):
    run = tmp_path / "async"
    proc = subprocess.run(_cmd(run, warm_start, "--gin.TRAIN_STEPS=10", "--gin.rl.RunConfig.async_rollouts=True",
                               "--gin.rl.RunConfig.eval_every=10", "--gin.rl.RunConfig.eval_size=64"),
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(11))
    before, after = rows[0]["accuracy/heldout"], rows[-1]["accuracy/heldout"]
    assert after >= before + 0.15, (before, after)
    assert all(r["time/wait_rollouts"] is not None for r in rows[1:])
    assert rows[-1]["tis/kl"] is not None  # the correction saw the one-step-stale rollouts


def test_sigterm_checkpoints_and_kill9_resumes_from_last_complete_checkpoint(warm_start, tmp_path):
    run = tmp_path / "faults"
    cmd = _cmd(run, warm_start, "--gin.TRAIN_STEPS=8", "--gin.rl.RunConfig.checkpoint_every=3",
               "--gin.rl.RunConfig.eval_every=4", "--gin.rl.RunConfig.eval_size=32")

    # 1. SIGTERM after step 2 is written: the current step finishes, is checkpointed, exit code 0.
    proc = _start(cmd, tmp_path / "run1.log")
    _wait_for_step(proc, run, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 0, (tmp_path / "run1.log").read_text()[-3000:]
    log1 = (tmp_path / "run1.log").read_text()
    stopped = _rows(run)[-1]["step"]
    assert 2 <= stopped < 8 and f"stopped after step {stopped}" in log1
    assert _committed(run)[-1] == stopped  # checkpointed off the checkpoint_every=3 schedule

    # 2. The same command resumes there; kill -9 it two steps later.
    proc = _start(cmd, tmp_path / "run2.log")
    _wait_for_step(proc, run, stopped + 2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert f"resumed from {run / 'checkpoints'} at step {stopped}" in (tmp_path / "run2.log").read_text()
    last_complete = _committed(run)[-1]

    # A kill during a save leaves a step directory without its COMMITTED marker: plant one, truncated.
    partial = run / "checkpoints" / str(last_complete + 1)
    if not partial.exists():
        partial.mkdir()
        (partial / "model").mkdir()
        (partial / "model" / "half_written").write_bytes(b"\0" * 10)

    # 3. The same command resumes from the last complete checkpoint and finishes.
    proc = _start(cmd, tmp_path / "run3.log")
    assert proc.wait(timeout=600) == 0, (tmp_path / "run3.log").read_text()[-3000:]
    log3 = (tmp_path / "run3.log").read_text()
    assert f"at step {last_complete}" in log3
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(9))  # one row per step, none duplicated or lost
    assert not partial.exists() and list((run / "checkpoints").glob(f"incomplete-{last_complete + 1}-*"))
    assert _committed(run)[-1] == 8
