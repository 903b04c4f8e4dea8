"""`quantkit eval MODEL --baseline BASELINE`: perplexity, KL divergence and top-1 agreement."""

from __future__ import annotations

import argparse
import json
import sys
import time

from quantkit.core.errors import UsageError
from quantkit.files.inputs import input_paths

from . import add_model_options, add_other_baseline_option, int_at_least, torch_dtype

WINDOW_WHY = " (a window of W tokens predicts its tokens 2..W)"
# Tokens evaluated unless --max-tokens says otherwise: minutes on a CPU for a small model, not the whole text.
DEFAULT_MAX_TOKENS = 32768


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity, KL divergence and top-1 agreement against a baseline",
                       description="Evaluate MODEL against BASELINE (the --baseline model) on the same token windows.")
    p.add_argument("model", help="quantized checkpoint or model folder / hub id / ref:NAME")
    p.add_argument("--baseline", required=True, help="the unquantized model (folder, hub id, ref:NAME)")
    add_other_baseline_option(p, "MODEL was")
    p.add_argument("--data", default=None,
                   help="evaluation text: a .txt/.jsonl/.parquet file or folder, or hub:NAME[:CONFIG]:SPLIT:COLUMN (default: the reference models' held-out text)")
    p.add_argument("--window", type=int_at_least(2, WINDOW_WHY), default=None,
                   help="tokens per window, 2 to the model's context (default: min(context, 2048))")
    p.add_argument("--max-tokens", type=int_at_least(2, " (at least one window of 2 tokens)"),
                   default=None,
                   help=f"evaluate the first N tokens of the text (default: {DEFAULT_MAX_TOKENS}, or the whole text "
                        f"if shorter; e.g. 16 windows of 2048, enough to separate W8 from W4 by KL and top-1 "
                        f"agreement; eval says how many tokens the text has, give a larger N to read more, up to "
                        f"that many)")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="windows per forward pass (default: 8)")
    p.add_argument("--backend", default="auto", help="kernel backend for quantized layers (auto, triton, torch, reference)")
    p.add_argument("--json", default=None,
                   help="write the results as JSON to this file (never one of the files the evaluation reads)")
    add_model_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import quantkit
    from quantkit.core.device import check_backend, resolve_device
    from quantkit.gguf.reading import check_gguf_tokenizer, is_gguf_file, load_gguf_tokenizer
    from quantkit.harness.eval_text import check_model_tokenizer, eval_window, load_tokenizer, read_eval_tokens
    from quantkit.files.outputs import check_output_file, output_stream, write_output_file
    from quantkit.modules.model_kernels import kernel_layouts

    check_backend(args.backend, resolve_device(args.device, option="--device"))
    if args.json is not None:  # before any work; never over a file this command reads
        check_output_file(args.json, inputs=input_paths(args.model, args.baseline, args.data))
    dtype = torch_dtype(args.dtype)
    strict = not args.allow_source_mismatch
    baseline = quantkit.load(args.baseline, dtype=dtype, device=args.device, trust_remote_code=args.trust_remote_code,
                             strict=strict)
    model = quantkit.load(args.model, backend=args.backend, dtype=dtype, device=args.device,
                          trust_remote_code=args.trust_remote_code, strict=strict)
    window = eval_window(args.window, baseline.config)
    max_tokens = args.max_tokens or DEFAULT_MAX_TOKENS
    if max_tokens < window:
        raise UsageError(f"--max-tokens {max_tokens} is less than one window of {window} tokens; "
                         f"give --max-tokens {window} or more, or a smaller --window")
    tokenizer = load_gguf_tokenizer(args.baseline) if is_gguf_file(args.baseline) else load_tokenizer(args.baseline)
    text = read_eval_tokens(tokenizer, args.data, max_tokens)  # reads only what it needs
    if args.max_tokens is not None and text.whole and text.ids.numel() < args.max_tokens:
        raise UsageError(f"--max-tokens {args.max_tokens} is more than the evaluation text has: "
                         f"{text.ids.numel()} tokens; give --max-tokens {text.ids.numel()} or less, or more text")
    from quantkit.harness.quality import check_comparable, evaluate_quality, token_windows

    windows = token_windows(text.ids, window, max_tokens)  # [N, W]: the first max_tokens tokens, whole windows
    check_comparable({"model": model}, baseline, windows,
                     allow_other_baseline=args.allow_other_baseline)  # before the models run for the time estimate
    if is_gguf_file(args.model):  # a GGUF file carries its vocabulary: it must be the baseline's
        used = check_gguf_tokenizer(args.model, tokenizer, args.baseline)
    else:  # the checkpoint's own tokenizer files must agree
        used = check_model_tokenizer(args.model, args.baseline, tokenizer)

    of_text = f"of the text's {text.ids.numel()} tokens" if text.whole else "tokens from the start of the text"
    print(f"eval: {windows.shape[0]} windows of {window} tokens = {windows.numel()} {of_text} "
          f"(--max-tokens {max_tokens}), tokenized with {used}; "
          f"expect up to ~{_estimate_seconds(model, baseline, windows):.0f} s (one window timed through both models, "
          f"times {windows.shape[0]}; batches of {args.batch_size} run faster)", file=sys.stderr, flush=True)

    if "cpu_q8" in kernel_layouts(model):
        print("eval: the quantized linears run quantkit's C++ CPU kernel, which rounds their inputs to int8 in "
              "blocks of 32 for prompts as for decode, so the figures include that rounding (--backend reference "
              "scores the weights alone)", file=sys.stderr, flush=True)
    result = evaluate_quality(model, baseline, windows, batch_size=args.batch_size,
                              allow_other_baseline=args.allow_other_baseline).to_dict()
    result.update(model=str(args.model), baseline=str(args.baseline), data=args.data or "reference held-out text",
                  tokenizer=used)
    from quantkit.harness.formatting import fmt_perplexity_change

    shown = sys.stderr if output_stream(args.json) == 1 else sys.stdout  # the JSON alone on a standard output
    change = fmt_perplexity_change(result["perplexity"], result["baseline_perplexity"], result["log_ppl_ratio_stderr"])
    noise = "; ± is two standard errors over windows" if result["log_ppl_ratio_stderr"] is not None else ""
    print(f"perplexity  {result['perplexity']:.4f}  (baseline {result['baseline_perplexity']:.4f}, {change}{noise})",
          file=shown)
    print(f"KL          {result['kl_divergence']:.6f} nats/token", file=shown)
    print(f"top-1 agree {result['top1_agreement']:.4f}", file=shown)
    print(f"over {result['windows']} windows of {result['window']} tokens ({result['tokens']} predictions)", file=shown)
    if args.json is not None:
        write_output_file(args.json, json.dumps(result, indent=2, allow_nan=False) + "\n")
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
