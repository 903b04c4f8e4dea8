"""`quantkit export CKPT --format gguf --out FILE.gguf`: a checkpoint as a GGUF file llama.cpp runs."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from quantkit.core.errors import UsageError
from quantkit.files.inputs import input_paths
from quantkit.gguf.choices import FLOAT_TYPES

FORMATS = ("gguf",)


def register(sub) -> None:
    p = sub.add_parser(
        "export", help="write a checkpoint in another format (GGUF, for llama.cpp)",
        description="Write CKPT (a quantkit checkpoint, or a float model folder / ref:NAME) as a GGUF file. "
                    "Symmetric int4 / int8 weights in groups of 32, 64, 128 or per channel become Q4_0 / Q8_0 "
                    "blocks bit for bit, asymmetric int4 becomes Q4_1 (its minimum rounded to fp16, printed); "
                    "anything else is refused, naming the recipe to quantize with.")
    p.add_argument("checkpoint", help="quantized checkpoint folder (or a float model folder, ref:tiny, ref:small)")
    p.add_argument("--format", required=True, choices=FORMATS, help="output format")
    p.add_argument("--out", required=True, help="output file (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    p.add_argument("--float-type", choices=FLOAT_TYPES, default="auto",
                   help="type of the token embedding, the output head and any linear the recipe left in float "
                        "(default auto: bf16 for a bf16 checkpoint, else f16, as llama.cpp's converter; q8_0 is "
                        "llama.cpp's own rounding); norms and biases are always f32")
    p.add_argument("--tie-output", action="store_true",
                   help="for a checkpoint of a model with tied embeddings whose output head was quantized: write the "
                        "quantized head once, as token_embd, as llama.cpp's files of such models are (the "
                        "embedding lookup then reads it; the change is printed)")
    p.add_argument("--round-scales", action="store_true",
                   help="round scales that are not fp16 values (an fp32 checkpoint's) to GGUF's fp16 block scale "
                        "and print the largest change (default: refuse, the export would not be exact)")
    p.add_argument("--name", default=None, help="general.name in the file (default: the checkpoint folder's name)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow model code from the model folder (only for sources you trust)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import quantkit
    from quantkit.quantization import provenance
    from quantkit.gguf.writing import check_exportable, not_written_by_quantkit
    from quantkit.formats.loading import resolve_model_source
    from quantkit.files.outputs import atomic_output_file, check_free_space, check_writable

    inputs = input_paths(args.checkpoint)
    out = check_writable(args.out, force=args.force, file=True, inputs=inputs, owned=not_written_by_quantkit)
    source = Path(resolve_model_source(args.checkpoint))
    if not source.is_dir():
        raise UsageError(f"{args.checkpoint}: export reads a local checkpoint folder (with its tokenizer)")
    check_exportable(source)  # before any work
    from quantkit.gguf.writing import export_gguf

    model = quantkit.load(source, backend="reference", trust_remote_code=args.trust_remote_code)
    recipe_file = source / provenance.RECIPE_FILE
    made = {"source": str(source), "command": shlex.join(_command(args, source, out))}
    if recipe_file.is_file():
        made["recipe"] = recipe_file.read_text(encoding="utf-8", errors="replace")
    with atomic_output_file(out, force=args.force, inputs=inputs, owned=not_written_by_quantkit) as tmp:
        result = export_gguf(model, source, tmp, float_type=args.float_type, round_scales=args.round_scales,
                             name=args.name, tie_output=args.tie_output, provenance=made,
                             check_space=lambda needed: check_free_space(out, needed))
    result.path = out
    print(result.describe())
    return 0


def _command(args: argparse.Namespace, source, out) -> list[str]:
    """The command line that writes this file again (recorded in it as quantkit.command)."""
    command = ["quantkit", "export", str(source), "--format", args.format, "--out", str(out)]
    if args.float_type != "auto":
        command += ["--float-type", args.float_type]
    for flag in ("tie_output", "round_scales", "trust_remote_code"):
        if getattr(args, flag):
            command.append("--" + flag.replace("_", "-"))
    if args.name is not None:
        command += ["--name", args.name]
    return command
