#!/usr/bin/env bash
# INT8 rollout speed measured the way rollouts decode (issue 50): `benchmarks/rollout.py --decode` with every
# arm (fp32, bf16, fp8_per_channel, int8_per_channel with the glue dtype the adapter picks on this CPU) at
# three sizes, one after another on the same box:
#   SmolLM2-135M-Instruct (the real model), a random Qwen2 slice at d 2048 (8 layers, SwiGLU 5632) and a
#   Llama-2-7B-wide one (d 4096, 4 layers, SwiGLU 11008);
# each with 32 prompts of 100-300 tokens, exactly 256 generated tokens per prompt, a warm-up round and 5
# rotated repetitions (rollout.py's module doc has the formulas). One raw file per size:
#   $OUT/<date>_<cpu>_{smollm2,d2048,d4096}.json      (OUT default docs/data/rollout_decode)
#
#   bash benchmarks/rollout_decode.sh         # from the repository root, on an otherwise idle machine
#   ARMS="fp32 bf16 int8_per_channel int8_per_channel_fp32" bash benchmarks/rollout_decode.sh   # other arms
#   SIZES="smollm2" REPS=2 bash benchmarks/rollout_decode.sh                                      # a subset
#   SIZES=smollm2 OUT=/tmp/r bash benchmarks/rollout_decode.sh --prompts 2 --max-tokens 8 --reps 1   # rehearsal
# Arguments go to every `python -m benchmarks.rollout --decode` call, after (so overriding) the ones above.
# Wall time on an idle 2-core Zen 4 (2026-12-07): 14 min SmolLM2, 25 min d 2048, 44 min d 4096 (1.4 h in all).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
ARMS="${ARMS:-fp32 bf16 fp8_per_channel int8_per_channel}"
SIZES="${SIZES:-smollm2 d2048 d4096}"
REPS="${REPS:-5}"
OUT="${OUT:-docs/data/rollout_decode}"
WORKDIR="${WORKDIR:-/tmp/rollout_decode}"  # the random slices' checkpoints (d 4096: 1.7 GB), reused if there
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | tr 'A-Z' 'a-z' | sed 's/([a-z]*)//g; s/[^a-z0-9]\+/-/g; s/^-//; s/-$//')
prefix="$OUT/$(date -u +%F)_${cpu:-cpu}"
echo "rollout_decode.sh: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg) (a shared or busy box makes" \
     "the timings meaningless; the load is recorded in each file); results: ${prefix}_<size>.json" >&2
for size in $SIZES; do
  case "$size" in
    smollm2) "$PY" -m portable_rl.convert.gguf checkpoints/smollm2-135m-instruct >&2  # once, ~30 s
             model=(--model checkpoints/smollm2-135m-instruct) ;;
    d2048) model=(--layers 8 --hidden 2048 --intermediate 5632) ;;
    d4096) model=(--layers 4 --hidden 4096 --intermediate 11008) ;;
    *) echo "rollout_decode.sh: unknown size $size (smollm2, d2048, d4096)" >&2; exit 2 ;;
  esac
  # shellcheck disable=SC2086  # ARMS is a word list
  "$PY" -m benchmarks.rollout --decode "${model[@]}" --prompts 32 --max-tokens 256 --prompt-len 100 300 \
      --reps "$REPS" --arms $ARMS --workdir "$WORKDIR" --out "${prefix}_${size}.json" "$@"
done
