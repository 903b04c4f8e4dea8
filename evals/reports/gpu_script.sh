#!/usr/bin/env bash
# The GPU speed report in one short run (a few minutes on an H200): a random-initialised Llama-3-8B-shaped
# model (16 GB of bf16 weights, so decode streams far more than the 60 MB L2) in bf16 against W8, W4,
# an FP8 KV cache and W4 + FP8 KV; TTFT over prompt lengths, TPOT over context lengths and batch
# sizes (one decode step with a pre-filled static cache, replayed as a CUDA graph), against the
# roofline of the probed device (copy bandwidth and bf16 matmul rate measured at the start).
#
#   bash evals/reports/gpu_script.sh [OUT_DIR]        # from anywhere; default OUT_DIR evals/reports/gpu
#
# Writes OUT_DIR/{bench.json, report.md, report.json, *.png}. Needs torch with CUDA, transformers
# and matplotlib; installs quantkit itself (no dependencies, no network) when it is not importable.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-evals/reports/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

if ! "$PY" -c "import quantkit.eval.timing, quantkit.kernels" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

# The FP8 KV-cache variants only where this build has the kv-fp8 recipe.
VARIANTS=w8a16-rtn,w4a16-rtn
if "$PY" -c "import quantkit; quantkit.load_recipe('kv-fp8'); import quantkit.modules.kv_cache" 2>/dev/null; then
  VARIANTS=$VARIANTS,kv-fp8,w4a16-rtn+kv-fp8
fi

# Overridable for a dry run elsewhere (e.g. DEVICE=cpu CONFIG=<small config> PROMPTS=16 CONTEXTS=16 BATCHES=1).
CONFIG=${CONFIG:-evals/configs/llama-8b-random.json}
DEVICE=${DEVICE:-cuda}
PROMPTS=${PROMPTS:-128,512,1024,2048,4096}
CONTEXTS=${CONTEXTS:-128,1024,4096}
BATCHES=${BATCHES:-1,8,32,64}
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)

"$PY" -m quantkit.cli bench "$CONFIG" --device "$DEVICE" --dtype bf16 \
  --variants "$VARIANTS" --backend auto \
  --prompt-lens "$PROMPTS" --context-lens "$CONTEXTS" --batch-sizes "$BATCHES" \
  --warmup 3 --repeats 10 --max-cache-gb 40 --gpu probe --json "$OUT/bench.json"

"$PY" -m quantkit.cli report --bench "$OUT/bench.json" --out "$OUT" --force \
  --title "quantkit on ${GPU_NAME:-$DEVICE}: prefill versus decode" \
  --note "Speed of a random-initialised Llama-architecture model ($CONFIG): weights are random, so this measures speed only; quality is in the CPU report (evals/reports/cpu)." \
  --note "Reproduce: \`bash evals/reports/gpu_script.sh\`."
echo "report: $OUT/report.md"
