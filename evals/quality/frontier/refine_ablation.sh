#!/usr/bin/env bash
# GPTQ's Hessian shrinkage and its refinement, each on its own and together: one GGUF file per (recipe, rho,
# sweeps), quantized and evaluated as frontier.py does (one thread; KL of the file against the float model).
# Usage (from the repository root):
#   bash evals/quality/frontier/refine_ablation.sh MODEL WORK BASE_RECIPE RHO SWEEPS [CALIB_TEXT EVAL_TEXT]
#   e.g. bash evals/quality/frontier/refine_ablation.sh ref:small /tmp/ablation w2a16-gptq-q2k 0.25 2
#        bash evals/quality/frontier/refine_ablation.sh /tmp/smollm2-float /tmp/ablation w2a16-gptq-q2k 0.25 0 \
#            /tmp/frontier-smollm2/calibration.txt /tmp/frontier-smollm2/evaluation.txt
# CALIB_TEXT / EVAL_TEXT: the files frontier.py --texts smollm2 writes under its --work (default: the reference
# texts, --calib ref). Prints "NAME KL ... quantize s ...".
set -euo pipefail
model=$1; work=$2; base=$3; rho=$4; sweeps=$5
calib=(--calib "${6:-ref}" --calib-samples 16 --calib-seq-len 256)
data=(); [ -n "${7:-}" ] && data=(--data "$7")
mkdir -p "$work"
name=$base-s$rho-r$sweeps
python - "$base" "$rho" "$sweeps" "$work/$name.yaml" <<'PY'
import sys
from pathlib import Path
import yaml
base, rho, sweeps, out = sys.argv[1:]
recipe = yaml.safe_load((Path("recipes") / f"{base}.yaml").read_text())
recipe["algorithm"] = dict(recipe["algorithm"], shrinkage=float(rho), refine_sweeps=int(sweeps))
Path(out).write_text(yaml.safe_dump(recipe))
PY
start=$(date +%s)
OMP_NUM_THREADS=1 python -m quantkit quantize "$model" --recipe "$work/$name.yaml" --out "$work/$name.gguf" --force \
    "${calib[@]}" > "$work/$name.quantize.log" 2>&1
seconds=$(( $(date +%s) - start ))
OMP_NUM_THREADS=1 python -m quantkit eval "$work/$name.gguf" --baseline "$model" --window 512 --max-tokens 4096 \
    --dtype auto --json "$work/$name.eval.json" "${data[@]}" > "$work/$name.eval.log" 2>&1
python -c "import json, sys; print(sys.argv[1], 'KL', json.load(open(sys.argv[2]))['kl_divergence'], 'quantize s', sys.argv[3])" \
    "$name" "$work/$name.eval.json" "$seconds"
