"""The SQL recipe's three rollout arms (docs/experiments/environments.md): held-out accuracy at steps 0 and 10,
gain, mismatch (k3 overall, k1 per turn) and the mean train-accuracy curve, from the committed metrics.
    python docs/data/environments_sql/arms.py"""
import json
import pathlib
import statistics as st

HERE = pathlib.Path(__file__).parent
ARMS = {"bf16": "sql_bf16none_s{}", "FP8, no correction": "sql_fp8none_s{}", "FP8 + sequence TIS": "sql_s{}"}
EVAL_SIZE = 32

for arm, pattern in ARMS.items():
    runs = []
    for seed in (0, 1, 2):
        rows = {r["step"]: r for r in map(json.loads, (HERE / f"{pattern.format(seed)}_metrics.jsonl").open())}
        updated = [rows[s] for s in range(1, 11) if "tis/k3_kl" in rows[s]]  # a step with no kept group has no update
        per_turn = {}
        for r in updated:
            for key, value in r.items():
                if key.startswith("tis/kl/turn_"):
                    per_turn.setdefault(int(key.rsplit("_", 1)[1]), []).append(value)
        runs.append(dict(start=round(rows[0]["accuracy/heldout"] * EVAL_SIZE), end=round(rows[10]["accuracy/heldout"] * EVAL_SIZE),
                         train=[rows[s]["accuracy/train"] for s in range(1, 11)],
                         k3=st.mean(r["tis/k3_kl"] for r in updated),
                         per_turn={k: st.mean(v) for k, v in sorted(per_turn.items())}))
    finals = [100 * r["end"] / EVAL_SIZE for r in runs]
    gains = [100 * (r["end"] - r["start"]) / EVAL_SIZE for r in runs]
    turns = sorted({k for r in runs for k in r["per_turn"]})
    print(f"{arm}: " + ", ".join(f"{r['start']} -> {r['end']}" for r in runs)
          + f"; final {st.mean(finals):.1f} % ({min(finals):.0f}-{max(finals):.0f}),"
          f" gain {st.mean(gains):+.1f} pts ({min(gains):+.0f}..{max(gains):+.0f}),"
          f" k3 {st.mean(r['k3'] for r in runs):.4f}, k1 per turn "
          + " / ".join(f"{st.mean(r['per_turn'][k] for r in runs if k in r['per_turn']):.4f}" for k in turns))
    print("  train accuracy by step: " + " ".join(f"{st.mean(r['train'][i] for r in runs):.2f}" for i in range(10)))
