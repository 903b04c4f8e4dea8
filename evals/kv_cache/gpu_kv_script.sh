#!/usr/bin/env bash
# The FP8 KV-cache GPU checks in one call (about 5 minutes on an H200; every stage has a time limit):
#
#   1. the GPU tests of the decode-attention and cache-write kernels and of the static FP8 cache
#      (CUDA-graph capture of a decode step included);
#   2. decode attention alone, FP8 vs SDPA on bf16, contexts 1k-128k at batch 1 and 8, with a sweep of
#      launch parameters around the rule (evals/kv_cache/gpu_bench.py);
#   3. end to end on a random Llama-3.1-8B (131072 positions): TPOT of bf16, kv-fp8, W4 and W4 + kv-fp8
#      at contexts 1k and 32k, batch 1 and 8, every decode step on a static cache replayed as a CUDA
#      graph (quantkit bench), and its report.
#
#   OUT=/some/dir bash evals/kv_cache/gpu_kv_script.sh     # default OUT: evals/kv_cache/results-gpu
#
# Writes OUT/{gpu_tests.txt, gpu_bench.{json,md}, bench.json, report/}. Needs torch with CUDA,
# transformers and pytest; installs quantkit itself (no dependencies, no network) when it is not importable.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-evals/kv_cache/results-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
status=0

if ! "$PY" -c "import quantkit.modules.kv_cache, quantkit.kernels" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

echo "== 1. GPU tests"
timeout 70 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels/test_kv_cache_write.py \
  tests/kernels/test_decode_attention.py tests/test_kv_cache_static.py \
  -k "reference_codes or kernel_matches or static_cache_length or fully_masked or cuda_graph" \
  > "$OUT/gpu_tests.txt" 2>&1 || status=1
tail -3 "$OUT/gpu_tests.txt"

echo "== 2. decode attention: FP8 vs SDPA bf16, 1k-128k, launch sweep"
timeout 120 "$PY" evals/kv_cache/gpu_bench.py --sweep --out "$OUT" > "$OUT/gpu_bench.log" 2>&1 || status=1
head -30 "$OUT/gpu_bench.md" 2>/dev/null || tail -20 "$OUT/gpu_bench.log"

echo "== 3. end to end: random Llama-3.1-8B, contexts 1k and 32k, batch 1 and 8"
timeout 170 "$PY" -m quantkit.commands.cli bench evals/configs/llama-3.1-8b-random.json --device cuda --dtype bf16 \
  --variants kv-fp8,w4a16-rtn,w4a16-rtn+kv-fp8 --backend auto \
  --prompt-lens 512 --context-lens 1024,32768 --batch-sizes 1,8 \
  --warmup 2 --repeats 5 --max-cache-gb 40 --gpu probe --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1 || status=1
tail -25 "$OUT/bench.log"
if [ -f "$OUT/bench.json" ]; then
  "$PY" -m quantkit.commands.cli report --bench "$OUT/bench.json" --out "$OUT/report" --force \
    --title "FP8 KV cache on ${GPU_NAME:-the GPU}: decode at 1k and 32k context" \
    --note "Random-initialised Llama-3.1-8B shape (evals/configs/llama-3.1-8b-random.json): speed only." \
    --note "Reproduce: \`bash evals/kv_cache/gpu_kv_script.sh\`." > "$OUT/report.log" 2>&1 || status=1
fi
exit $status
