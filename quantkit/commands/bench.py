"""`quantkit bench`: TTFT over prompt lengths and TPOT over context lengths and batch sizes, for a
float baseline and its quantized variants, side by side and against the roofline."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from . import (add_other_baseline_option, add_source_mismatch_option, check_backend, input_paths, int_at_least,
               positive_float)

GPU_DEFAULTS = {"prompt_lens": "128,512,1024,2048,4096", "context_lens": "128,512,1024,2048,4096",
                "batch_sizes": "1,4,16,64"}
# Environment variables that change timings; recorded with the command line.
TIMING_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")
CPU_DEFAULTS = {"prompt_lens": "32,128,512", "context_lens": "128,512,2048", "batch_sizes": "1,4,16"}


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
    p.add_argument("--prompt-lens", type=int_list, help=f"TTFT prompt lengths (GPU default {GPU_DEFAULTS['prompt_lens']}; "
                                                        f"CPU {CPU_DEFAULTS['prompt_lens']})")
    p.add_argument("--context-lens", type=int_list, help=f"TPOT context lengths (GPU default {GPU_DEFAULTS['context_lens']}; "
                                                         f"CPU {CPU_DEFAULTS['context_lens']})")
    p.add_argument("--batch-sizes", type=int_list, help=f"TPOT batch sizes (GPU default {GPU_DEFAULTS['batch_sizes']}; "
                                                        f"CPU {CPU_DEFAULTS['batch_sizes']})")
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


def _command_line(model: str, baseline: str | None, variants: list[str], device, settings, *, dtype: str,
                  backend: str, gpu: str, seed: int, max_cache_gb: float | None, cuda_graphs: bool,
                  compile: str | None, compile_backend: str, threads: int | None, json_out: str | None,
                  decode_loop: str = "transformers", allow_source_mismatch: bool = False, allow_other_baseline: bool = False) -> str:
    """The command that repeats this measurement (every setting spelled out)."""
    import shlex

    def csv(values):
        return ",".join(str(v) for v in values)

    parts = ["quantkit", "bench", model]
    if baseline:
        parts += ["--baseline", baseline]
    if variants:
        parts += ["--variants", ",".join(variants)]
    parts += ["--device", str(device), "--dtype", dtype, "--backend", backend,
              "--prompt-lens", csv(settings.prompt_lens), "--context-lens", csv(settings.context_lens),
              "--batch-sizes", csv(settings.batch_sizes), "--prefill-batch-sizes", csv(settings.prefill_batch_sizes),
              "--warmup", str(settings.warmup), "--repeats", str(settings.repeats), "--gpu", gpu,
              "--seed", str(seed)]
    if max_cache_gb:
        parts += ["--max-cache-gb", str(max_cache_gb)]
    if not cuda_graphs:
        parts.append("--no-cuda-graphs")
    if compile:
        parts += ["--compile", compile]
        if compile_backend != "inductor":
            parts += ["--compile-backend", compile_backend]
    if decode_loop != "transformers":
        parts += ["--decode-loop", decode_loop]
    if threads:
        parts += ["--threads", str(threads)]
    if json_out:
        parts += ["--json", json_out]
    if allow_source_mismatch:
        parts.append("--allow-source-mismatch")
    if allow_other_baseline:
        parts.append("--allow-other-baseline")
    env = [f"{k}={os.environ[k]}" for k in TIMING_ENV if os.environ.get(k)]
    return shlex.join(env + parts)


def _say(quiet: bool, message: str) -> None:
    """A progress line on stderr (stdout keeps the results), unless quiet."""
    if not quiet:
        print(f"bench: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.compile_backend is not None and not args.compile:
        from quantkit.errors import UsageError

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


def benchmark(
    model: str,
    *,
    baseline: str | None = None,
    variants: Sequence[str] = (),
    json_out: str | os.PathLike | None = None,
    device: str = "auto",
    dtype: str = "auto",
    backend: str = "auto",
    prompt_lens: Sequence[int] | None = None,
    context_lens: Sequence[int] | None = None,
    batch_sizes: Sequence[int] | None = None,
    prefill_batch_sizes: Sequence[int] = (1,),
    warmup: int = 2,
    repeats: int = 5,
    gpu: str = "probe",
    max_cache_gb: float | None = None,
    cuda_graphs: bool = True,
    compile: str | None = None,
    compile_backend: str = "inductor",
    decode_loop: str = "transformers",
    threads: int | None = None,
    seed: int = 0,
    quiet: bool = False,
    allow_source_mismatch: bool = False,
    allow_other_baseline: bool = False,
    model_label: str | None = None,
) -> dict:
    """Time prefill (TTFT) and decode (TPOT) of `model` and its `variants` (recipes or quantized
    checkpoint folders), as `quantkit bench` does: the keywords are its options (None: the device's
    default lengths and batch sizes; `cuda_graphs=False` is --no-cuda-graphs; `compile` is None, "all"
    or "decode"). Prints the summary (and progress lines on stderr unless `quiet`), writes `json_out`
    when given, and returns the results as written there. `model_label`: how the results name the
    model (default: the float model's source as given). A checkpoint variant's float baseline must be
    the model it was quantized from (harness/baseline.py); `allow_other_baseline` lets it be another
    model of the same shapes.
    """
    import torch

    from quantkit.harness.hardware import device_memory_bytes, resolve_device_spec
    from quantkit.harness.report import summary_lines
    from quantkit.dtypes import parse_dtype
    from quantkit.harness.timing import BenchSettings, merge_phases, run_bench
    from quantkit.harness.variants import build_variant, float_variant, load_source_model, refuse_gguf_sources
    from quantkit.device import check_cpu_threads, resolve_device
    from quantkit.errors import UsageError
    from quantkit.loading import is_quantized_checkpoint, resolve_model_source
    from quantkit.outputs import check_output_file, output_stream, write_output_file

    if compile not in (None, "all", "decode"):
        raise UsageError(f"compile is None, 'all' or 'decode', not {compile!r}")
    if json_out is not None:
        json_out = os.fspath(json_out)
    if threads:
        torch.set_num_threads(check_cpu_threads(threads))
    if device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = resolve_device(device, option="--device")
    check_backend(backend, device)
    refuse_gguf_sources(model, baseline, variants)
    if json_out is not None:  # before any work; never over a file this command reads
        check_output_file(json_out,
                          inputs=input_paths(model, baseline, *variants))
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    settings = BenchSettings(  # checked before any work; the cache limit follows from the device's memory
        prompt_lens=list(prompt_lens) if prompt_lens else int_list(defaults["prompt_lens"]),
        context_lens=list(context_lens) if context_lens else int_list(defaults["context_lens"]),
        batch_sizes=list(batch_sizes) if batch_sizes else int_list(defaults["batch_sizes"]),
        prefill_batch_sizes=list(prefill_batch_sizes), warmup=warmup, repeats=repeats,
        cuda_graphs=cuda_graphs, seed=seed,
        compile_backend=compile_backend if compile else None,
        compile_prefill=compile == "all", decode_loop=decode_loop,
    )
    features = None
    if device.type == "cpu":
        from quantkit.harness.cpu_features import detect_cpu_features

        features = detect_cpu_features()
    if dtype == "auto":
        phase_dtypes = {"prefill": torch.bfloat16, "decode": torch.bfloat16} if features is None else {
            "prefill": getattr(torch, features.prefill_dtype), "decode": getattr(torch, features.decode_dtype)}
        dtype_reasons = {p: "bf16 on GPU (--dtype auto)" if features is None else features.choice_reason(p)
                         for p in phase_dtypes}
    else:
        phase_dtypes = dict.fromkeys(("prefill", "decode"), parse_dtype(dtype))
        dtype_reasons = dict.fromkeys(phase_dtypes, f"--dtype {dtype}")
        if features is not None and phase_dtypes["prefill"] == torch.bfloat16 and features.prefill_dtype != "bfloat16":
            mm = features.matmul_flops
            print(f"warning: this CPU's bf16 matmul measured {mm['bfloat16'] / 1e9:.3g} GFLOP/s against "
                  f"{mm['float32'] / 1e9:.3g} in float32: bf16 prefill timings will measure that, not the model "
                  "(--dtype auto times each phase in the dtype fastest here)", file=sys.stderr)
    for phase, reason in dtype_reasons.items():
        _say(quiet, f"{phase} runs in {str(phase_dtypes[phase]).removeprefix('torch.')} ({reason})")
    if gpu.strip().lower() == "probe":
        _say(quiet, f"measuring the memory bandwidth and matmul peak of {device} (the roofline's device)")
    spec = resolve_device_spec(gpu, device, dtype=phase_dtypes["prefill"])
    # a quarter of the memory of the device timed (not of --gpu's, which only prices the roofline)
    settings.max_cache_bytes = max_cache_gb * 2**30 if max_cache_gb else device_memory_bytes(device) / 4
    variant_specs = list(variants)
    model_is_checkpoint = not model.endswith(".json") and is_quantized_checkpoint(resolve_model_source(model))
    if model_is_checkpoint:
        variant_specs.insert(0, model)
        base_source = baseline
    elif baseline:
        raise UsageError("--baseline is for a quantized MODEL; MODEL is a float model and is the baseline")
    else:
        base_source = model
    if base_source is None and any(not Path(s).is_dir() for s in variant_specs):
        raise UsageError("recipes need a float model: give it with --baseline")
    one_dtype = phase_dtypes["prefill"] == phase_dtypes["decode"]
    # On CPU, "auto" would give float32 models the slow pure-torch reference path; a speed benchmark
    # wants PyTorch's weight-only kernels (they take activations in bf16) whatever the model dtype.
    kernel_backend = "torch" if backend == "auto" and device.type == "cpu" else backend

    def build(model_dtype):
        base = None
        if base_source is not None:
            _say(quiet, f"loading {base_source} ({str(model_dtype).removeprefix('torch.')}, {device})")
            base = load_source_model(base_source, dtype=model_dtype, device=device, seed=seed,
                                     strict=not allow_source_mismatch)
        # one float baseline for both phases, whatever dtype each phase runs in
        built = [float_variant(base, name=None if one_dtype else "float")] if base is not None else []
        for i, s in enumerate(variant_specs):
            _say(quiet, f"preparing variant {i + 1}/{len(variant_specs)}: {s} "
                        f"({'loading the checkpoint' if Path(s).is_dir() else 'quantizing a copy of the float model'})")
            built.append(build_variant(s, base, dtype=model_dtype, device=device, backend=kernel_backend))
            if base is not None and Path(s).is_dir():
                _check_baseline(built[-1].model, base, s, allow_other_baseline)
        return built

    if decode_loop == "quantkit" and device.type != "cpu":
        raise UsageError(f"--decode-loop quantkit runs on the CPU, not {device}: drop it on a GPU")
    label = model_label or str(base_source or model)
    built = build(phase_dtypes["prefill"])
    if decode_loop == "quantkit":  # before any timing: every variant must run in the loop
        from quantkit.cpu_decoder import decoder_unavailable

        for v in built:
            if reason := decoder_unavailable(v.model):
                raise UsageError(f"--decode-loop quantkit cannot run {v.name}: {reason}; drop the option to time "
                                 f"decode in transformers")
    names = [v.name for v in built]
    if len(set(names)) != len(names):
        raise UsageError(f"variant names collide: {names}; give each variant a distinct recipe or folder name")
    if one_dtype:
        results = run_bench(built, spec, settings, device=device, model_label=label, progress=not quiet)
    else:
        prefill = run_bench(built, spec, settings, device=device, model_label=label, progress=not quiet,
                            phases=("prefill",))
        del built  # free the prefill dtype's models before building the decode dtype's
        decode = run_bench(build(phase_dtypes["decode"]), spec, settings, device=device, model_label=label,
                           progress=not quiet, phases=("decode",))
        results = merge_phases(prefill, decode)
    if features is not None:
        results["device"]["cpu_features"] = features.to_dict()
    results["dtype_reasons"] = dtype_reasons
    results["command"] = _command_line(
        model, baseline, variant_specs if not model_is_checkpoint else variant_specs[1:], device, settings,
        dtype=dtype, backend=backend, gpu=gpu, seed=seed, max_cache_gb=max_cache_gb, cuda_graphs=cuda_graphs,
        compile=compile, compile_backend=compile_backend, threads=threads, json_out=json_out,
        decode_loop=decode_loop, allow_source_mismatch=allow_source_mismatch, allow_other_baseline=allow_other_baseline)
    shown = sys.stderr if output_stream(json_out) == 1 else sys.stdout  # the JSON alone on a standard output
    print("\n".join(summary_lines(results)), file=shown)
    if json_out is not None:
        write_output_file(json_out, json.dumps(results, indent=1) + "\n")
        if output_stream(json_out) is None:
            print(f"wrote {json_out}")
    return results


def _check_baseline(checkpoint, base, which: str, allow_other_baseline: bool) -> None:
    """UsageError unless `base` is the model the checkpoint `which` was quantized from, or (with
    allow_other_baseline) a model of its shapes: every variant is timed on the baseline's shapes."""
    from quantkit.errors import UsageError
    from quantkit.harness.baseline import check_same_source, shape_mismatches

    if not allow_other_baseline:
        check_same_source(checkpoint, base, which)
    elif problems := shape_mismatches(checkpoint, base):
        raise UsageError(f"the baseline {getattr(base, 'name_or_path', '')} does not have the shapes of {which} "
                         f"({'; '.join(problems[:4])}): bench times every variant on the baseline's shapes, so "
                         f"--allow-other-baseline takes another model of the same shapes only; give such a baseline")
