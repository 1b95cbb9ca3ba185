#!/usr/bin/env bash
# One short GPU check for a lent H200 (no network, no vLLM/SGLang needed): learner MFU of a ~1B Qwen2-like
# model in bf16, zero-copy DLPack JAX -> torch on the GPU, trainer-side FP8 quantizer GB/s.
# Results: $OUT/gpu_check.json (or ./gpu_check.json) and stdout. Total runtime < 5 min.
#
#   bash benchmarks/gpu_check.sh              # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run    # CPU, tiny model: checks that the script runs
set -euo pipefail
cd "$(dirname "$0")/.."
# The project without installing anything: its root on the import path (no network needed).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
"$PY" -c "import jax, flax, optax, torch" 2>/dev/null || {
  echo "gpu_check.sh: $PY cannot import jax, flax, optax and torch; set PYTHON=/path/to/python" >&2; exit 2; }
if [[ " $* " != *" --dry-run "* ]]; then
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
fi
exec timeout 290 "$PY" benchmarks/gpu_check.py "$@"
