"""Process helpers for tests that launch and kill runs."""

import os
import subprocess
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
