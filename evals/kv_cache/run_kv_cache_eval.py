"""FP8 KV-cache evaluation: quality (perplexity, KL vs fp32 KV), cache bytes per token, decode time.

    python evals/kv_cache/run_kv_cache_eval.py                       # reference model, CPU
    python evals/kv_cache/run_kv_cache_eval.py --model random        # random small Llama (no quality meaning)
    python evals/kv_cache/run_kv_cache_eval.py --gpu                 # + decode attention at 1k-128k on CUDA

Writes <out>/kv_cache_eval.json and <out>/kv_cache_eval.md (default out: evals/kv_cache/results).

Quality: the fp32 model runs non-overlapping windows of the held-out text once per KV variant, the
cache returning what it stores to every position (prefill included); KL is KL(P_fp32 KV || P_variant)
of the next-token distributions. Scales are calibrated on windows of the same text that precede,
and do not overlap, the evaluation windows.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_timing import decode_step_times  # noqa: E402
from kv_variants import WithCache, cache_bytes, cache_factories, magnify_kv, unit_scales  # noqa: E402

from transformers.cache_utils import DynamicCache  # noqa: E402

from quantkit.calibration.kv_scales import calibrate_kv_scales  # noqa: E402
from quantkit.modules.kv_cache import FP8KVCache  # noqa: E402
from quantkit.harness.quality import evaluate_quality, token_windows  # noqa: E402

HERE = Path(__file__).resolve().parent


def random_llama(seed: int = 0):
    """A random small Llama (GQA 8:2, head_dim 64) for when no trained reference model is available."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=8192, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def kv_heavy_llama(seed: int = 0):
    """A random 2-layer Llama whose attention has a 7B-class shape (8 KV heads x 128): 4 KiB of bf16 KV
    per token and layer, so that reading the cache weighs in a CPU decode step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=8, head_dim=128, vocab_size=8192, max_position_embeddings=16384)
    return LlamaForCausalLM(config).eval()


def load_model_and_tokens(name: str, window: int, total_windows: int, seed: int):
    """(fp32 model, token windows [N, window], description of model and text)."""
    if name == "random":
        model = random_llama(seed)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (total_windows * window,), generator=g)
        return model, token_windows(ids, window), {"model": "random Llama (untrained)", "text": "random tokens"}
    from quantkit.harness.eval_text import eval_token_windows
    from quantkit.formats.loading import load_float_model

    model = load_float_model(name, dtype=torch.float32).eval()
    windows = eval_token_windows(name, None, window=window, max_tokens=total_windows * window)
    return model, windows, {"model": name, "text": "reference held-out text"}


def quality_rows(model, windows, factories) -> list[dict]:
    baseline = WithCache(model, factories["fp32 KV (baseline)"])
    rows = []
    for name, make_cache in factories.items():
        result = evaluate_quality(WithCache(model, make_cache), baseline, windows, batch_size=4, progress=False)
        rows.append({"variant": name, **result.to_dict()})
    return rows


def magnified_rows(model, calibration, evaluation, factors) -> list[dict]:
    """KL of FP8 KV (calibrated vs scale 1.0) when K/V are magnified by each factor (same function)."""
    rows = []
    for factor in factors:
        magnify_kv(model, factor)
        try:
            scales = calibrate_kv_scales(model, calibration.split(4))
            baseline = WithCache(model, lambda: DynamicCache(config=model.config))
            for name, kv_scales in (("calibrated", scales), ("scale 1.0", unit_scales(model))):
                variant = WithCache(model, lambda s=kv_scales: FP8KVCache(model.config, s))
                result = evaluate_quality(variant, baseline, evaluation, batch_size=4, progress=False)
                k_absmax = max(448 * k.max().item() for k, _ in scales.values())
                rows.append({"factor": factor, "scales": name, "max_key_absmax": k_absmax, **result.to_dict()})
        finally:
            magnify_kv(model, 1 / factor)
    return rows


def bytes_rows(model, window_ids, factories) -> list[dict]:
    rows = []
    with torch.no_grad():
        for name, make_cache in factories.items():
            cache = make_cache()
            model(input_ids=window_ids[:1], cache=cache, use_cache=True)
            rows.append({"variant": name, "bytes_per_token": cache_bytes(cache) / window_ids.shape[1]})
    return rows


def markdown(report: dict) -> str:
    lines = [
        "# FP8 KV cache: quality, memory, decode time",
        "",
        f"Reproduce: `{report['command']}`  ",
        f"Model: {report['setup']['model']}; text: {report['setup']['text']}; window {report['setup']['window']} "
        f"tokens, {report['setup']['calibration_windows']} calibration windows, {report['setup']['eval_windows']} "
        f"evaluation windows. Machine: {report['machine']}.",
        "",
        "## Quality against the fp32-KV model (same weights)",
        "",
        "| KV cache | perplexity | KL(fp32 KV ‖ variant) | top-1 agreement |",
        "|---|---:|---:|---:|",
    ]
    for r in report["quality"]:
        lines.append(
            f"| {r['variant']} | {r['perplexity']:.4f} | {r['kl_divergence']:.3e} | {r['top1_agreement']:.4f} |"
        )
    lines += [
        "",
        "## Why calibrate: the same model with its keys and values magnified (function unchanged)",
        "",
        "k_proj and v_proj multiplied by a factor, q_proj and o_proj divided by it: the fp32 model computes "
        "the same function, only the cached magnitudes move. e4m3 saturates at 448 and loses precision "
        "below 2^-6; calibrated scales follow the data, scale 1.0 does not.",
        "",
        "| K/V factor | largest key absmax | scales | perplexity | KL(fp32 KV ‖ FP8 KV) | top-1 agreement |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for r in report["magnified"]:
        lines.append(f"| {r['factor']:g} | {r['max_key_absmax']:.3g} | {r['scales']} | {r['perplexity']:.4f} | "
                     f"{r['kl_divergence']:.3e} | {r['top1_agreement']:.4f} |")
    lines += ["", "## Cache bytes per token (all layers, K and V)", "", "| KV cache | bytes/token |", "|---|---:|"]
    for r in report["bytes"]:
        lines.append(f"| {r['variant']} | {r['bytes_per_token']:.0f} |")
    lines += [
        "",
        "## Decode step time vs context (CPU, batch 1, models in bf16, measured side by side)",
        "",
        "The FP8 cache dequantizes the whole cache to bf16 every step before the model's own attention "
        "(a 256-entry table lookup on CPU; no fused kernel there). Absolute CPU times mean little; read the "
        "ratio.",
        "",
        "| model | context | bf16 cache MiB | FP8 cache MiB | FP8 / bf16 step time |",
        "|---|---:|---:|---:|---:|",
    ]
    for model_name, rows in report["cpu_decode"].items():
        for r in rows:
            lines.append(f"| {model_name} | {r['context']} | {r['bf16_cache_mib']:.2f} | {r['fp8_cache_mib']:.2f} | "
                         f"{r['fp8_over_bf16_time']:.2f}x |")
    gpu = report.get("gpu")
    if gpu:
        lines += [
            "",
            f"## Decode attention on {gpu['device']} (Hq={gpu['shape']['num_q_heads']}, "
            f"Hkv={gpu['shape']['num_kv_heads']}, D={gpu['shape']['head_dim']}; copy bandwidth "
            f"{gpu['copy_bandwidth_gbs']:.0f} GB/s)",
            "",
            "| batch | context | variant | graph µs | eager µs | GB/s | % of copy BW |",
            "|---:|---:|---|---:|---:|---:|---:|",
        ]
        for r in gpu["rows"]:
            graph = f"{1e3 * r['graph_ms']:.1f}" if r.get("graph_ms") else "n/a"
            lines.append(f"| {r['batch']} | {r['context']} | {r['variant']} | {graph} | {1e3 * r['eager_ms']:.1f} | "
                         f"{r['achieved_gbs']:.0f} | {100 * r['fraction_of_copy_bw']:.0f}% |")
    if report.get("gpu_decode"):
        lines += [
            "",
            "## Decode step time vs context on the GPU (random 2-layer Llama, 8 KV heads x 128, batch 1)",
            "",
            "FP8 cache read by the Triton kernel (attention implementation quantkit_fp8) against a bf16 "
            "DynamicCache read by SDPA; whole-model steps, eager.",
            "",
            "| context | bf16 step ms | FP8 step ms | FP8 / bf16 step time |",
            "|---:|---:|---:|---:|",
        ]
        for r in report["gpu_decode"]:
            lines.append(f"| {r['context']} | {r['bf16_step_ms']:.3f} | {r['fp8_step_ms']:.3f} | "
                         f"{r['fp8_over_bf16_time']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ref:small", help="model folder, ref:<name>, or 'random'")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--calibration-windows", type=int, default=8)
    parser.add_argument("--eval-windows", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--magnify", type=float, nargs="*", default=[1 / 64, 256],
                        help="K/V magnification factors for the calibration experiment")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps side-by-side timing fair)")
    parser.add_argument("--gpu", action="store_true", help="also benchmark decode attention on CUDA")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    started = time.time()
    total = args.calibration_windows + args.eval_windows
    model, windows, setup = load_model_and_tokens(args.model, args.window, total, args.seed)
    if windows.shape[0] < total:
        raise SystemExit(f"the text has {windows.shape[0]} windows of {args.window} tokens; {total} are needed")
    calibration, evaluation = windows[: args.calibration_windows], windows[args.calibration_windows: total]
    scales = calibrate_kv_scales(model, calibration.split(4))
    per_head_scales = calibrate_kv_scales(model, calibration.split(4), per_head=True)
    factories = cache_factories(model, scales, per_head_scales)

    report = {
        "command": "python evals/kv_cache/run_kv_cache_eval.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()}, torch {torch.__version__}, {args.threads} CPU thread(s)",
        "setup": {**setup, "window": args.window, "calibration_windows": args.calibration_windows,
                  "eval_windows": args.eval_windows,
                  "num_kv_heads": model.config.num_key_value_heads, "layers": model.config.num_hidden_layers},
        "scales": {str(i): [k.tolist(), v.tolist()] for i, (k, v) in scales.items()},
        "quality": quality_rows(model, evaluation, factories),
        "magnified": magnified_rows(model, calibration, evaluation, args.magnify),
        "bytes": bytes_rows(model, evaluation, factories),
    }
    heavy = kv_heavy_llama(args.seed).to(torch.bfloat16)
    report["cpu_decode"] = {
        setup["model"]: decode_step_times(model.to(torch.bfloat16), args.contexts, scales),
        "random 2-layer Llama, 8 KV heads x 128": decode_step_times(heavy, args.contexts, unit_scales(heavy)),
    }
    if args.gpu:
        from gpu_bench import bench_decode_attention

        from quantkit.modules.kv_cache import enable_fp8_kv_cache

        report["gpu"] = bench_decode_attention()
        heavy = enable_fp8_kv_cache(heavy.cuda(), attention="kernel")  # FP8 decode steps through the Triton op
        report["gpu_decode"] = decode_step_times(heavy, [4096, 16384, 32768], unit_scales(heavy), attention="kernel")
    report["seconds"] = time.time() - started

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_cache_eval.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "kv_cache_eval.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
