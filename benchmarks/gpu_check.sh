#!/usr/bin/env bash
# One short GPU check for a lent H200 (no network, no vLLM/SGLang needed): learner MFU of a ~1B Qwen2-like
# model in bf16, zero-copy DLPack JAX -> torch on the GPU, trainer-side FP8 and INT8 quantizer GB/s; then the
# colocated smoke test (python -m benchmarks.colocation_check): a JAX learner step and a torch process holding the
# memory plan's engine share on the same GPU, time-shared (sleep -> learner -> wake weights -> push -> wake KV
# cache), both peaks against the plan's prediction; the same with a real vLLM engine where vLLM is installed.
# Results: $OUT/gpu_check.json and $OUT/colocation_check.json (or ./) and stdout. Total runtime < 5 min.
#
#   bash benchmarks/gpu_check.sh              # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run    # CPU, tiny model: checks that the script runs
set -euo pipefail
cd "$(dirname "$0")/.."
# The project without installing anything: its root on the import path (no network needed; `python -m`
# puts it there too, this covers PYTHONSAFEPATH).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
"$PY" -c "import jax, flax, optax, torch" 2>/dev/null || {
  echo "gpu_check.sh: $PY cannot import jax, flax, optax and torch; set PYTHON=/path/to/python" >&2; exit 2; }
if [[ " $* " != *" --dry-run "* ]]; then
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
fi
colocation_args=()  # the colocation check takes --dry-run and --out of this script's arguments
prev=""; dry_run=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) colocation_args+=(--dry-run); dry_run=1 ;;
    --out=*) colocation_args+=("$arg") ;;
  esac
  if [ "$prev" = "--out" ]; then colocation_args+=(--out "$arg"); fi
  prev="$arg"
done
# On the GPU both fit in 5 min (140 + 150 s); a dry run on a busy CPU gets longer.
t_check=140; t_colocation=150
if [ "$dry_run" = 1 ]; then t_check=290; t_colocation=290; fi
status=0
timeout "$t_check" "$PY" -m benchmarks.gpu_check "$@" || status=$?
timeout "$t_colocation" "$PY" -m benchmarks.colocation_check --vllm "${colocation_args[@]}" || status=$?
exit "$status"
