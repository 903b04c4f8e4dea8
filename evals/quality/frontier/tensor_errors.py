"""Which linears carry a GGUF file's loss: each decoder linear's output error, tr(E H Eᵀ) with E = the file's
weight - the float weight [N, K] and H = 2 XᵀX / n [K, K] of the linear's inputs X from the float model, on the
calibration text (the 16 x 256 tokens GPTQ took, frontier.py's WORK/calibration.txt, seed 0) and on the
evaluation text (the 8 x 512 tokens eval scores, WORK/evaluation.txt's first 4096), summed per tensor kind and
listed per tensor where the first file exceeds the second most on the evaluation text.

    python evals/quality/frontier/tensor_errors.py --model /tmp/smollm2-float --work /tmp/frontier-smollm2 \\
        Q5_K_S-gptq-refined.gguf Q5_K_S-llama-imatrix.gguf

A rounding that fits the calibration Hessian more closely (a lower error on it) but not the evaluation text's
is what the two columns show apart. The files' rows are compared as ggml holds them (q/k rows permuted for
rotary by the GGUF writers): tr(E H Eᵀ) sums over rows, so the permutation leaves it as it is. One thread.
"""
from __future__ import annotations

import argparse
import collections
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import AutoTokenizer

from quantkit.calibration import CalibrationConfig
from quantkit.calibration.data import calibration_batches
from quantkit.formats.loading import load_float_model
from quantkit.harness.eval_text import read_eval_tokens
from quantkit.harness.quality import token_windows

#: GGUF tensor kind -> the transformers Llama module of decoder layer N
MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}


def hessians(model, windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """windows int64 [B, T] -> {module name: H fp64 [K, K]} of every decoder linear, 2 XᵀX / n over all tokens."""
    sums, counts, hooks = {}, collections.Counter(), []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            def hook(_m, args, _out, name=name):
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                sums[name] = sums.get(name, 0) + x.T @ x
                counts[name] += x.shape[0]
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for i in range(windows.shape[0]):
            model(windows[i:i + 1])
    for h in hooks:
        h.remove()
    return {name: 2 * s / counts[name] for name, s in sums.items()}


def linears(path: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """{GGUF name: (ggml type, fp64 [N, K] weight as ggml dequantizes it)} of the file's decoder linears."""
    out = {}
    for t in GGUFReader(path).tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            out[t.name] = (t.tensor_type.name, torch.from_numpy(
                dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0])).astype(np.float64)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the float model folder (frontier.py --model)")
    p.add_argument("--work", required=True, type=Path, help="frontier.py's --work: float.gguf, the texts, the files")
    p.add_argument("files", nargs="+", help="GGUF files in --work (or paths) to compare; the first against the second")
    p.add_argument("--top", type=int, default=12, help="tensors listed (default 12)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = load_float_model(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    cal = torch.cat(calibration_batches(CalibrationConfig(source=str(args.work / "calibration.txt"), num_samples=16,
                                                          seq_len=256, seed=0), model, tok))
    evaluation = token_windows(read_eval_tokens(tok, str(args.work / "evaluation.txt"), 4096).ids, 512, 4096)
    h = {"cal": hessians(model, cal), "eval": hessians(model, evaluation)}
    float_weights = linears(args.work / "float.gguf")
    files = [linears(f if Path(f).is_absolute() else args.work / f) for f in args.files]
    totals = collections.defaultdict(lambda: np.zeros((len(files), 2)))
    rows = []
    for name, (_, w) in float_weights.items():
        _, layer, kind, _ = name.split(".")
        module = f"model.layers.{layer}.{MODULES[kind]}"
        errors = np.zeros((len(files), 2))
        for i, f in enumerate(files):
            e = f[name][1] - w
            errors[i] = [float(((e @ h[text][module]) * e).sum()) for text in ("cal", "eval")]
        totals[(kind, "/".join(f[name][0] for f in files))] += errors
        totals[("all", "")] += errors
        rows.append((name, errors))
    shown = lambda e: " | ".join(f"{c:10.4g} {v:10.4g}" for c, v in e)  # noqa: E731
    print(f"tr(E H Eᵀ), calibration and evaluation text, per file: {' | '.join(args.files)}")
    for (kind, types), errors in sorted(totals.items()):
        print(f"{kind:12s} {types:20s} {shown(errors)}")
    if len(files) > 1:
        print(f"the {args.top} tensors where {args.files[0]} exceeds {args.files[1]} most on the evaluation text:")
        for name, errors in sorted(rows, key=lambda r: r[1][1, 1] - r[1][0, 1])[:args.top]:
            print(f"{name:26s} {' ' * 7}{shown(errors)}")


if __name__ == "__main__":
    main()
