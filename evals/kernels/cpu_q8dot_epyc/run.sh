#!/usr/bin/env bash
# The int8 GEMM against the bf16 dense GEMM on a CPU with native bf16 (AVX512-BF16) and no AMX, in one run:
#   1. per layer: q8dot W4 / W8 vs the bf16 dense linear at SmolLM2-like widths, M = 1..512;
#   2. SmolLM2-135M (bf16) in quantkit's loop: prefill 16..512 tokens, decode batch 1 / 8 / 16 at context 128,
#      W8, W4 and W4 with its lm_head quantized too (as llama.cpp quantizes its output).
#     FLOAT=smollm2-bf16-folder bash evals/kernels/cpu_q8dot_epyc/run.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-evals/kernels/cpu_q8dot_epyc}
mkdir -p "$OUT"
lscpu | grep -E "Model name|^Flags" | sed 's/^Flags:\s*/Flags: /' > "$OUT/cpu.txt"
python evals/kernels/bench_cpu_q8dot.py --out "$OUT" --realtime --shapes 512x512,1536x512,512x1536 \
  --rows 1,8,16,64,256,512 --paths float,q8dot-w8,q8dot-w4 --bytes 67108864 --repeats 3 --rounds 1
chrt -f 10 quantkit bench "$FLOAT" --variants w8a16-rtn,w4a16-rtn,evals/kernels/cpu_decoder/w4a16-g64-rtn-lm-head.yaml \
  --device cpu --dtype bf16 --prompt-lens 16,64,256,512 --context-lens 128 --batch-sizes 1,8,16 --repeats 5 \
  --threads 2 --decode-loop quantkit --quiet --json "$OUT/smollm2.json" | tee "$OUT/smollm2.txt"
