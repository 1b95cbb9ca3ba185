"""PNG curves from metrics.jsonl: reward.png, accuracy.png, mismatch.png, sync.png (matplotlib, Agg backend)."""

from __future__ import annotations

import os
from pathlib import Path

from portable_rl.rl.metrics import read_metrics

# (file, title, [(metric key, label)])
PLOTS = [
    ("reward.png", "Reward", [("reward/mean", "train reward (mean)"), ("reward/shaped_mean", "shaped reward")]),
    ("accuracy.png", "Accuracy", [("accuracy/train", "train batch (sampled)"),
                                  ("accuracy/heldout", "held-out (greedy)")]),
    ("mismatch.png", "Rollout/learner mismatch", [("tis/kl", "KL k1 (rollout||train)"),
                                                   ("tis/k3_kl", "KL k3"),
                                                   ("tis/log_ppl_abs_diff", "|log ppl diff|"),
                                                   ("tis/clipped_frac", "TIS clipped fraction"),
                                                   ("probe/kl", "post-sync probe KL")]),
    ("sync.png", "Did the update reach the engine? (rl/update_survival.py)",
     [("sync/quantized_changed_frac", "served weights changed (fraction)"),
      ("sync/update_lost_frac", "update lost, this push"),
      ("sync/cumulative_update_lost_frac", "update lost, since the first push"),
      ("sync/bf16_update_lost_frac", "lost to the bf16 push alone")]),
]


def write_plots(run_dir: str | os.PathLike, rows: list[dict] | None = None) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl") if rows is None else rows
    written = []
    for fname, title, series in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in series:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, ms=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
        out = run_dir / fname
        fig.tight_layout()
        fig.savefig(out, dpi=100)
        plt.close(fig)
        written.append(out)
    return written
