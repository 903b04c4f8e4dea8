#!/usr/bin/env bash
# RTN, GPTQ and AutoRound at W4 g128 (symmetric) on ref:small: quantize time and peak RSS (/usr/bin/time -v),
# then KL / perplexity / top-1 against the float model with quantkit eval on its held-out text (defaults).
# Usage: bash evals/quality/autoround/run.sh OUT_DIR   (run from the repository root)
set -euo pipefail
out=${1:-/tmp/autoround-eval}
mkdir -p "$out"
for recipe in w4a16-rtn w4a16-gptq w4a16-autoround; do
  OMP_NUM_THREADS=1 taskset -c 1 /usr/bin/time -v -o "$out/$recipe.time" \
    python -m quantkit quantize ref:small --recipe "$recipe" --out "$out/$recipe" --force > "$out/$recipe.log" 2>&1
  OMP_NUM_THREADS=1 taskset -c 1 python -m quantkit eval "$out/$recipe" --baseline ref:small \
    --json "$out/$recipe.json" > "$out/$recipe.eval.log" 2>&1
done
