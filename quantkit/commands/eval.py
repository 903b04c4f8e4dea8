"""`quantkit eval MODEL --baseline BASE`: perplexity, KL divergence and top-1 agreement."""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import add_model_options, check_backend, int_at_least, torch_dtype

WINDOW_WHY = " (a window of W tokens predicts its tokens 2..W)"
# Tokens evaluated unless --max-tokens says otherwise: minutes on a CPU for a small model, not the whole text.
DEFAULT_MAX_TOKENS = 32768


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity, KL divergence and top-1 agreement against a baseline",
                       description="Evaluate MODEL against BASE on the same token windows.")
    p.add_argument("model", help="quantized checkpoint or model folder / hub id / ref:NAME")
    p.add_argument("--baseline", required=True, help="the unquantized model (folder, hub id, ref:NAME)")
    p.add_argument("--allow-other-baseline", action="store_true",
                   help="compare with a baseline that is not the model MODEL was quantized from (by default its "
                        "shapes and embeddings must match MODEL's, and a different model is refused)")
    p.add_argument("--data", default=None,
                   help="evaluation text: a .txt/.jsonl/.parquet file or folder, or hub:NAME[:CONFIG]:SPLIT:COLUMN (default: the reference models' held-out text)")
    p.add_argument("--window", type=int_at_least(2, WINDOW_WHY), default=None,
                   help="tokens per window, 2 to the model's context (default: min(context, 2048))")
    p.add_argument("--max-tokens", type=int_at_least(2, " (at least one window of 2 tokens)"),
                   default=DEFAULT_MAX_TOKENS,
                   help=f"evaluate the first N tokens of the text (default: {DEFAULT_MAX_TOKENS}, e.g. 16 windows of "
                        f"2048, enough to separate W8 from W4 by KL and top-1 agreement; eval says how many tokens "
                        f"the text has, give a larger N to read more)")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="windows per forward pass (default: 8)")
    p.add_argument("--backend", default="auto", help="kernel backend for quantized layers (auto, triton, torch, reference)")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    add_model_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import quantkit
    from quantkit.device import resolve_device
    from quantkit.errors import UsageError
    from quantkit.harness.eval_text import eval_token_windows
    from quantkit.outputs import atomic_write_text, check_writable

    resolve_device(args.device, option="--device")
    check_backend(args.backend)
    if args.json:
        check_writable(args.json, force=True, file=True)  # before any work
    dtype = torch_dtype(args.dtype)
    baseline = quantkit.load(args.baseline, dtype=dtype, device=args.device, trust_remote_code=args.trust_remote_code)
    model = quantkit.load(args.model, backend=args.backend, dtype=dtype, device=args.device,
                          trust_remote_code=args.trust_remote_code)
    all_windows = eval_token_windows(args.baseline, args.data, window=args.window, model_config=baseline.config)
    window = all_windows.shape[1]
    if args.max_tokens < window:
        raise UsageError(f"--max-tokens {args.max_tokens} is less than one window of {window} tokens; "
                         f"give --max-tokens {window} or more, or a smaller --window")
    windows = all_windows[: args.max_tokens // window]  # [N, W]: the first max_tokens tokens, whole windows
    from quantkit.harness.quality import check_comparable, evaluate_quality

    check_comparable({"model": model}, baseline, windows,
                     allow_other_baseline=args.allow_other_baseline)  # before the models run for the time estimate

    print(f"eval: {windows.shape[0]} windows of {window} tokens = {windows.numel()} of the text's "
          f"{all_windows.numel()} tokens (--max-tokens {args.max_tokens}); "
          f"expect up to ~{_estimate_seconds(model, baseline, windows):.0f} s (one window timed through both models, "
          f"times {windows.shape[0]}; batches of {args.batch_size} run faster)", file=sys.stderr, flush=True)

    result = evaluate_quality(model, baseline, windows, batch_size=args.batch_size,
                              allow_other_baseline=args.allow_other_baseline).to_dict()
    result.update(model=str(args.model), baseline=str(args.baseline), data=args.data or "reference held-out text")
    from quantkit.harness.formatting import fmt_perplexity_change

    change = fmt_perplexity_change(result["perplexity"], result["baseline_perplexity"], result["log_ppl_ratio_stderr"])
    print(f"perplexity  {result['perplexity']:.4f}  (baseline {result['baseline_perplexity']:.4f}, {change}"
          f"{'; ± is two standard errors over windows' if result['log_ppl_ratio_stderr'] is not None else ''})")
    print(f"KL          {result['kl_divergence']:.6f} nats/token")
    print(f"top-1 agree {result['top1_agreement']:.4f}")
    print(f"over {result['windows']} windows of {result['window']} tokens ({result['tokens']} predictions)")
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0


def _estimate_seconds(model, baseline, windows) -> float:
    """Seconds to evaluate ``windows`` ([N, W] int64): one window timed through both models after a
    short warm-up call (first calls pay one-time setup), times N. Batches of several windows run
    faster per window, so the real time is usually lower."""
    import torch

    with torch.no_grad():
        for m in (baseline, model):
            m(windows[:1, :8].to(next(m.parameters()).device))  # [1, 8] warm-up
        start = time.perf_counter()
        for m in (baseline, model):
            m(windows[:1].to(next(m.parameters()).device))  # [1, W]
    return (time.perf_counter() - start) * windows.shape[0]
