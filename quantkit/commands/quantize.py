"""`quantkit quantize MODEL --recipe RECIPE --out DIR`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from . import DTYPES, add_model_options


def register(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a model into a compressed-tensors checkpoint",
                       description="Quantize MODEL (a local folder, a hub id, or ref:tiny / ref:small) with RECIPE.")
    p.add_argument("model", help="model folder, hub id, or a built-in reference model (ref:tiny, ref:small)")
    p.add_argument("--recipe", required=True, help="built-in recipe name (e.g. w4a16-rtn) or a YAML file")
    p.add_argument("--out", required=True, help="output folder (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    add_model_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import quantkit
    from quantkit.loading import folder_size_bytes, load_float_model, resolve_model_source
    from quantkit.report_text import quantization_summary

    out = Path(args.out)
    if out.exists() and not args.force:
        raise FileExistsError(f"output folder {out} already exists; choose another --out or pass --force to replace it")
    recipe = quantkit.load_recipe(args.recipe)  # validate before loading anything big
    source = resolve_model_source(args.model)
    start = time.perf_counter()
    model = load_float_model(source, dtype=DTYPES[args.dtype], device=args.device, trust_remote_code=args.trust_remote_code)
    size_before = folder_size_bytes(Path(source)) if Path(source).is_dir() else None
    quantkit.quantize(model, recipe)
    path = quantkit.save(model, out, tokenizer_source=source, force=args.force)
    elapsed = time.perf_counter() - start
    print(quantization_summary(model, recipe, source, path, size_before, folder_size_bytes(path), elapsed))
    return 0
