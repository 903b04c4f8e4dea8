"""`quantkit bench`: TTFT over prompt lengths and TPOT over context lengths and batch sizes, for a
float baseline and its quantized variants, side by side and against the roofline."""

from __future__ import annotations

import argparse

from quantkit.core.errors import UsageError
from quantkit.harness.benchmark import CPU_DEFAULTS, GPU_DEFAULTS

from . import add_other_baseline_option, add_source_mismatch_option, int_at_least, positive_float


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="time prefill (TTFT) and decode (TPOT) of a model and its quantized variants",
        description=__doc__,
        epilog="Example: quantkit bench ref:small --variants w8a16-rtn,w4a16-rtn --json bench.json",
    )
    p.add_argument("model", help="float model (folder, hub id, ref:NAME, or a config.json for a random model) "
                                 "or a quantized checkpoint folder (then give --baseline)")
    p.add_argument("--baseline", help="float model to compare with when MODEL is a quantized checkpoint")
    p.add_argument("--variants", nargs="+", default=[], metavar="RECIPE_OR_DIR",
                   help="recipes (applied to the float model) or quantized checkpoint folders; comma or space separated")
    p.add_argument("--json", dest="json_out", help="write the results here")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: cuda if available)")
    p.add_argument("--dtype", default="auto",
                   help="model dtype: auto | bf16 | fp16 | fp32 (default auto: bf16 on GPU; on CPU each phase in "
                        "the dtype measured fastest here, since CPUs without native bf16 emulate bf16 matmuls)")
    p.add_argument("--backend", default="auto", help="kernel backend of quantized linears (default auto)")
    p.add_argument("--prompt-lens", type=int_list, help=f"TTFT prompt lengths (GPU default {_csv(GPU_DEFAULTS['prompt_lens'])}; "
                                                        f"CPU {_csv(CPU_DEFAULTS['prompt_lens'])})")
    p.add_argument("--context-lens", type=int_list, help=f"TPOT context lengths (GPU default {_csv(GPU_DEFAULTS['context_lens'])}; "
                                                         f"CPU {_csv(CPU_DEFAULTS['context_lens'])})")
    p.add_argument("--batch-sizes", type=int_list, help=f"TPOT batch sizes (GPU default {_csv(GPU_DEFAULTS['batch_sizes'])}; "
                                                        f"CPU {_csv(CPU_DEFAULTS['batch_sizes'])})")
    p.add_argument("--prefill-batch-sizes", type=int_list, default=[1], help="TTFT batch sizes (default 1)")
    p.add_argument("--warmup", type=int_at_least(0), default=2, help="untimed runs per shape (default 2)")
    p.add_argument("--repeats", type=int_at_least(1), default=5, help="timed runs per shape; the median is reported (default 5)")
    p.add_argument("--gpu", default="probe", help="roofline device: a known GPU name (h200, h100-sxm, a100, ...) or "
                                                  "'probe' to measure this device (default)")
    p.add_argument("--max-cache-gb", type=positive_float, help="skip decode shapes whose KV cache exceeds this (default: "
                                                      "a quarter of the memory of the device timed: the GPU's, or "
                                                      "the RAM on CPU)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="time eager decode steps on GPU")
    p.add_argument("--compile", nargs="?", const="all", choices=("all", "decode"),
                   help="run every variant's forward (baseline included) through torch.compile, in both phases "
                        "(all, the default) or in decode only; on GPU the compiled decode step is replayed as a "
                        "CUDA graph")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend for --compile (default inductor; aot_eager/eager only trace)")
    p.add_argument("--decode-loop", choices=("transformers", "quantkit"), default="transformers",
                   help="how decode steps run: the model's transformers forward (default), or quantkit's C++ loop "
                        "(quantkit.CpuDecoder: CPU, Llama/Mistral/Qwen2/Qwen3; every variant, baseline included); "
                        "prefill always runs in transformers")
    p.add_argument("--threads", type=int_at_least(1), help="CPU threads (torch.set_num_threads)")
    p.add_argument("--seed", type=int, default=0, help="seed of random models, prompts and caches")
    p.add_argument("--quiet", action="store_true", help="no progress lines (by default each step and each "
                                                        "measured shape is announced on stderr as it starts)")
    add_source_mismatch_option(p)
    add_other_baseline_option(p, "the checkpoints (MODEL, --variants folders) were",
                              "; its shapes must still match: every variant is timed on them")
    p.set_defaults(func=run)


def _split(values: list[str]) -> list[str]:
    return [v for item in values for v in item.split(",") if v]


def _csv(values) -> str:
    return ",".join(map(str, values))


def run(args: argparse.Namespace) -> int:
    from quantkit.harness.benchmark import benchmark

    if args.compile_backend is not None and not args.compile:
        raise UsageError(f"--compile-backend {args.compile_backend} takes effect only with --compile; add --compile "
                         f"(or drop --compile-backend)")
    benchmark(
        args.model, baseline=args.baseline, variants=_split(args.variants), json_out=args.json_out,
        device=args.device, dtype=args.dtype, backend=args.backend, prompt_lens=args.prompt_lens,
        context_lens=args.context_lens, batch_sizes=args.batch_sizes, prefill_batch_sizes=args.prefill_batch_sizes,
        warmup=args.warmup, repeats=args.repeats, gpu=args.gpu, max_cache_gb=args.max_cache_gb,
        cuda_graphs=not args.no_cuda_graphs, compile=args.compile, compile_backend=args.compile_backend or "inductor",
        threads=args.threads, seed=args.seed, quiet=args.quiet, decode_loop=args.decode_loop,
        allow_source_mismatch=args.allow_source_mismatch,
        allow_other_baseline=args.allow_other_baseline,
    )
    return 0
