"""Process helpers for tests that launch and kill runs."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def alive(pid: int) -> bool:
    """True while a process with `pid` exists (a zombie counts until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run_from_root(cmd, timeout, **env) -> str:
    """Runs `cmd` from the repository root with the root on PYTHONPATH (as `python -m benchmarks.X` runs there),
    asserts it exits 0 and returns its stdout."""
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def run_warmstart(model_path, *overrides, timeout=900) -> Path:
    """The default run's warm start (`python -m portable_rl.warmstart --gin_file=gin/warmstart.gin`) into
    `model_path`, with gin `overrides` (e.g. "--gin.WARMSTART_STEPS=40"); asserts it exits 0."""
    proc = subprocess.run([sys.executable, "-m", "portable_rl.warmstart", "--gin_file=gin/warmstart.gin",
                           f"--gin.MODEL_PATH='{model_path}'", "--gin.warmstart.progress=False", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(model_path)
