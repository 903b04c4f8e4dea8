"""`quantkit quantize MODEL --recipe RECIPE --out DIR` (a compressed-tensors checkpoint) or `--out FILE.gguf`
(a GGUF file llama.cpp runs: the only form of Q4_K-grid recipes)."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from quantkit.core.errors import UsageError
from quantkit.files.inputs import input_paths
from quantkit.gguf.choices import FLOAT_TYPES

from . import add_model_options, torch_dtype


def register(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a model into a compressed-tensors checkpoint or a GGUF file",
                       description="Quantize MODEL (a local folder, a hub id, or ref:tiny / ref:small) with RECIPE "
                                   "into a compressed-tensors checkpoint folder, or, with --out FILE.gguf, into a "
                                   "GGUF file for llama.cpp (the only form Q4_K-grid recipes such as "
                                   "w4a16-gptq-q4k have: compressed-tensors cannot hold their float minimums).")
    p.add_argument("model", help="model folder, hub id, or a built-in reference model (ref:tiny, ref:small)")
    p.add_argument("--recipe", required=True, help="built-in recipe name (e.g. w4a16-rtn) or a YAML file")
    p.add_argument("--out", required=True,
                   help="output folder, or a file ending in .gguf for a GGUF file (must not exist unless --force)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing output folder that quantkit wrote (never one holding other files)")
    p.add_argument("--leave-float", action="store_true",
                   help="leave weight matrices quantkit cannot quantize (not in an nn.Linear, e.g. fused experts of "
                        "an unknown layout) in full precision instead of refusing")
    add_model_options(p, dtype_help="dtype to load the model in and to write the checkpoint's float tensors in "
                                    "(default: load in config.json's dtype, write in the dtype the source weights "
                                    "are stored in, e.g. bfloat16 stays bfloat16)")
    g = p.add_argument_group("GGUF output (--out FILE.gguf)")
    g.add_argument("--float-type", choices=FLOAT_TYPES, default="auto",
                   help="type of the token embedding, the output head and float linears in the GGUF file (as "
                        "quantkit export's option)")
    g.add_argument("--tie-output", action="store_true",
                   help="for a model with tied embeddings whose output head the recipe quantizes (ignore: []): "
                        "write the quantized head once, as token_embd, as llama.cpp's files of such models are "
                        "(the embedding lookup then reads it; the change is printed)")
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
    from quantkit.quantization import provenance
    from quantkit.formats.loading import folder_size_bytes, load_float_model, resolve_model_source, source_dtype
    from quantkit.core.device import resolve_device
    from quantkit.files.outputs import check_free_space, check_writable, clean_stale, nearest_existing, output_state
    from quantkit.quantization.summaries import SizeOnDisk, dtype_name, quantization_summary, state_bytes

    gguf_out = str(args.out).lower().endswith(".gguf")
    inputs = input_paths(args.model, args.recipe, args.calib)
    owned = None
    if gguf_out:
        from quantkit.gguf.writing import not_written_by_quantkit as owned
    out = check_writable(args.out, force=args.force, file=gguf_out, inputs=inputs, owned=owned)  # before any work
    out_state = None if gguf_out else output_state(out)  # a folder another process writes meanwhile is never replaced
    if gguf_out and out.parent.is_dir():
        clean_stale(out)  # a killed run's temporary file goes before the free space is measured
    resolve_device(args.device, option="--device")
    if args.calib_device is not None:
        resolve_device(args.calib_device, option="--calib-device")

    from quantkit.calibration.distributed import init_from_environment

    rank, processes = init_from_environment()  # under torchrun: one share of the calibration each
    recipe = quantkit.load_recipe(args.recipe)  # validate before loading anything big
    if processes > 1 and recipe.algorithm.name not in ("gptq", "rtn"):
        raise UsageError(f"recipe {recipe.name} uses {recipe.algorithm.name}: only GPTQ and RTN recipes quantize "
                         f"data-parallel (torchrun); run it in one process")
    if recipe.weights is not None and recipe.weights.grid != "uniform" and not gguf_out:
        raise UsageError(f"recipe {recipe.name} puts the weights on llama.cpp's {recipe.weights.grid.upper()} grid, "
                         f"whose float group minimums only a GGUF file holds: give --out a file name ending in .gguf")
    if args.float_type != "auto" and not gguf_out:
        raise UsageError("--float-type is for GGUF output: give --out a file name ending in .gguf")
    if args.tie_output and not gguf_out:
        raise UsageError("--tie-output is for GGUF output: give --out a file name ending in .gguf")
    if gguf_out and recipe.kv_cache is not None:
        raise UsageError(_NO_GGUF_KV_CACHE.format(recipe=recipe.name))
    if gguf_out and recipe.weights is not None:
        from quantkit.gguf.writing import unwritable_scheme

        why = unwritable_scheme(recipe.weights)
        if why:
            raise UsageError(f"recipe {recipe.name}: {why}")
    source = resolve_model_source(args.model)
    if args.tie_output:
        from quantkit.gguf.writing import check_tie_output

        check_tie_output(recipe, Path(source))
    if gguf_out:
        if not Path(source).is_dir():
            raise UsageError(f"{args.model}: GGUF output reads the model's local folder (config.json, tokenizer); "
                             f"download it first")
        from quantkit.gguf.writing import check_exportable

        check_exportable(source)
    calibrated = recipe.needs_calibration
    calibration = calibration_config(args) if calibrated else None
    start = time.perf_counter()
    dtype = torch_dtype(args.dtype)
    model = load_float_model(source, dtype=dtype, device=args.device, trust_remote_code=args.trust_remote_code,
                             strict=not args.allow_source_mismatch)
    if Path(source).is_dir():
        size_before = SizeOnDisk(folder_size_bytes(Path(source)), dtype_name(source_dtype(model)), "on disk")
    else:  # a hub model: its tensors as loaded
        size_before = SizeOnDisk(state_bytes(model), dtype_name(model.dtype), "as loaded")
    least, spilled = _least_bytes(model, recipe, dtype or source_dtype(model))
    check_free_space(out, least + spilled)  # before the work; the finished blocks sit in files beside it meanwhile
    import torch

    scale_dtype = torch.float16 if gguf_out else None  # GGUF's block scales are fp16: round to them, exactly
    if not calibrated and args.calib is not None:
        print(f"note: --calib is ignored: {recipe.name} uses {recipe.algorithm.name}, which needs no calibration")
    quantkit.quantize(model, recipe, calibration, device=args.calib_device, leave_float=args.leave_float,
                      scale_dtype=scale_dtype, spill_folder=nearest_existing(out.parent), progress=rank == 0)
    if rank != 0:  # every process holds the same quantized model: the first one writes it
        return 0
    if gguf_out:
        return _write_gguf(model, recipe, args, source, size_before, start, inputs, out)
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


#: why a recipe with a KV cache is refused for GGUF output, and the way out
_NO_GGUF_KV_CACHE = (
    "recipe {recipe} calibrates an FP8 KV cache, which a GGUF file cannot hold: GGUF has no calibrated KV-cache "
    "scales, and llama.cpp picks its cache type when it runs (F16 by default; --cache-type-k q8_0 --cache-type-v "
    "q8_0 for an 8-bit one); use a recipe without kv_cache for GGUF output (e.g. w4a16-gptq for w4a16-gptq-kv-fp8), "
    "or write a folder (--out DIR) for vLLM's FP8 KV cache")


def _write_gguf(model, recipe, args, source, size_before, start, inputs, out) -> int:
    """Write the quantized model as the GGUF file `out` (with how it was made), then print the summary."""
    import torch

    from quantkit.quantization import provenance
    from quantkit.gguf.writing import export_gguf, not_written_by_quantkit
    from quantkit.files.outputs import atomic_output_file, check_free_space
    from quantkit.quantization.recipe import builtin_recipes
    from quantkit.quantization.summaries import SizeOnDisk, quantization_summary

    made = provenance.of(model)
    calibration = made.calibration if made else None
    recipe_arg = args.recipe if args.recipe in builtin_recipes() else str(Path(args.recipe).expanduser().resolve())
    command = provenance.reproduce_command(calibration, source, recipe_arg, str(out))
    command += ["--float-type", args.float_type] if args.float_type != "auto" else []
    command += ["--tie-output"] if args.tie_output else []
    with atomic_output_file(out, force=args.force, inputs=inputs, owned=not_written_by_quantkit) as tmp:
        result = export_gguf(model, source, tmp, float_type=args.float_type, mix=recipe.mix,
                             tie_output=args.tie_output,
                             provenance={"source": str(source), "recipe": recipe.to_yaml(),
                                         "calibration": provenance.describe_calibration(calibration),
                                         "command": shlex.join(command)},
                             check_space=lambda needed: check_free_space(out, needed))
    result.path = out
    size_after = SizeOnDisk(result.bytes, result.file_type, "on disk")
    print(quantization_summary(model, recipe, source, result.path, size_before, size_after,
                               time.perf_counter() - start, kind="GGUF file", scale_dtype=torch.float16,
                               embedding_is_head=args.tie_output))
    print(f"  calibration      : {provenance.describe_calibration(calibration)}")
    print("  " + result.describe().replace("\n", "\n  "))
    return 0


def _least_bytes(model, recipe, dtype) -> tuple[int, int]:
    """Lower bounds of (the checkpoint's size, its quantized linears' bytes): the targeted linears' weights at
    the recipe's bits (scales left out), every other parameter (tied ones once) in `dtype`."""
    from quantkit.modules.moe import unfuse_experts

    unfuse_experts(model)  # fused MoE experts count as the per-expert linears quantize makes of them
    names = recipe.linears(model)[0] if recipe.weights is not None else []
    packed = {f"{name}.weight" for name in names}
    quantized = other = 0
    for name, p in model.named_parameters():
        if name in packed:
            quantized += p.numel() * recipe.weights.num_bits // 8
        else:
            other += p.numel() * dtype.itemsize
    return quantized + other, quantized
