#!/usr/bin/env bash
# The GPU speed report in one call (budget: 8 minutes on an H200): a random-initialised Llama-3-8B-shaped
# model (16 GB of bf16 weights, so decode streams far more than the 60 MB L2) in bf16 against W8, W4,
# an FP8 KV cache and W4 + FP8 KV. Every variant alike, baseline included, runs its decode step through
# torch.compile (inductor) and replays it as a CUDA graph with a pre-filled static cache; the report
# gives TTFT, TPOT, and the achieved bandwidth of each decode step (bytes it must read / TPOT, and its
# share of the copy bandwidth probed at the start).
#
#   bash evals/reports/gpu_script.sh [OUT_DIR]     # default: $OUT if set (device tool), else evals/reports/gpu
#
# Runs, each under its own time limit so that a slow compile loses only its own part:
#   1. compiled: bf16, W8, W4              -> OUT/compiled/{bench.json, report.md, *.png}   (the headline)
#   2. compiled: bf16, FP8 KV, W4 + FP8 KV -> OUT/compiled-kv/...  (only where this build has kv-fp8)
#   3. eager (CUDA graphs, no compile): every variant, for the compiled-over-eager comparison -> OUT/eager/...
# Installs quantkit itself first (no dependencies, no network). Log: OUT/gpu_script.log.
#
# Overridable for a dry run elsewhere (tests/test_gpu_script.py runs it on CPU with a tiny model):
# CONFIG, DEVICE, PROMPTS, CONTEXTS, BATCHES, COMPILE_BACKEND, WARMUP, REPEATS, VARIANTS, KV_VARIANTS,
# LIMIT_COMPILED, LIMIT_KV, LIMIT_EAGER (seconds), ROOFLINE (a known GPU name instead of probing), PYTHON,
# SKIP_INSTALL=1.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-evals/reports/gpu}}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_script.log") 2>&1

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null || true
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

CONFIG=${CONFIG:-evals/configs/llama-8b-random.json}
DEVICE=${DEVICE:-cuda}
PROMPTS=${PROMPTS:-512,2048}
CONTEXTS=${CONTEXTS:-1024}
BATCHES=${BATCHES:-1,16}
COMPILE_BACKEND=${COMPILE_BACKEND:-inductor}
WARMUP=${WARMUP:-3}
REPEATS=${REPEATS:-10}
VARIANTS=${VARIANTS:-w8a16-rtn,w4a16-rtn}
if [ -z "${KV_VARIANTS+x}" ]; then  # the FP8 KV-cache variants only where this build has the kv-fp8 recipe
  KV_VARIANTS=""
  if "$PY" -c "import quantkit; quantkit.load_recipe('kv-fp8'); import quantkit.modules.kv_cache" 2>/dev/null; then
    KV_VARIANTS=kv-fp8,w4a16-rtn+kv-fp8
  fi
fi
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
STATUS=0

# bench NAME LIMIT_S VARIANTS [extra bench args...]: one bench + its report under OUT/NAME.
bench() {
  local name=$1 limit=$2 variants=$3
  shift 3
  local dir="$OUT/$name" start=$SECONDS
  mkdir -p "$dir"
  echo "== $name: $variants (limit ${limit}s)"
  if timeout "$limit" "$PY" -m quantkit.commands.cli bench "$CONFIG" --device "$DEVICE" --dtype bf16 \
      --variants "$variants" --backend auto --prompt-lens "$PROMPTS" --context-lens "$CONTEXTS" \
      --batch-sizes "$BATCHES" --warmup "$WARMUP" --repeats "$REPEATS" --gpu "${ROOFLINE:-probe}" --quiet \
      --json "$dir/bench.json" "$@"; then
    "$PY" -m quantkit.commands.cli report --bench "$dir/bench.json" --out "$dir" --force \
      --title "quantkit on ${GPU_NAME:-$DEVICE}: $name" \
      --note "Speed of a random-initialised Llama-architecture model ($CONFIG): weights are random, so this measures speed only; quality is in the CPU report (evals/reports/cpu)." \
      --note "Reproduce: \`bash evals/reports/gpu_script.sh\` (part \"$name\")." || STATUS=1
  else
    echo "!! $name: failed or ran past ${limit}s; the other parts still run"
    STATUS=1
  fi
  echo "== $name: $((SECONDS - start)) s"
}

bench compiled "${LIMIT_COMPILED:-270}" "$VARIANTS" --compile decode --compile-backend "$COMPILE_BACKEND"
if [ -n "$KV_VARIANTS" ]; then
  bench compiled-kv "${LIMIT_KV:-120}" "$KV_VARIANTS" --compile decode --compile-backend "$COMPILE_BACKEND"
fi
bench eager "${LIMIT_EAGER:-60}" "$VARIANTS${KV_VARIANTS:+,$KV_VARIANTS}"
echo "total: $SECONDS s; reports under $OUT"
exit $STATUS
