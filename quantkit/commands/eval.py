"""`quantkit eval MODEL --baseline BASE`: perplexity, KL divergence and top-1 agreement."""

from __future__ import annotations

import argparse
import json

from . import DTYPES, add_model_options, check_backend, positive_int


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity, KL divergence and top-1 agreement against a baseline",
                       description="Evaluate MODEL against BASE on the same token windows.")
    p.add_argument("model", help="quantized checkpoint or model folder / hub id / ref:NAME")
    p.add_argument("--baseline", required=True, help="the unquantized model (folder, hub id, ref:NAME)")
    p.add_argument("--data", default=None,
                   help="evaluation text: a .txt/.jsonl/.parquet file or folder, or hub:NAME[:CONFIG]:SPLIT:COLUMN (default: the reference models' held-out text)")
    p.add_argument("--window", type=int, default=None, help="tokens per window (default: min(context, 2048))")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the text")
    p.add_argument("--batch-size", type=positive_int, default=8, help="windows per forward pass (default 8)")
    p.add_argument("--backend", default="auto", help="kernel backend for quantized layers (auto, triton, torch, reference)")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    add_model_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import quantkit
    from quantkit.device import resolve_device
    from quantkit.eval.data import eval_token_windows
    from quantkit.outputs import atomic_write_text, check_writable

    resolve_device(args.device, option="--device")
    check_backend(args.backend)
    if args.json:
        check_writable(args.json, force=True, file=True)  # before any work
    dtype = DTYPES[args.dtype]
    baseline = quantkit.load(args.baseline, dtype=dtype, device=args.device, trust_remote_code=args.trust_remote_code)
    model = quantkit.load(args.model, backend=args.backend, dtype=dtype, device=args.device,
                          trust_remote_code=args.trust_remote_code)
    windows = eval_token_windows(args.baseline, args.data, window=args.window, max_tokens=args.max_tokens,
                                 model_config=baseline.config)
    from quantkit.eval.quality import evaluate_quality

    result = evaluate_quality(model, baseline, windows, batch_size=args.batch_size).to_dict()
    result.update(model=str(args.model), baseline=str(args.baseline), data=args.data or "reference held-out text")
    print(f"perplexity  {result['perplexity']:.4f}  (baseline {result['baseline_perplexity']:.4f}, "
          f"{result['perplexity'] / result['baseline_perplexity'] - 1:+.2%})")
    print(f"KL          {result['kl_divergence']:.6f} nats/token")
    print(f"top-1 agree {result['top1_agreement']:.4f}")
    print(f"over {result['windows']} windows of {result['window']} tokens ({result['tokens']} predictions)")
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0
