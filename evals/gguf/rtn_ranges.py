"""Round-to-nearest range rules on the GGUF grids (blocks of 32), beside llama.cpp's own rounding.

Every variant replaces each targeted linear's weight by its quantize-dequantize round trip with scales
rounded to fp16 (GGUF's block scale d), and is scored against the float model by quantkit's harness
(KL, top-1, perplexity) on the same windows. llama.cpp's rounding is the `gguf` package's port of
ggml's reference quantizers (quantize_row_q4_0_ref etc., what llama-quantize runs without an importance
matrix): d = extreme / -8 for Q4_0, min/max for Q4_1, absmax / 127 for Q8_0.

    python evals/gguf/rtn_ranges.py --model ref:small --out evals/gguf/rtn-ranges-small
    python evals/gguf/rtn_ranges.py --model WORK/smollm2-135m-float --data /usr/share/common-licenses --out ...
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

import quantkit
from quantkit.algorithms.rtn import RTNOptions, rtn_quantize
from quantkit.harness.eval_text import load_tokenizer, read_eval_tokens
from quantkit.harness.quality import evaluate_quality, token_windows
from quantkit.core.scheme import QuantScheme
from quantkit.modules.targets import select_linears

SYM4 = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32)
ASYM4 = QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=32)
SYM8 = QuantScheme(num_bits=8, symmetric=True, strategy="group", group_size=32)
# (row, grid, quantkit scheme and RTN options, or the llama.cpp type)
VARIANTS = (
    ("quantkit RTN absmax/7 (old default)", "Q4_0", SYM4, RTNOptions()),
    ("quantkit RTN signed (negative extreme on -8)", "Q4_0", SYM4, RTNOptions(symmetric_scale="signed")),
    ("quantkit RTN MSE search, absmax/7", "Q4_0", SYM4, RTNOptions(observer="mse")),
    ("quantkit RTN MSE search, signed", "Q4_0", SYM4, RTNOptions(observer="mse", symmetric_scale="signed")),
    ("llama.cpp Q4_0 round to nearest", "Q4_0", None, "Q4_0"),
    ("quantkit RTN asym min/max", "Q4_1", ASYM4, RTNOptions()),
    ("quantkit RTN asym MSE search", "Q4_1", ASYM4, RTNOptions(observer="mse")),
    ("llama.cpp Q4_1 round to nearest", "Q4_1", None, "Q4_1"),
    ("quantkit RTN absmax/127", "Q8_0", SYM8, RTNOptions()),
    ("quantkit RTN signed", "Q8_0", SYM8, RTNOptions(symmetric_scale="signed")),
    ("llama.cpp Q8_0 round to nearest", "Q8_0", None, "Q8_0"),
)


def fake_quantized(model, scheme, how) -> dict[str, torch.Tensor]:
    """name -> fp32 [N, K] round trip of every targeted linear's weight (quantkit RTN or llama.cpp's)."""
    import gguf

    names, _ = select_linears(model, ["Linear"], ["lm_head"])
    out = {}
    for name in names:
        w = model.get_submodule(name).weight.detach().float()
        if isinstance(how, str):
            qtype = getattr(gguf.GGMLQuantizationType, how)
            out[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype).copy())
        else:
            out[name] = rtn_quantize(w, scheme, how, scale_dtype=torch.float16).dequantize()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="ref:small")
    p.add_argument("--data", default=None, help="evaluation text (default: the reference models' held-out text)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = p.parse_args()
    torch.set_num_threads(2)
    baseline = quantkit.load(args.model, dtype=torch.float32)
    model = quantkit.load(args.model, dtype=torch.float32)
    window = min(args.window, baseline.config.max_position_embeddings)
    ids = read_eval_tokens(load_tokenizer(args.model), args.data, args.windows * window).ids
    windows = token_windows(ids, window, args.windows * window)
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    rows = []
    for row, grid, scheme, how in VARIANTS:
        start = time.perf_counter()
        for name, w in fake_quantized(baseline, scheme, how).items():
            model.get_submodule(name).weight.data.copy_(w)
        seconds = time.perf_counter() - start
        r = evaluate_quality(model, baseline, windows, progress=False)
        rows.append(dict(variant=row, grid=grid, kl=r.kl_divergence, top1=r.top1_agreement, perplexity=r.perplexity,
                         baseline_perplexity=r.baseline_perplexity, quantize_seconds=round(seconds, 2)))
        print(json.dumps(rows[-1]), flush=True)
        for name, w in originals.items():
            model.get_submodule(name).weight.data.copy_(w)
    meta = dict(model=args.model, data=args.data or "reference held-out text", windows=int(windows.shape[0]),
                window=int(windows.shape[1]), cpu=platform.processor() or platform.machine(),
                torch=torch.__version__)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    lines = [f"# RTN range rules on the GGUF grids: {args.model}", "",
             f"{meta['windows']} windows of {meta['window']} tokens of {meta['data']}; every weight rounded with "
             f"fp16 block scales; scored against the float model by quantkit's harness. Made by "
             f"`evals/gguf/rtn_ranges.py`.", "",
             "| grid | variant | KL | top-1 | perplexity (float) |", "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['grid']} | {r['variant']} | {r['kl']:.3g} | {r['top1']:.3f} | "
                     f"{r['perplexity']:.3f} ({r['baseline_perplexity']:.3f}) |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
