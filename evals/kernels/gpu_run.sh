#!/usr/bin/env bash
# The WNA16 kernel checks and benchmarks on a GPU (written for one H200 call of at most 10 minutes):
#
#   OUT=/some/dir bash evals/kernels/gpu_run.sh            # all stages
#   STAGES="test quick" OUT=... bash evals/kernels/gpu_run.sh
#
# Stages (each under its own time limit, so one slow stage cannot eat the others; a failed stage is
# recorded in $OUT/status.txt and the next one still runs):
#   test   pytest of the device tests (compiled kernels vs the fp32 reference on real shapes, every
#          algorithm, CUDA-graph replay, torch.compile) and of test_wna16_triton.py, which runs its
#          scheme x dtype x M matrix on the device when CUDA is present
#   quick  bench_wna16.py --quick: 3 shapes x M 1,4,16,512 x W4 g128 / W8 channel, quantkit vs cuBLAS
#          bf16 vs tinygemm vs gemlite (when installed), cold weights, CUDA-graph replays
#   full   8 decode shapes of Llama-3-8B/70B x M 1..2048, W4 g128 and W8 per channel (same columns)
#   sweep  --sweep on two shapes: every alternative launch configuration next to the rule's pick,
#          to refit quantkit/kernels/wna16_heuristics.py
# Writes $OUT/<stage>/bench_wna16.{json,md}, $OUT/<stage>.log, $OUT/env.txt, $OUT/status.txt.
#
# Installs quantkit without dependencies and without network; installs gemlite only if its wheel or
# sdist was carried in $WHEELS (default shared/wheels); otherwise the gemlite column says "skipped".
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-evals/kernels/gpu}
PY=${PYTHON:-python3}
STAGES=${STAGES:-test quick full sweep}
WHEELS=${WHEELS:-shared/wheels}
mkdir -p "$OUT"
: > "$OUT/status.txt"

if ! "$PY" -c "import quantkit.kernels" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
fi
if ! "$PY" -c "import gemlite" 2>/dev/null; then
  for f in "$WHEELS"/gemlite*; do
    [ -e "$f" ] && "$PY" -m pip install -q --no-deps --no-build-isolation --no-index "$f" >/dev/null 2>&1 && break
  done
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  "$PY" -c "import gemlite; print('gemlite', gemlite.__version__)" 2>/dev/null || echo "gemlite: not installed"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

run_stage() {  # name, seconds, command... (output to $OUT/<name>.log and the terminal)
  local name=$1 limit=$2; shift 2
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$OUT/status.txt"
}

BENCH=evals/kernels/bench_wna16.py
run_stage test 150 "$PY" -m pytest -q tests/kernels/test_wna16_gpu.py tests/kernels/test_wna16_triton.py \
  -p no:cacheprovider
run_stage quick 120 "$PY" $BENCH --out "$OUT/quick" --quick --schemes w4g128,w8ch
run_stage full 220 "$PY" $BENCH --out "$OUT/full" --schemes w4g128,w8ch --reps 20
run_stage sweep 90 "$PY" $BENCH --out "$OUT/sweep" --backends triton --schemes w4g128 \
  --shapes 8192x8192,4096x4096 --ms 1,2,4,8,16,64,512 --sweep --reps 10
cat "$OUT/status.txt"
