"""`quantkit advise`: which scheme to serve a model with, for a workload on a GPU, from the roofline
(TTFT, TPOT, total latency, memory) and measured quality."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from quantkit.files.inputs import input_paths

from . import int_at_least, nonnegative_float, positive_float


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "advise", help="recommend a quantization scheme for a workload on a GPU (roofline + measured quality)",
        description=__doc__,
        epilog="Example: quantkit advise ref:small --gpu l4 --prompt-len 2048 --output-len 512 --batch 8 "
               "--memory 20 --quality w8.json w4.json --max-ppl-increase 3",
    )
    p.add_argument("model", help="model folder, hub id, ref:NAME or config.json (only the config is read)")
    p.add_argument("--gpu", required=True, help="known GPU (h200, h100-sxm, h100-pcie, a100, a100-40gb, a10, l4, "
                                                "rtx4090) or 'probe' to measure this machine")
    p.add_argument("--prompt-len", type=int_at_least(1), required=True)
    p.add_argument("--output-len", type=int_at_least(1), required=True)
    p.add_argument("--batch", type=int_at_least(1), default=1)
    p.add_argument("--memory", type=positive_float, help="memory budget in GB (default: the device's memory)")
    p.add_argument("--quality", nargs="+", default=[], metavar="FILE",
                   help="`quantkit eval` JSON files; each is matched to a scheme by its recipe / name")
    p.add_argument("--max-ppl-increase", type=nonnegative_float, help="quality budget: largest perplexity increase, in percent")
    p.add_argument("--max-kl", type=nonnegative_float, help="quality budget: largest KL divergence (nats/token)")
    p.add_argument("--min-gain", type=nonnegative_float, default=10.0,
                   help="percent a faster scheme must gain over a higher-quality one to be preferred (default 10)")
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
    from quantkit.harness.advisor import Workload, advise, format_advice
    from quantkit.harness.hardware import resolve_device_spec
    from quantkit.harness.results import load_quality
    from quantkit.core.errors import UsageError
    from quantkit.files.outputs import check_output_file, output_stream, write_output_file

    if args.json_out is not None:  # never over a file this command reads
        check_output_file(args.json_out, inputs=input_paths(args.model, *args.quality))
    shape = load_shape(args.model)
    device = resolve_device_spec(args.gpu)
    workload = Workload(args.prompt_len, args.output_len, args.batch)
    quality = load_quality(args.quality)
    if device.roofline_problem:
        raise UsageError(f"no roofline to advise from: {device.roofline_problem}; pass a known GPU with --gpu")
    advice = advise(
        shape, device, workload, memory_budget=None if args.memory is None else args.memory * 1e9,
        quality=quality, max_ppl_increase=None if args.max_ppl_increase is None else args.max_ppl_increase / 100,
        max_kl=args.max_kl, min_gain=args.min_gain / 100,
    )
    print("\n".join(format_advice(advice)), file=sys.stderr if output_stream(args.json_out) == 1 else sys.stdout)
    if args.json_out is not None:
        write_output_file(args.json_out, json.dumps(advice.to_dict(), indent=1) + "\n")
    return 0 if advice.recommended is not None else 1
