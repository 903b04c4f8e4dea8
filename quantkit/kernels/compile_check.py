"""Compile every WNA16 kernel configuration the heuristics can pick, for a GPU target, without a GPU.

    python -m quantkit.kernels.compile_check [--arch 90] [--workers 2]

Runs the real Triton compiler (``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``)
down to a cubin with Triton's bundled ptxas, so a kernel the Hopper compiler rejects, or one that
needs more shared memory than the SM has, fails here rather than on the first GPU run. Each
configuration of ``wna16_heuristics.all_configs`` is compiled once for int4 and int8 (and one per
algorithm for int2, whose launch configurations are the same), with the
kernel's other compile-time flags (activation dtype, zeros, bias, scale mode) rotated across the
configurations so that every value of every flag is compiled with every algorithm. Prints one JSON
object per line and exits non-zero on any failure.

Integer arguments that real launches see divisible by 16 (N, K, strides, group size, split lengths:
Triton specializes on that) and the pointers (16-byte aligned) are compiled with that divisibility,
as a launch on the decode shapes would be: that is what lets the weight loads become 16-byte
vector loads. ``ptx_loop_facts`` reads the generated PTX of the main loop (vector loads, instructions
per weight); the tests use it to pin the GEMV's 128-bit weight loads.

Needs triton imported *without* TRITON_INTERPRET=1 (run it in its own process).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget

from .packing import SUPPORTED_BITS
from .wna16_heuristics import DEFAULT_NUM_SMS, WNA16Config, all_configs, choose_config
from .wna16_layout import TRITON_WORD_BLOCK

HOPPER_MAX_SHARED_BYTES = 232448  # 227 KiB per block on sm_90
_TRITON_DTYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
# (dtype, has_zeros, scale_single, has_bias) rotated over the configurations of each algorithm
_FLAG_CYCLE = list(itertools.product(("bf16", "fp16", "fp32"), (True, False), (False, True), (True, False)))


def _jobs(arch: int) -> list[dict]:
    jobs = []
    for bits in SUPPORTED_BITS:
        counters: dict[str, int] = {}
        configs = all_configs(bits, DEFAULT_NUM_SMS)
        if bits == 2:  # same launch configurations as int4/int8; one per algorithm shows the int2 unpacking compiles
            configs = [next(c for c in configs if c.algo == algo) for algo in ("gemv", "dot", "dequant")]
        for cfg in configs:
            i = counters.get(cfg.algo, 0)
            counters[cfg.algo] = i + 1
            # each algorithm's first configurations cover the flag combinations in turn (offset by bits)
            dtype, zeros, single, bias = _FLAG_CYCLE[(i + bits) % len(_FLAG_CYCLE)]
            jobs.append(dict(kind=cfg.algo, bits=bits, config=cfg.as_dict(), dtype=dtype, has_zeros=zeros,
                             scale_single=single, has_bias=bias, arch=arch))
        if bits == 4:  # every activation dtype with both product forms, zeros and scale modes alternating
            first_gemv = next(c for c in all_configs(4) if c.algo == "gemv")
            first_dot = next(c for c in all_configs(4) if c.algo == "dot")
            for j, (dtype, cfg) in enumerate(itertools.product(_TRITON_DTYPES, (first_gemv, first_dot))):
                jobs.append(dict(kind=cfg.algo, bits=bits, config=cfg.as_dict(), dtype=dtype, has_zeros=j % 2 == 0,
                                 scale_single=j % 3 == 0, has_bias=j % 2 == 1, arch=arch))
    for j, dtype in enumerate(_TRITON_DTYPES):
        jobs.append(dict(kind="reduce", dtype=dtype, has_bias=j % 2 == 0, arch=arch))
    for bits in (4, 8):  # the single-launch split-K reduction the sweep times (not picked by the rules yet)
        cfg = WNA16Config("gemv", 1, 512, 2, num_warps=2, num_stages=1, reduce="last")
        jobs.append(dict(kind="gemv", bits=bits, config=cfg.as_dict(), dtype="bf16", has_zeros=bits == 8,
                         scale_single=True, has_bias=True, arch=arch))
    return jobs


_MATMUL_ARGS = ("M", "N", "K", "group_size", "words_per_split", "iters", "stride_xm", "stride_om")
_DIVISIBLE = ("x_ptr", "qweight_ptr", "scales_ptr", "zeros_ptr", "bias_ptr", "out_ptr", "partial_ptr", "N", "K",
              "group_size", "words_per_split", "stride_xm", "stride_om")


def build_kernel(job: dict):
    """Compile one job for GPUTarget("cuda", arch, 32); returns the CompiledKernel (asm: ttgir, ptx, cubin)."""
    # the kernels' module registers their Triton op when imported: only where a job compiles them
    from . import wna16_triton as wt

    if wt.KERNELS_INTERPRETED:
        raise RuntimeError("compile_check needs triton imported without TRITON_INTERPRET=1 (run it in its own process)")
    target = GPUTarget("cuda", job["arch"], 32)
    xt = _TRITON_DTYPES[job["dtype"]]
    kind = job["kind"]
    if kind == "reduce":
        fn = wt._splitk_reduce_kernel
        sig = {"partial_ptr": "*fp32", "bias_ptr": xt, "out_ptr": xt, "M": "i32", "N": "i32", "stride_om": "i32",
               "split_k": "i32"}
        const = dict(HAS_BIAS=job["has_bias"], BLOCK_N=wt.REDUCE_BLOCK_N)
        options = {"num_warps": 4}
    elif kind == "dequant":
        fn = wt._wna16_dequant_kernel
        sig = {"qweight_ptr": "*i32", "scales_ptr": xt, "zeros_ptr": "*u8", "out_ptr": xt, "N": "i32", "K": "i32",
               "group_size": "i32"}
        const = dict(BITS=job["bits"], HAS_ZEROS=job["has_zeros"], BLOCK_KW=TRITON_WORD_BLOCK,
                     BLOCK_N=wt.DEQUANT_BLOCK_N)
        options = {"num_warps": 4}
    else:
        cfg = WNA16Config(**job["config"])
        fn = wt._wna16_gemv_kernel if cfg.algo == "gemv" else wt._wna16_matmul_kernel
        sig = {"x_ptr": xt, "qweight_ptr": "*i32", "scales_ptr": xt, "zeros_ptr": "*u8", "bias_ptr": xt,
               "out_ptr": xt, "partial_ptr": "*fp32"}
        if cfg.algo == "gemv":
            sig["counters_ptr"] = "*i32"
        sig.update({name: "i32" for name in _MATMUL_ARGS})
        const = dict(BITS=job["bits"], HAS_ZEROS=job["has_zeros"], HAS_BIAS=job["has_bias"],
                     SCALE_SINGLE=job["scale_single"], WRITE_PARTIAL=cfg.split_k > 1, BLOCK_M=cfg.block_m,
                     BLOCK_N=cfg.block_n, BLOCK_KW=TRITON_WORD_BLOCK)
        if cfg.algo == "dot":
            const["DOT_FP32"] = job["dtype"] == "fp32"
        else:
            const["REDUCE_LAST"] = cfg.split_k > 1 and cfg.reduce == "last"
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    options["enable_fp_fusion"] = True  # the launch default: the dequant multiply-add fuses
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in _DIVISIBLE if name in sig}
    sig.update({name: "constexpr" for name in const})
    return triton.compile(triton.compiler.ASTSource(fn, signature=sig, constexprs=const, attrs=attrs),
                          target=target, options=options)


def ptx_loop_facts(ptx: str) -> dict:
    """Facts of the innermost loop of a kernel's PTX (the K loop of the WNA16 kernels).

    Returns ``instructions`` (PTX instructions in the loop body), ``ld_global_v4_b32`` (128-bit
    global loads), ``ld_global`` (all global loads) and ``ld_global_narrow`` (global loads of 16
    bits or less: scalar activation or scale loads).
    """
    lines = ptx.splitlines()
    heads = [i for i, line in enumerate(lines) if "Loop Header" in line]
    if not heads:
        raise ValueError("no loop in this PTX")
    start = heads[-1]
    label = lines[start].split(":")[0].strip()
    back = [i for i, line in enumerate(lines) if re.search(r"\bbra(\.uni)?\s+" + re.escape(label) + ";", line)]
    body = [line.strip() for line in lines[start + 1: max(back) + 1]]
    ins = [line for line in body if line and not line.startswith(("//", ".", "$", "{", "}")) and not line.endswith(":")]
    opcodes = [(line.split()[1] if line.startswith("@") else line.split()[0]) for line in ins]
    loads = [op for op in opcodes if op.startswith("ld.global")]
    return {
        "instructions": len(ins),
        "ld_global": len(loads),
        "ld_global_v4_b32": sum(op.endswith(".v4.b32") for op in loads),
        "ld_global_narrow": sum(op.endswith((".b16", ".b8", ".u8", ".u16")) for op in loads),
    }


def _compile(job: dict) -> dict:
    t0 = time.perf_counter()
    result = dict(job)
    try:
        kernel = build_kernel(job)
        shared = int(kernel.metadata.shared)
        result.update(ok=shared <= HOPPER_MAX_SHARED_BYTES, shared_bytes=shared, stages=sorted(kernel.asm.keys()),
                      cubin_bytes=len(kernel.asm.get("cubin", b"")))
        if not result["ok"]:
            result["error"] = f"needs {shared} bytes of shared memory, sm_{job['arch']} has {HOPPER_MAX_SHARED_BYTES}"
    except Exception as exc:  # noqa: BLE001  (reported, and the run fails)
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def gemv_ptx_facts(arch: int = 90) -> list[dict]:
    """PTX loop facts of the GEMV configurations the rules pick at M = 1 and 2 (bf16, symmetric; int4
    g128 and int8 per channel), with the weights one thread handles per loop iteration."""
    out = []
    for bits, scale_single in ((4, True), (8, True), (4, False)):
        for m in (1, 2):
            cfg = choose_config(m, 4096, 4096, bits)
            job = dict(kind=cfg.algo, bits=bits, config=cfg.as_dict(), dtype="bf16", has_zeros=False,
                       scale_single=scale_single, has_bias=False, arch=arch)
            facts = ptx_loop_facts(build_kernel(job).asm["ptx"])
            columns = cfg.block_n // (32 * cfg.num_warps)  # per thread
            facts.update(job, weight_words_per_thread=TRITON_WORD_BLOCK * columns,
                         weights_per_thread=TRITON_WORD_BLOCK * columns * (32 // bits))
            facts["instructions_per_weight"] = round(facts["instructions"] / facts["weights_per_thread"], 3)
            out.append(facts)
    return out


def compile_all(arch: int = 90, workers: int = 1) -> list[dict]:
    """Compile every job; returns one result dict per job (``ok``, ``shared_bytes``, ``error``)."""
    jobs = _jobs(arch)
    if workers <= 1:
        return [_compile(job) for job in jobs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_compile, jobs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for Hopper")
    parser.add_argument("--workers", type=int, default=1, help="compiler processes")
    parser.add_argument("--ptx-facts", action="store_true",
                        help="instead: print the PTX loop facts of the decode GEMV (loads, instructions per weight)")
    args = parser.parse_args(argv)
    if args.ptx_facts:
        for facts in gemv_ptx_facts(args.arch):
            print(json.dumps(facts, sort_keys=True))
        return 0
    results = compile_all(args.arch, args.workers)
    for r in results:
        print(json.dumps(r, sort_keys=True))
    failed = [r for r in results if not r["ok"]]
    print(json.dumps({"summary": True, "compiled": len(results), "failed": len(failed)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
