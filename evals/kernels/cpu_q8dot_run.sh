#!/usr/bin/env bash
# The CPU decode benchmarks of quantkit::wna16_cpu_q8dot, in one run on one machine:
#   1. per-layer GB/s vs the copy bandwidth (bench_cpu_q8dot.py);
#   2. `quantkit bench` of the demo's speed model (float vs W8 vs W4, batch 1), with quantkit's C++ kernel
#      and with PyTorch's kernels (QUANTKIT_CPU_KERNELS=0: the previous CPU path);
#   3. SmolLM2-135M-Instruct: quantkit W4 / W8 (both paths) and llama.cpp's llama-bench of Q4_0 / Q8_0 / BF16.
# Timed parts run under SCHED_FIFO (chrt -f 10) on a shared machine.
#   FLOAT=/path/to/smollm2-float LLAMA=/path/to/llama.cpp/build/bin GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf \
#     bash evals/kernels/cpu_q8dot_run.sh OUT_DIR WORK_DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-evals/kernels/cpu_q8dot}; WORK=${2:-/tmp/cpu_q8dot}
PY=${PY:-python}; QK=${QK:-quantkit}; RT=(chrt -f 10)
mkdir -p "$OUT" "$WORK"
log() { echo "[$(date -u +%H:%M:%S)] $*"; }

if [ -z "${SKIP_SPEED:-}" ]; then
log "per-layer GEMV"
"$PY" evals/kernels/bench_cpu_q8dot.py --out "$OUT" --realtime --isa avx2 --repeats 5 --rounds 3

log "speed model"
"$PY" -c "import json; from quantkit.harness.speed_model import bandwidth_bound_config, last_level_cache; print(json.dumps(bandwidth_bound_config(last_level_cache().bytes)))" > "$WORK/speed-model.json"
for kern in 1 0; do
  QUANTKIT_CPU_KERNELS=$kern "${RT[@]}" "$QK" bench "$WORK/speed-model.json" --variants w8a16-rtn,w4a16-rtn --device cpu \
    --prompt-lens 128 --context-lens 128 --batch-sizes 1 --repeats 9 --threads 2 --json "$OUT/speed_model_kernels$kern.json" \
    | tee "$OUT/speed_model_kernels$kern.txt"
done
fi

if [ -n "${FLOAT:-}" ]; then
  log "SmolLM2-135M: quantkit"
  # groups of 64 (128 does not divide 576, and one scheme for all linears keeps the roofline defined):
  # 4.5 bits per weight in the kernel's layout, as llama.cpp's Q4_0
  W4=evals/kernels/cpu_q8dot/w4a16-g64-rtn.yaml
  [ -d "$WORK/smollm2-w4a16-rtn" ] || "$QK" quantize "$FLOAT" --recipe $W4 --out "$WORK/smollm2-w4a16-rtn" >/dev/null
  [ -d "$WORK/smollm2-w8a16-rtn" ] || "$QK" quantize "$FLOAT" --recipe w8a16-rtn --out "$WORK/smollm2-w8a16-rtn" >/dev/null
  for kern in 1 0; do
    QUANTKIT_CPU_KERNELS=$kern "${RT[@]}" "$QK" bench "$FLOAT" --variants "$WORK/smollm2-w4a16-rtn,$WORK/smollm2-w8a16-rtn" \
      --device cpu --dtype bf16 --prompt-lens 32 --context-lens 64 --batch-sizes 1 --repeats 9 --threads 2 \
      --json "$OUT/smollm2_kernels$kern.json" | tee "$OUT/smollm2_kernels$kern.txt"
  done
fi
if [ -n "${LLAMA:-}" ] && [ -n "${GGUF:-}" ]; then
  log "SmolLM2-135M: llama.cpp"
  for t in Q4_0 Q8_0 BF16; do
    [ -f "$WORK/smollm2-$t.gguf" ] || "$LLAMA/llama-quantize" --allow-requantize "$GGUF" "$WORK/smollm2-$t.gguf" $t >/dev/null 2>&1
  done
  "${RT[@]}" "$LLAMA/llama-bench" -m "$WORK/smollm2-Q4_0.gguf,$WORK/smollm2-Q8_0.gguf,$WORK/smollm2-BF16.gguf" \
    -p 0 -n 64 -t 2 -o md | tee "$OUT/smollm2_llama_bench.md"
fi
log "done"
