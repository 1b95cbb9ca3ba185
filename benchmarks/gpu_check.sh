#!/usr/bin/env bash
# One short GPU check (H100 / H200; no network, no vLLM/SGLang needed), under 5 minutes: the learner's MFU,
# tokens/s, predicted and measured peak memory and compile time as the recipes run it (cuDNN / blockwise
# attention, packed rows, micro-batches, chunked logprob head, bf16 params with f32 masters; a ~1B model at
# 8 and 16 x 2048 tokens and a Qwen2.5-7B-wide layer stack cut to fit), then the quantize-and-push path
# (learner-side INT8 / FP8 quantizer GB/s, every DLPack hand-off counted). benchmarks/gpu_check.py says what
# each number is. Results: $OUT/gpu_check.json (or --out DIR, or ./) and a line per part on stdout.
#
#   bash benchmarks/gpu_check.sh                  # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run        # CPU, tiny model: rehearses every part
#   bash benchmarks/gpu_check.sh --colocation     # also the colocated learner + engine smoke test (+150 s)
# Other arguments go to `python -m benchmarks.gpu_check` (--arms, --budget_s, --reps, --peak_tflops).
set -euo pipefail
cd "$(dirname "$0")/.."
# The project without installing anything: its root on the import path (no network needed).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
"$PY" -c "import jax, flax, optax, torch" 2>/dev/null || {
  echo "gpu_check.sh: $PY cannot import jax, flax, optax and torch; set PYTHON=/path/to/python" >&2; exit 2; }
check_args=(); colocation_args=(); colocation=0; dry_run=0; prev=""
for arg in "$@"; do
  case "$arg" in
    --colocation) colocation=1 ;;
    --dry-run) check_args+=("$arg"); colocation_args+=(--dry-run); dry_run=1 ;;
    --out=*) check_args+=("$arg"); colocation_args+=("$arg") ;;
    *) check_args+=("$arg") ;;
  esac
  if [ "$prev" = "--out" ]; then colocation_args+=(--out "$arg"); fi
  prev="$arg"
done
if [ "$dry_run" = 0 ]; then
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
fi
# The check stops starting arms at its --budget_s (290 s; the push may run 50 s past it); this limit is for
# a hang. A dry run on a busy 2-core CPU compiles slower.
t_check=360; t_colocation=150
if [ "$dry_run" = 1 ]; then t_check=900; t_colocation=290; fi
status=0
timeout "$t_check" "$PY" -m benchmarks.gpu_check "${check_args[@]}" || status=$?
if [ "$colocation" = 1 ]; then
  timeout "$t_colocation" "$PY" -m benchmarks.colocation_check --vllm "${colocation_args[@]}" || status=$?
fi
exit "$status"
