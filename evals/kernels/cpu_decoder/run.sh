#!/usr/bin/env bash
# SmolLM2-135M-Instruct decode on this CPU, in one run: quantkit bench with decode in quantkit's C++ loop
# (quantkit.CpuDecoder) and in transformers, and llama.cpp's llama-bench of Q4_0 / Q8_0 / BF16 files made
# from the same GGUF.
#   FLOAT=smollm2-float-folder LLAMA=llama.cpp/build/bin GGUF=SmolLM2-135M-Instruct.Q4_1.gguf \
#     bash evals/kernels/cpu_decoder/run.sh OUT_DIR WORK_DIR
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-evals/kernels/cpu_decoder}; WORK=${2:-/tmp/cpu_decoder}
HERE=evals/kernels/cpu_decoder
mkdir -p "$OUT" "$WORK"
variants=()
for r in evals/kernels/cpu_q8dot/w4a16-g64-rtn.yaml $HERE/w4a16-g64-rtn-lm-head.yaml w8a16-rtn $HERE/w8a16-rtn-lm-head.yaml; do
  name=$(basename "$r" .yaml)
  [ -d "$WORK/$name" ] || quantkit quantize "$FLOAT" --recipe "$r" --out "$WORK/$name" > /dev/null
  variants+=("$WORK/$name")
done
list=$(IFS=,; echo "${variants[*]}")
for loop in quantkit transformers; do
  quantkit bench "$FLOAT" --variants "$list" --device cpu --dtype bf16 --prompt-lens 32 --context-lens 64 \
    --batch-sizes 1 --repeats 9 --threads 2 --decode-loop $loop --quiet --json "$OUT/smollm2_$loop.json" \
    | tee "$OUT/smollm2_$loop.txt"
done
for t in Q4_0 Q8_0 BF16; do
  [ -f "$WORK/smollm2-$t.gguf" ] || "$LLAMA/llama-quantize" --allow-requantize "$GGUF" "$WORK/smollm2-$t.gguf" $t > /dev/null 2>&1
done
"$LLAMA/llama-bench" -m "$WORK/smollm2-Q4_0.gguf,$WORK/smollm2-Q8_0.gguf,$WORK/smollm2-BF16.gguf" -p 0 -n 64 -t 2 -o md \
  | tee "$OUT/smollm2_llama_bench.md"
