"""`quantkit advise`: which scheme to serve a model with, for a workload on a GPU, from the roofline
(TTFT, TPOT, total latency, memory) and measured quality; or, with a size budget (--max-size,
--max-bits-per-weight) and a measured frontier (--frontier), which GGUF type for llama.cpp has the lowest
measured KL among the files that fit (no GPU needed)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from quantkit.core.errors import QuantkitError, UsageError
from quantkit.files.inputs import input_paths
from quantkit.files.outputs import check_output_file, output_stream, write_output_file
from quantkit.core.units import EXAMPLES, UNIT_NAMES, parse_byte_size
from quantkit.harness.frontier import MAKE_IT, SizeBudget, choose_by_size, format_size_choice, load_frontier

from . import int_at_least, nonnegative_float, positive_float

#: the options of GPU advice that a size budget does not read
GPU_OPTIONS = (("--gpu", "gpu"), ("--prompt-len", "prompt_len"), ("--output-len", "output_len"), ("--batch", "batch"),
               ("--memory", "memory"), ("--quality", "quality"), ("--max-ppl-increase", "max_ppl_increase"),
               ("--max-kl", "max_kl"), ("--min-gain", "min_gain"))


def byte_size(text: str) -> int:
    """An argparse `type`: a size with its unit ("60MB", "1.5GB", "500MiB") as bytes; a bare number is refused."""
    try:
        return parse_byte_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "advise", help="recommend a quantization scheme: for a workload on a GPU (roofline + measured quality), "
                       "or the GGUF type that fits a size budget (measured frontier)",
        description=__doc__,
        epilog="Examples: quantkit advise ref:small --gpu l4 --prompt-len 2048 --output-len 512 --batch 8 "
               "--memory 20 --quality w8.json w4.json --max-ppl-increase 3; "
               "quantkit advise ref:small --max-size 4MB --frontier evals/quality/frontier/ref-small/frontier.json",
    )
    p.add_argument("model", help="model folder, hub id, ref:NAME or config.json (GPU advice reads only its config; "
                                 "a size budget checks that the frontier was measured on it)")
    gpu = p.add_argument_group("GPU advice (roofline): --gpu, --prompt-len and --output-len")
    gpu.add_argument("--gpu", help="known GPU (h200, h100-sxm, h100-pcie, a100, a100-40gb, a10, l4, "
                                   "rtx4090) or 'probe' to measure this machine")
    gpu.add_argument("--prompt-len", type=int_at_least(1))
    gpu.add_argument("--output-len", type=int_at_least(1))
    gpu.add_argument("--batch", type=int_at_least(1), help="sequences decoded together (default: 1)")
    gpu.add_argument("--memory", type=positive_float, help="memory budget in GB (default: the device's memory)")
    gpu.add_argument("--quality", nargs="+", default=[], metavar="FILE",
                     help="`quantkit eval` JSON files; each is matched to a scheme by its recipe / name")
    gpu.add_argument("--max-ppl-increase", type=nonnegative_float,
                     help="quality budget: largest perplexity increase, in percent")
    gpu.add_argument("--max-kl", type=nonnegative_float, help="quality budget: largest KL divergence (nats/token)")
    gpu.add_argument("--min-gain", type=nonnegative_float,
                     help="percent a faster scheme must gain over a higher-quality one to be preferred (default 10)")
    size = p.add_argument_group("size budget (a GGUF type for llama.cpp, from a measured frontier; no GPU needed)")
    size.add_argument("--max-size", type=byte_size, metavar="SIZE",
                      help=f"largest GGUF file, with its unit: e.g. {EXAMPLES} ({UNIT_NAMES})")
    size.add_argument("--max-bits-per-weight", type=positive_float, metavar="X",
                      help="largest bits per weight of the file (8 x file bytes / parameters)")
    size.add_argument("--frontier", metavar="FILE",
                      help="frontier.json of the model (evals/quality/frontier/frontier.py writes it): each type's "
                           "measured file size and KL")
    p.add_argument("--json", dest="json_out", help="write the full comparison here")
    p.set_defaults(func=run)


def load_shape(model: str):
    from quantkit.core.errors import CheckpointError
    from quantkit.harness.roofline import ModelShape
    from quantkit.formats.loading import read_config_json, resolve_model_source

    source = resolve_model_source(model)
    path = Path(source)
    if path.is_dir():
        config = read_config_json(path)
    elif path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise CheckpointError(f"{path} is not a JSON model config ({e})") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{path} holds a JSON {type(config).__name__}, not an object of model settings")
    else:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(source)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"could not read the config of {source!r}: {str(e).splitlines()[0]}") from None
    try:
        return ModelShape.from_config(config)
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{model}: {e}") from None


def run(args: argparse.Namespace) -> int:
    if args.max_size is not None or args.max_bits_per_weight is not None or args.frontier is not None:
        given = [flag for flag, name in GPU_OPTIONS if getattr(args, name) not in (None, [])]
        if given:
            raise UsageError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for GPU advice from the "
                             f"roofline, and --max-size / --max-bits-per-weight / --frontier for the GGUF type that "
                             f"fits a size: ask the two in two commands")
        return run_size_budget(args)
    missing = [flag for flag, name in GPU_OPTIONS[:3] if getattr(args, name) is None]
    if missing:
        raise UsageError(f"missing {', '.join(missing)}: give --gpu, --prompt-len and --output-len for GPU advice, "
                         f"or --max-size SIZE (e.g. {EXAMPLES}) with --frontier FILE for the GGUF type that fits")
    return run_gpu(args)


def same_model(measured: str, asked: str) -> bool:
    """Whether the model a frontier names (`measured`) is `asked`: the same name, or the same local folder."""
    from quantkit.formats.loading import resolve_model_source

    if measured == asked:
        return True
    try:
        paths = [Path(resolve_model_source(name)) for name in (measured, asked)]
    except QuantkitError:  # a folder the frontier names that is not on this machine
        return False
    return all(p.exists() for p in paths) and os.path.samefile(*paths)


def run_size_budget(args: argparse.Namespace) -> int:
    """--max-size / --max-bits-per-weight with --frontier: the measured type of lowest KL that fits."""
    from quantkit.formats.loading import resolve_model_source

    if args.frontier is None:
        raise UsageError(f"--max-size / --max-bits-per-weight need --frontier FILE, the model's measured frontier.json "
                         f"(each type's file size and KL): {MAKE_IT}")
    if args.max_size is None and args.max_bits_per_weight is None:
        raise UsageError(f"--frontier needs a budget: --max-size SIZE (e.g. {EXAMPLES}) and / or "
                         f"--max-bits-per-weight X")
    if args.json_out is not None:  # never over a file this command reads
        check_output_file(args.json_out, inputs=input_paths(args.model, args.frontier))
    resolve_model_source(args.model)  # a local path that is not there is named before the frontier is read
    frontier = load_frontier(args.frontier)
    if frontier.model is not None and not same_model(frontier.model, args.model):
        raise UsageError(f"{args.frontier} was measured on {frontier.model}, not {args.model}: give the frontier of "
                         f"{args.model} ({MAKE_IT.replace('MODEL', args.model)}), or advise {frontier.model}")
    choice = choose_by_size(frontier, SizeBudget(args.max_size, args.max_bits_per_weight))
    print("\n".join(format_size_choice(choice)), file=sys.stderr if output_stream(args.json_out) == 1 else sys.stdout)
    if args.json_out is not None:
        write_output_file(args.json_out, json.dumps(choice.to_dict(), indent=1) + "\n")
    return 0 if choice.chosen is not None else 1


def run_gpu(args: argparse.Namespace) -> int:
    """--gpu, --prompt-len, --output-len: the roofline's advice for the workload."""
    from quantkit.harness.advisor import Workload, advise, format_advice
    from quantkit.harness.hardware import resolve_device_spec
    from quantkit.harness.results import load_quality

    batch = 1 if args.batch is None else args.batch
    min_gain = 10.0 if args.min_gain is None else args.min_gain
    if args.json_out is not None:  # never over a file this command reads
        check_output_file(args.json_out, inputs=input_paths(args.model, *args.quality))
    shape = load_shape(args.model)
    device = resolve_device_spec(args.gpu)
    workload = Workload(args.prompt_len, args.output_len, batch)
    quality = load_quality(args.quality)
    if device.roofline_problem:
        raise UsageError(f"no roofline to advise from: {device.roofline_problem}; pass a known GPU with --gpu")
    advice = advise(
        shape, device, workload, memory_budget=None if args.memory is None else args.memory * 1e9,
        quality=quality, max_ppl_increase=None if args.max_ppl_increase is None else args.max_ppl_increase / 100,
        max_kl=args.max_kl, min_gain=min_gain / 100,
    )
    print("\n".join(format_advice(advice)), file=sys.stderr if output_stream(args.json_out) == 1 else sys.stdout)
    if args.json_out is not None:
        write_output_file(args.json_out, json.dumps(advice.to_dict(), indent=1) + "\n")
    return 0 if advice.recommended is not None else 1
