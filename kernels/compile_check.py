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

Needs triton imported *without* TRITON_INTERPRET=1 (run it in its own process).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget

from .packing import SUPPORTED_BITS
from .wna16_heuristics import DEFAULT_NUM_SMS, WNA16Config, all_configs

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
    return jobs


def _compile(job: dict) -> dict:
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
        const = dict(BITS=job["bits"], HAS_ZEROS=job["has_zeros"], BLOCK_KW=wt.DEQUANT_BLOCK[0],
                     BLOCK_N=wt.DEQUANT_BLOCK[1])
        options = {"num_warps": 4}
    else:
        cfg = WNA16Config(**job["config"])
        fn = wt._wna16_matmul_kernel
        sig = {"x_ptr": xt, "qweight_ptr": "*i32", "scales_ptr": xt, "zeros_ptr": "*u8", "bias_ptr": xt,
               "out_ptr": xt, "partial_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "group_size": "i32",
               "k_split_len": "i32", "stride_xm": "i32", "stride_om": "i32"}
        const = dict(BITS=job["bits"], HAS_ZEROS=job["has_zeros"], HAS_BIAS=job["has_bias"],
                     SCALE_SINGLE=job["scale_single"], USE_DOT=cfg.algo == "dot", DOT_FP32=job["dtype"] == "fp32",
                     WRITE_PARTIAL=cfg.split_k > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_KW=cfg.block_kw)
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    options["enable_fp_fusion"] = True  # the launch default: the dequant multiply-add fuses
    sig.update({name: "constexpr" for name in const})
    t0 = time.perf_counter()
    result = dict(job)
    try:
        kernel = triton.compile(triton.compiler.ASTSource(fn, signature=sig, constexprs=const), target=target,
                                options=options)
        shared = int(kernel.metadata.shared)
        result.update(ok=shared <= HOPPER_MAX_SHARED_BYTES, shared_bytes=shared, stages=sorted(kernel.asm.keys()),
                      cubin_bytes=len(kernel.asm.get("cubin", b"")))
        if not result["ok"]:
            result["error"] = f"needs {shared} bytes of shared memory, sm_{job['arch']} has {HOPPER_MAX_SHARED_BYTES}"
    except Exception as exc:  # noqa: BLE001  (reported, and the run fails)
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


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
    args = parser.parse_args(argv)
    results = compile_all(args.arch, args.workers)
    for r in results:
        print(json.dumps(r, sort_keys=True))
    failed = [r for r in results if not r["ok"]]
    print(json.dumps({"summary": True, "compiled": len(results), "failed": len(failed)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
