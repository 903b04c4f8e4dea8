"""The refinement's Hessian on text it was not calibrated on: SmolLM2's linears on their Q5_K_S grids (Q5_1 at 576
inputs, Q5_K at 1536), GPTQ on the calibration Hessian shrunk by 0.25 (the refined recipes' GPTQ), then two sweeps
of refine_levels and refine_fields on the calibration Hessian shrunk by r = 0.25 (the recipes before
refine_shrinkage), 0.5 and 0.75; each linear's output error tr(E H Eᵀ) with the Hessian of the calibration text
itself and of the licence texts eval scores (tensor_errors.py's Hessians), and the same error of llama.cpp's
imatrix rounding (the grid's fields from its search, with diag(H) as the importance, then round to nearest).

    python evals/quality/frontier/refine_shrinkage.py --model /tmp/smollm2-float --work /tmp/frontier-smollm2 \\
        --layers 2,15,27,28
"""
from __future__ import annotations

import argparse
import collections
import math

import torch
from transformers import AutoTokenizer

from quantkit.algorithms.gptq import GPTQOptions, gptq_quantize
from quantkit.calibration import CalibrationConfig
from quantkit.calibration.data import calibration_batches
from quantkit.core.scheme import grid_scheme
from quantkit.formats.loading import load_float_model
from quantkit.gguf.grids import GRID_WEIGHTS
from quantkit.harness.eval_text import read_eval_tokens
from quantkit.harness.quality import token_windows
from tensor_errors import hessians

LINEARS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--work", required=True, help="frontier.py's --work (calibration.txt, evaluation.txt)")
    p.add_argument("--layers", default="2,15,27,28")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = load_float_model(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    cal = torch.cat(calibration_batches(CalibrationConfig(source=f"{args.work}/calibration.txt", num_samples=16,
                                                          seq_len=256, seed=0), model, tok))
    evaluation = token_windows(read_eval_tokens(tok, f"{args.work}/evaluation.txt", 4096).ids, 512, 4096)
    h_cal, h_eval = hessians(model, cal), hessians(model, evaluation)
    ratios = collections.defaultdict(list)
    for layer in args.layers.split(","):
        for linear in LINEARS:
            name = f"model.layers.{layer}.{linear}"
            w = model.get_submodule(name).weight.detach().float()
            hc, he = h_cal[name].float(), h_eval[name]
            scheme = grid_scheme("q5_1" if w.shape[1] % 256 else "q5_k")
            grid = GRID_WEIGHTS[scheme.grid]
            rounded = {"llama.cpp+imatrix": grid.round(w, grid.choose_fields(w, search=True, importance=hc.diagonal()),
                                                       scheme)}
            for r in (0.25, 0.5, 0.75):
                options = GPTQOptions(observer="mse", shrinkage=0.25, refine_sweeps=2, refine_fields=True,
                                      refine_shrinkage=r)
                rounded[f"refined r={r}"] = gptq_quantize(w, hc, scheme, options)
            cells = []
            for label, q in rounded.items():
                e = (q.dequantize() - w).double()
                errors = [float(((e @ h.double()) * e).sum()) for h in (hc, he)]
                ratios[label].append(errors[1])
                cells.append(f"{label} {errors[0]:.4g} / {errors[1]:.4g}")
            print(f"{name:28s} {scheme.grid}: " + "; ".join(cells), flush=True)
    base = ratios["llama.cpp+imatrix"]
    for label, errors in ratios.items():
        geo = math.exp(sum(math.log(e / b) for e, b in zip(errors, base)) / len(base))
        print(f"{label:18s} licence-text error: sum {sum(errors):.4g}, geometric mean over llama.cpp+imatrix's {geo:.3f}")


if __name__ == "__main__":
    main()
