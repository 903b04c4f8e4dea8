"""GPTQ's objective on text it was not calibrated on: SmolLM2's linears quantized on the Python documentation
(frontier.py --texts smollm2's calibration, 16 x 256 tokens), their output error measured with the Hessian of the
licence texts it is evaluated on, relative to GPTQ's: refinement alone (A: GPTQ, then two sweeps on the shrunk
Hessian), shrinkage alone (B: GPTQ on the shrunk Hessian) and both (C), for rho in 0, 0.1, 0.25, 0.5 (rho 0:
A and C are the refinement on the Hessian as measured, B is GPTQ itself).

    python evals/quality/frontier/heldout_objective.py 0,15,29    # decoder layers; after a frontier.py run

Inputs of each linear come from the float model on each text (16 x 256 tokens each, seed 0 / 1).
"""
import sys, torch
from transformers import AutoTokenizer
from quantkit.formats.loading import load_float_model
from quantkit.calibration import CalibrationConfig
from quantkit.calibration.data import calibration_batches
from quantkit.algorithms.gptq import gptq_quantize, GPTQOptions
from quantkit.algorithms.refine import refine_levels
from quantkit.core.scheme import QuantScheme, grid_scheme
torch.set_num_threads(1)
MODEL, WORK = "/tmp/smollm2-float", "/tmp/frontier-smollm2"  # frontier.py --model / --work
model = load_float_model(MODEL, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(MODEL)
cal = torch.cat(calibration_batches(CalibrationConfig(source=WORK + "/calibration.txt", num_samples=16, seq_len=256, seed=0), model, tok))
val = torch.cat(calibration_batches(CalibrationConfig(source=WORK + "/evaluation.txt", num_samples=16, seq_len=256, seed=1), model, tok))
layers = [int(x) for x in sys.argv[1].split(",")]
names = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]
def inputs(ids):
    got = {}
    hooks = []
    for l in layers:
        for n in names:
            m = model.model.layers[l].get_submodule(n)
            hooks.append(m.register_forward_hook(lambda mod, a, o, key=(l, n): got.setdefault(key, []).append(a[0].reshape(-1, a[0].shape[-1]))))
    with torch.no_grad():
        for i in range(0, ids.shape[0], 4):
            model(ids[i:i+4])
    for h in hooks: h.remove()
    return {k: torch.cat(v) for k, v in got.items()}
xc, xv = inputs(cal), inputs(val)
def H(x): return 2 * x.T.double() @ x.double() / x.shape[0]
def obj(q, w, h):
    e = (q.dequantize() - w).double(); return float(((e @ h) * e).sum())
schemes = {"q4_0": grid_scheme("q4_0"), "int4-g128": QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=128)}
def shrink(h, rho): return (1 - rho) * h + rho * torch.diag(h.diagonal())
tot = {}
for key in xc:
    w = model.model.layers[key[0]].get_submodule(key[1]).weight.detach().float()
    hc, hv = H(xc[key]).float(), H(xv[key])
    for sn, s in schemes.items():
        g = gptq_quantize(w, hc, s, GPTQOptions(observer="mse"))
        base_c, base_v = obj(g, w, hc.double()), obj(g, w, hv)
        row = []
        for rho in (0.0, 0.1, 0.25, 0.5):
            hr = shrink(hc, rho)
            cands = {}
            cands[f"A{rho}"] = refine_levels(g, w, hr, sweeps=2).weight
            gb = gptq_quantize(w, hr, s, GPTQOptions(observer="mse"))
            cands[f"B{rho}"] = gb
            cands[f"C{rho}"] = refine_levels(gb, w, hr, sweeps=2).weight
            for vn, r in cands.items():
                rv = obj(r, w, hv) / base_v
                tot.setdefault((sn, vn), []).append(rv)
                row.append(f"{vn} {rv:.3f}")
        print(key, sn, " ".join(row), flush=True)
import statistics
for k, v in sorted(tot.items()):
    print(k, "mean val ratio", f"{statistics.mean(v):.3f}", "geo", f"{statistics.geometric_mean(v):.3f}", "max", f"{max(v):.3f}")
