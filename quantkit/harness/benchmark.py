"""`benchmark`: time prefill (TTFT) and decode (TPOT) of a model and its quantized variants, as `quantkit
bench` does (commands/bench.py parses its options into these keywords; the demo calls it directly).

Imports torch and the rest of the harness inside ``benchmark``: the CLI reads the defaults below while
it builds its parser, which must stay fast.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from ..core.errors import UsageError
from .machine_load import cpu_snapshot, machine_load

GPU_DEFAULTS = {"prompt_lens": (128, 512, 1024, 2048, 4096), "context_lens": (128, 512, 1024, 2048, 4096),
                "batch_sizes": (1, 4, 16, 64)}
CPU_DEFAULTS = {"prompt_lens": (32, 128, 512), "context_lens": (128, 512, 2048), "batch_sizes": (1, 4, 16)}
# Environment variables that change timings; recorded with the command line.
TIMING_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")


def command_line(model: str, baseline: str | None, variants: list[str], device, settings, *, dtype: str,
                 backend: str, gpu: str, seed: int, max_cache_gb: float | None, cuda_graphs: bool,
                 compile: str | None, compile_backend: str, threads: int | None, json_out: str | None,
                 decode_loop: str = "transformers", allow_source_mismatch: bool = False, allow_other_baseline: bool = False) -> str:
    """The command that repeats this measurement (every setting spelled out)."""
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


def say(quiet: bool, message: str) -> None:
    """A progress line on stderr (stdout keeps the results), unless quiet."""
    if not quiet:
        print(f"bench: {message}", file=sys.stderr, flush=True)


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
    model of the same shapes. `decode_loop` "auto" (the demo's): quantkit's C++ loop where it runs every
    variant on this device (as CpuDecoder says, ``decoder_unavailable``), else transformers; the results then
    say why not under "decode_loop_reason" (None where the loop runs).
    """
    # import time: the CLI imports this module for its defaults while it builds its parser
    import torch

    from ..core.device import check_backend, check_cpu_threads, resolve_device
    from ..core.dtypes import parse_dtype
    from ..files.inputs import input_paths
    from ..formats.loading import is_quantized_checkpoint, resolve_model_source
    from ..files.outputs import check_output_file, output_stream, write_output_file
    from ..kernels.backend_choice import benchmark_backend
    from .hardware import device_memory_bytes, resolve_device_spec
    from .report import summary_lines
    from .timing import BenchSettings, merge_phases, run_bench
    from .variants import build_variant, float_variant, load_source_model, refuse_gguf_sources

    asked_loop = decode_loop
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
        prompt_lens=list(prompt_lens or defaults["prompt_lens"]),
        context_lens=list(context_lens or defaults["context_lens"]),
        batch_sizes=list(batch_sizes or defaults["batch_sizes"]),
        prefill_batch_sizes=list(prefill_batch_sizes), warmup=warmup, repeats=repeats,
        cuda_graphs=cuda_graphs, seed=seed,
        compile_backend=compile_backend if compile else None,
        compile_prefill=compile == "all", decode_loop="transformers" if decode_loop == "auto" else decode_loop,
    )
    features = None
    if device.type == "cpu":
        from .cpu_features import detect_cpu_features  # import time: torch and the kernels, as above

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
        say(quiet, f"{phase} runs in {str(phase_dtypes[phase]).removeprefix('torch.')} ({reason})")
    if gpu.strip().lower() == "probe":
        say(quiet, f"measuring the memory bandwidth and matmul peak of {device} (the roofline's device)")
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
    kernel_backend = benchmark_backend(backend, device)

    def build(model_dtype):
        base = None
        if base_source is not None:
            say(quiet, f"loading {base_source} ({str(model_dtype).removeprefix('torch.')}, {device})")
            base = load_source_model(base_source, dtype=model_dtype, device=device, seed=seed,
                                     strict=not allow_source_mismatch)
        # one float baseline for both phases, whatever dtype each phase runs in
        built = [float_variant(base, name=None if one_dtype else "float")] if base is not None else []
        for i, s in enumerate(variant_specs):
            say(quiet, f"preparing variant {i + 1}/{len(variant_specs)}: {s} "
                        f"({'loading the checkpoint' if Path(s).is_dir() else 'quantizing a copy of the float model'})")
            built.append(build_variant(s, base, dtype=model_dtype, device=device, backend=kernel_backend))
            if base is not None and Path(s).is_dir():
                check_baseline(built[-1].model, base, s, allow_other_baseline)
        return built

    if decode_loop == "quantkit" and device.type != "cpu":
        raise UsageError(f"--decode-loop quantkit runs on the CPU, not {device}: drop it on a GPU")
    label = model_label or str(base_source or model)
    built = build(phase_dtypes["prefill"])
    loop_reason = None
    if decode_loop == "auto" and (device.type != "cpu" or compile):
        decode_loop, loop_reason = "transformers", (f"it runs on the CPU, not {device}" if device.type != "cpu"
                                                     else "--compile times transformers' forward")
    if decode_loop in ("auto", "quantkit"):  # before any timing: every variant must run in the loop
        # import time: as above
        from ..runtime.cpu_decoder import decoder_unavailable

        loop_reason = next((f"{v.name}: {reason}" for v in built if (reason := decoder_unavailable(v.model))), None)
        if decode_loop == "quantkit" and loop_reason:
            raise UsageError(f"--decode-loop quantkit cannot run {loop_reason}; drop the option to time "
                             f"decode in transformers")
        decode_loop = settings.decode_loop = "transformers" if loop_reason else "quantkit"
    names = [v.name for v in built]
    if len(set(names)) != len(names):
        raise UsageError(f"variant names collide: {names}; give each variant a distinct recipe or folder name")
    load_start = cpu_snapshot()
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
    if device.type == "cpu":
        results["device"]["load"] = machine_load(load_start, cpu_snapshot(), torch.get_num_threads(), os.cpu_count())
    results["dtype_reasons"] = dtype_reasons
    if asked_loop == "auto":
        results["decode_loop_reason"] = loop_reason
    results["command"] = command_line(
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


def check_baseline(checkpoint, base, which: str, allow_other_baseline: bool) -> None:
    """UsageError unless `base` is the model the checkpoint `which` was quantized from, or (with
    allow_other_baseline) a model of its shapes: every variant is timed on the baseline's shapes."""
    from .baseline import check_same_source, shape_mismatches  # import time: torch, as benchmark's

    if not allow_other_baseline:
        check_same_source(checkpoint, base, which)
    elif problems := shape_mismatches(checkpoint, base):
        raise UsageError(f"the baseline {getattr(base, 'name_or_path', '')} does not have the shapes of {which} "
                         f"({'; '.join(problems[:4])}): bench times every variant on the baseline's shapes, so "
                         f"--allow-other-baseline takes another model of the same shapes only; give such a baseline")
