"""Per-step metrics: one JSON object per line in `metrics.jsonl`, mirrored to TensorBoard.

On resume from a checkpoint at step s, rows with `step > s` (written after that checkpoint by the
interrupted run) are dropped first, so the file always reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _clean(v):
    v = float(v)
    return v if math.isfinite(v) else None


def read_metrics(path: str | os.PathLike) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsWriter:
    def __init__(self, run_dir: str | os.PathLike, *, resume_step: int = 0, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            # purge_step drops events the interrupted run logged after the checkpoint.
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1)

    def write(self, step: int, metrics: dict) -> dict:
        row = {"step": int(step), **{k: _clean(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and v is not None:
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        return row

    def close(self):
        if self._tb is not None:
            self._tb.close()
