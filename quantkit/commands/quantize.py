"""`quantkit quantize MODEL --recipe RECIPE --out DIR`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from . import add_model_options, input_paths, torch_dtype


def register(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a model into a compressed-tensors checkpoint",
                       description="Quantize MODEL (a local folder, a hub id, or ref:tiny / ref:small) with RECIPE.")
    p.add_argument("model", help="model folder, hub id, or a built-in reference model (ref:tiny, ref:small)")
    p.add_argument("--recipe", required=True, help="built-in recipe name (e.g. w4a16-rtn) or a YAML file")
    p.add_argument("--out", required=True, help="output folder (must not exist unless --force)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing output folder that quantkit wrote (never one holding other files)")
    p.add_argument("--leave-float", action="store_true",
                   help="leave weight matrices quantkit cannot quantize (not in an nn.Linear, e.g. fused experts of "
                        "an unknown layout) in full precision instead of refusing")
    add_model_options(p, dtype_help="dtype to load the model in and to write the checkpoint's float tensors in "
                                    "(default: load in config.json's dtype, write in the dtype the source weights "
                                    "are stored in, e.g. bfloat16 stays bfloat16)")
    add_calibration_options(p)
    p.set_defaults(func=run)


def add_calibration_options(p: argparse.ArgumentParser) -> None:
    """--calib* / --seed: calibration data of GPTQ and AWQ recipes (RTN needs none)."""
    g = p.add_argument_group("calibration (gptq and awq recipes)")
    g.add_argument("--calib", metavar="SOURCE", default=None,
                   help="calibration text: a .txt/.md/.py, .jsonl/.json or .parquet file or a folder of them, "
                        "hub:NAME[:CONFIG]:SPLIT:COLUMN (e.g. hub:wikitext:wikitext-2-raw-v1:train:text), or 'ref' "
                        "(default for ref:* models: their training text)")
    g.add_argument("--calib-samples", type=int, default=128, metavar="N", help="number of token windows (default: 128)")
    g.add_argument("--calib-seq-len", type=int, default=None, metavar="L",
                   help="tokens per window (default: min(2048, model context))")
    g.add_argument("--calib-column", default="text", metavar="NAME",
                   help="text field of JSONL/Parquet rows (default: text)")
    g.add_argument("--calib-batch-size", type=int, default=None, metavar="B",
                   help="windows per forward pass (default: as many as fit in 8192 tokens)")
    g.add_argument("--calib-device", default=None, metavar="DEVICE",
                   help="device calibration computes on, one decoder block at a time "
                        "(default: cuda if available, else cpu)")
    g.add_argument("--seed", type=int, default=0, help="seed of the calibration sampling (default: 0)")


def calibration_config(args: argparse.Namespace):
    from quantkit.calibration import CalibrationConfig

    return CalibrationConfig(
        source=args.calib, num_samples=args.calib_samples, seq_len=args.calib_seq_len, seed=args.seed,
        column=args.calib_column, batch_size=args.calib_batch_size,
    )


def run(args: argparse.Namespace) -> int:
    import quantkit
    from quantkit import provenance
    from quantkit.loading import folder_size_bytes, load_float_model, resolve_model_source, source_dtype
    from quantkit.device import resolve_device
    from quantkit.outputs import check_free_space, check_writable, output_state
    from quantkit.summaries import SizeOnDisk, dtype_name, quantization_summary, state_bytes

    out = check_writable(args.out, force=args.force,  # before any work
                         inputs=input_paths(args.model, args.recipe, args.calib))
    out_state = output_state(out)  # a folder another process writes there meanwhile is never replaced
    resolve_device(args.device, option="--device")
    if args.calib_device is not None:
        resolve_device(args.calib_device, option="--calib-device")

    recipe = quantkit.load_recipe(args.recipe)  # validate before loading anything big
    calibrated = recipe.needs_calibration
    calibration = calibration_config(args) if calibrated else None
    source = resolve_model_source(args.model)
    start = time.perf_counter()
    dtype = torch_dtype(args.dtype)
    model = load_float_model(source, dtype=dtype, device=args.device, trust_remote_code=args.trust_remote_code,
                             strict=not args.allow_source_mismatch)
    if Path(source).is_dir():
        size_before = SizeOnDisk(folder_size_bytes(Path(source)), dtype_name(source_dtype(model)), "on disk")
    else:  # a hub model: its tensors as loaded
        size_before = SizeOnDisk(state_bytes(model), dtype_name(model.dtype), "as loaded")
    check_free_space(out, _least_checkpoint_bytes(model, recipe, dtype or source_dtype(model)))  # before the work
    if calibrated:
        quantkit.quantize(model, recipe, calibration, device=args.calib_device, leave_float=args.leave_float)
    else:
        if args.calib is not None:
            print(f"note: --calib is ignored: {recipe.name} uses {recipe.algorithm.name}, which needs no calibration")
        quantkit.quantize(model, recipe, leave_float=args.leave_float)
    saved_dtype = dtype or source_dtype(model)  # the source's dtype unless --dtype asks for another
    path = quantkit.save(model, out, tokenizer_source=source, force=args.force, dtype=saved_dtype, expect=out_state)
    elapsed = time.perf_counter() - start
    size_after = SizeOnDisk(folder_size_bytes(path), dtype_name(saved_dtype), "on disk")
    print(quantization_summary(model, recipe, source, path, size_before, size_after, elapsed))
    made = provenance.of(model)
    print(f"  calibration      : {provenance.describe_calibration(made.calibration if made else None)}")
    routing = provenance.describe_moe_routing(made.moe_routing if made else None)
    if routing:
        print(f"  experts          : {routing}")
    print(f"  recipe saved as  : {path / provenance.RECIPE_FILE} (repeat the run with --recipe on it)")
    return 0


def _least_checkpoint_bytes(model, recipe, dtype) -> int:
    """A lower bound of the checkpoint's size: the targeted linears' weights at the recipe's bits (scales
    left out), every other parameter (tied ones once) in `dtype`."""
    from quantkit.moe import unfuse_experts
    from quantkit.targets import select_linears

    unfuse_experts(model)  # fused MoE experts count as the per-expert linears quantize makes of them
    names = select_linears(model, recipe.targets, recipe.ignore)[0] if recipe.weights is not None else []
    packed = {f"{name}.weight" for name in names}
    return sum(p.numel() * recipe.weights.num_bits // 8 if name in packed else p.numel() * dtype.itemsize
               for name, p in model.named_parameters())
