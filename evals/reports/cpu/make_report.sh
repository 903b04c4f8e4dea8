#!/usr/bin/env bash
# The committed CPU report (evals/reports/cpu/report.md), end to end:
#  1. quality: quantize the small reference model with each recipe and evaluate it against the
#     unquantized model (`quantkit eval`: perplexity, KL divergence, top-1 agreement);
#  2. speed: float vs W8 vs W4 on a random-initialised ~0.85B-parameter Llama (evals/configs/llama-1b-random.json:
#     1.7 GB of bf16 weights, far beyond the 32 MB L3), TTFT and TPOT side by side against the roofline
#     of the probed CPU (copy bandwidth, matmul in the faster dtype); each phase runs in the float dtype
#     fastest on this CPU (`--dtype auto`: fp32 prefill where bf16 is not native);
#  3. the report: Markdown + JSON + PNG plots.
# The quality evaluations take ~2 minutes per recipe on 2 cores (the first 65536 tokens of the held-out text), the speed run ~5. THREADS (default 2) sets the CPU threads of the speed run.
# SKIP_QUALITY=1 / SKIP_BENCH=1 reuse the committed quality/*.json / bench.json and only re-render.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=evals/reports/cpu
WORK=${WORK:-$(mktemp -d)}
THREADS=${THREADS:-2}
# On a shared machine, spinning OpenMP threads that lose their core stall every barrier: let them sleep.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
mkdir -p "$OUT/quality"

if [ "${SKIP_QUALITY:-0}" != 1 ]; then
  for recipe in w8a16-rtn w4a16-rtn w4a16-rtn-asym; do
    quantkit quantize ref:small --recipe "$recipe" --out "$WORK/small-$recipe" --force
    quantkit eval "$WORK/small-$recipe" --baseline ref:small --max-tokens 65536 --json "$OUT/quality/eval-$recipe.json"
  done
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  quantkit bench evals/configs/llama-1b-random.json --variants w8a16-rtn,w4a16-rtn --device cpu \
    --threads "$THREADS" --prompt-lens 16,64,256 --context-lens 128,512,2048 --batch-sizes 1,4 \
    --warmup 1 --repeats 5 --json "$OUT/bench.json"
fi

quantkit report --bench "$OUT/bench.json" \
  --quality "$OUT"/quality/eval-{w8a16-rtn,w4a16-rtn,w4a16-rtn-asym}.json --out "$OUT" --force \
  --title "quantkit on CPU: prefill versus decode, and what it costs in quality" \
  --note "Speed: a random-initialised Llama-architecture model of 0.85 B parameters (evals/configs/llama-1b-random.json), the float model against RTN W8 (per channel) and W4 (groups of 128) on PyTorch's weight-only CPU kernels (backend \"torch\"), on a CPU shared with other jobs. Quality: the small reference model (ref:small) quantized with the same recipes, evaluated by \`quantkit eval\` on the first 65536 tokens of its held-out text (128 windows of 512 tokens)." \
  --note "Prefill is compute-bound: weight-only quantization cannot speed it up beyond the bytes it saves. From 128 rows (int4) or 32 rows (int8 per channel) the quantized CPU linears dequantize the weight once per call and run the dense matmul, since PyTorch's fused weight-only CPU kernels, tuned for few rows, lose to it on long prompts (evals/kernels/cpu_dequant_crossover.py)." \
  --note "Reproduce: \`bash evals/reports/cpu/make_report.sh\`."
