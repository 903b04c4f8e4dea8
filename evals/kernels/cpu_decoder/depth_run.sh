#!/usr/bin/env bash
# SmolLM2-135M decode at context 128 / 2048 / 8000 and batch 1 / 8 / 16 on this CPU, in one run: quantkit bench
# (decode in quantkit's C++ loop: bf16, W8, W4 and W4 + FP8 KV, with a bf16 cache unless FP8) and llama.cpp's
# llama-bench at the same depths (Q4_0 / Q8_0 / BF16 files made from the same GGUF, f16 and q8_0 caches).
#   FLOAT=smollm2-bf16-folder LLAMA=llama.cpp/build/bin GGUF=SmolLM2-135M-Instruct.Q4_1.gguf \
#     bash evals/kernels/cpu_decoder/depth_run.sh OUT_DIR WORK_DIR
# LLAMA: llama-bench and llama-quantize, e.g. built as CI builds llama.cpp:
#   LLAMA_CPP_TARGETS="llama-bench llama-quantize" bash .ci/llama_cpp_build LLAMA_DIR
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-evals/kernels/cpu_decoder/depth}; WORK=${2:-/tmp/cpu_decoder}
THREADS=${THREADS:-2}
mkdir -p "$OUT" "$WORK"
lscpu | grep -E "Model name|^Flags" | sed 's/^Flags:\s*/Flags: /' > "$OUT/cpu.txt"
quantkit bench "$FLOAT" --variants w8a16-rtn,w4a16-rtn,w4a16-rtn-kv-fp8 --device cpu --dtype bf16 \
  --prompt-lens 64 --context-lens 128,2048,8000 --batch-sizes 1,8,16 --repeats 5 --threads "$THREADS" \
  --decode-loop quantkit --quiet --json "$OUT/quantkit.json" | tee "$OUT/quantkit.txt"
for t in Q4_0 Q8_0 BF16; do
  [ -f "$WORK/smollm2-$t.gguf" ] || "$LLAMA/llama-quantize" --allow-requantize "$GGUF" "$WORK/smollm2-$t.gguf" $t > /dev/null 2>&1
done
models="$WORK/smollm2-Q4_0.gguf,$WORK/smollm2-Q8_0.gguf,$WORK/smollm2-BF16.gguf"
# -fa 1: llama.cpp quantizes the V cache only with flash attention
for cache in f16 q8_0; do
  "$LLAMA/llama-bench" -m "$models" -p 0 -n 32 -d 128,2048,8000 -t "$THREADS" -fa on -ctk $cache -ctv $cache -r 3 -o md \
    | tee "$OUT/llama_bench_$cache.md"
done
python evals/kernels/cpu_decoder/depth_table.py "$OUT" | tee "$OUT/README.md"
