"""Which float dtype a CPU computes fastest: its feature flags, and a short probe of both dtypes.

PyTorch's bf16 matrix products are fast only on CPUs with native bf16 instructions (x86:
AVX512-BF16 or AMX-BF16; ARM: the BF16 extension, ``bf16``/``asimdbf16`` in /proc/cpuinfo).
Elsewhere (e.g. an AVX2-only x86) the bf16 GEMM is emulated: measured 0.3 GFLOP/s against 147 for
fp32 at 512x2048x2048, while a bf16 matrix-vector product stays fast, since it is bound by the bytes
it reads and bf16 reads half of fp32's. So prefill (matrix products) and decode (matrix-vector
products) may be fastest in different dtypes: both dtypes are timed here for each kind of product,
and the flags explain what the timings show.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from quantkit.kernels.cpu_flags import NATIVE_BF16_FLAGS, read_cpu_flags

# Flags worth naming in a report, by architecture (as /proc/cpuinfo spells them).
X86_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
ARM_FLAGS = ("asimd", "sve", "sve2", "bf16", "asimdbf16", "i8mm")

PROBE_DTYPES = ("float32", "bfloat16")
MATMUL_N = 512  # the probe's matmul: [n, n] @ [n, n]
GEMV_SHAPE = (4096, 2048)  # the probe's matrix-vector product: [1, K] x [K, N]^T for (N, K)
# bf16 is chosen unless float32 measures more than this much faster: a shared machine's timings
# wobble by tens of percent, bf16 moves half the bytes, and emulated bf16 is ~100x slower, not 2x.
FLOAT32_MARGIN = 2.0


def _interleaved_seconds(fns: dict[str, object], budget_s: float, min_rounds: int = 3,
                         max_rounds: int = 7) -> dict[str, float]:
    """Median seconds of each of ``fns`` (name -> callable), after one warm-up call each, timed in
    rounds (A B A B ...) so that a shared machine's load drifts over all of them alike; at least
    ``min_rounds`` rounds, more while ``budget_s`` lasts (an emulated bf16 GEMM can take a second)."""
    spent = 0.0
    for fn in fns.values():
        t0 = time.perf_counter()
        fn()
        spent += time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(max_rounds):
        if round_ >= min_rounds and spent >= budget_s:
            break
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            spent += times[name][-1]
    return {name: statistics.median(t) for name, t in times.items()}


def probe_dtype_rates(matmul_n: int = MATMUL_N, gemv_shape: tuple[int, int] = GEMV_SHAPE,
                      budget_s: float = 2.0) -> tuple[dict[str, float], dict[str, float]]:
    """Flop/s of a [n, n] @ [n, n] matmul and of a [1, K] x [K, N]^T matrix-vector product in each
    of float32 and bfloat16 (random inputs, the current torch thread count), the two dtypes timed
    in alternation (see _interleaved_seconds). These compare the dtypes; the roofline's matmul peak
    is measured separately, on a larger matrix (hardware.probe_device)."""
    g = torch.Generator().manual_seed(0)
    n_out, k = gemv_shape
    mm_fns, mv_fns = {}, {}
    for name in PROBE_DTYPES:
        dtype = getattr(torch, name)
        a = torch.randn(matmul_n, matmul_n, generator=g).to(dtype)  # [n, n]
        b = torch.randn(matmul_n, matmul_n, generator=g).to(dtype)  # [n, n]
        w = torch.randn(n_out, k, generator=g).to(dtype)  # [N, K]
        x = torch.randn(1, k, generator=g).to(dtype)  # [1, K]
        mm_fns[name] = lambda a=a, b=b: torch.mm(a, b)
        mv_fns[name] = lambda x=x, w=w: torch.nn.functional.linear(x, w)
    mm = _interleaved_seconds(mm_fns, budget_s)
    mv = _interleaved_seconds(mv_fns, budget_s)
    return ({name: 2.0 * matmul_n**3 / t for name, t in mm.items()},
            {name: 2.0 * n_out * k / t for name, t in mv.items()})


@dataclass(frozen=True)
class CpuFeatures:
    """What this CPU offers for float compute, and the dtype each phase should be timed in.

    flags: the flags of X86_FLAGS / ARM_FLAGS found (None: /proc/cpuinfo unreadable).
    matmul_flops, gemv_flops: flop/s by dtype name ("float32", "bfloat16"), from probe_dtype_rates.
    """

    arch: str
    flags: tuple[str, ...] | None
    capability: str
    matmul_flops: dict[str, float] = field(default_factory=dict)
    gemv_flops: dict[str, float] = field(default_factory=dict)

    @property
    def native_bf16(self) -> bool | None:
        """Whether the flags name native bf16 instructions (None: flags unknown)."""
        if self.flags is None:
            return None
        return any(f in NATIVE_BF16_FLAGS for f in self.flags)

    @property
    def prefill_dtype(self) -> str:
        """The dtype for matrix products (prefill): bf16 unless float32's matmul measured FLOAT32_MARGIN x faster."""
        return _choose(self.matmul_flops)

    @property
    def decode_dtype(self) -> str:
        """The dtype for matrix-vector products (decode): bf16 unless float32's measured FLOAT32_MARGIN x faster."""
        return _choose(self.gemv_flops)

    def choice_reason(self, phase: str) -> str:
        """Why ``phase`` ("prefill": matrix products, "decode": matrix-vector products) runs in its
        dtype, from the probe's rates: e.g. "matmul probe: float32 measured 12x bfloat16's rate (the margin is 2x)"."""
        rates = self.matmul_flops if phase == "prefill" else self.gemv_flops
        kind = "matmul" if phase == "prefill" else "matrix-vector product"
        if not rates:
            return "not probed: bfloat16 by default"
        ratio = rates["float32"] / max(rates["bfloat16"], 1e-30)
        rule = f"the margin is {FLOAT32_MARGIN:g}x"
        if _choose(rates) == "float32":
            return f"{kind} probe: float32 measured {_x(ratio)} bfloat16's rate ({rule})"
        if ratio >= 1.0:
            return f"{kind} probe: float32 measured only {_x(ratio)} bfloat16's rate ({rule}; bf16 moves half the bytes)"
        return f"{kind} probe: bfloat16 measured {_x(1 / ratio)} float32's rate"

    def sentences(self, timed: dict[str, str] | None = None) -> list[str]:
        """What was found and what follows from it, for a report. ``timed``: the dtype each phase
        ("prefill", "decode") was actually timed in, when known."""
        mm, mv = self.matmul_flops, self.gemv_flops
        found = ", ".join(self.flags) if self.flags else ("none of interest" if self.flags is not None else "unknown")
        if self.native_bf16 is None:
            bf16 = "/proc/cpuinfo could not be read, so whether bf16 is native is judged by the timings alone."
        elif self.native_bf16:
            bf16 = "These include native bf16 instructions."
        else:
            bf16 = ("None of these is a native bf16 instruction (x86 avx512_bf16 / amx_bf16, ARM bf16 / asimdbf16), "
                    "so PyTorch emulates bf16 matrix products.")
        out = [f"CPU features ({self.arch}, PyTorch kernels for {self.capability}): {found}. {bf16}"]
        if mm and mv:
            out.append(
                f"The dtype probe (the two dtypes timed in alternation, medians; it compares them and is not the "
                f"roofline's matmul peak, which is measured on a larger matrix) gave: matmul (n={MATMUL_N}) "
                f"{_g(mm['float32'])} GFLOP/s in float32 and {_g(mm['bfloat16'])} in bfloat16; matrix-vector product "
                f"({GEMV_SHAPE[1]} -> {GEMV_SHAPE[0]}) {_g(mv['float32'])} and {_g(mv['bfloat16'])} GFLOP/s. The dtype to use: "
                f"{self.prefill_dtype} for matrix products (prefill: {self.choice_reason('prefill')}), "
                f"{self.decode_dtype} for matrix-vector products (decode: {self.choice_reason('decode')}): bf16 unless "
                f"float32 measures over {FLOAT32_MARGIN:.0f}x faster, since bf16 moves half the bytes and timings on "
                "a shared machine wobble by tens of percent."
            )
            slow = mm["float32"] / max(mm["bfloat16"], 1e-30)
            if slow > 4:
                out.append(f"A bf16 prefill here runs {slow:.0f}x slower than float32: its timings measure the "
                           "emulation, not the model.")
        if timed:
            fastest = {"prefill": self.prefill_dtype, "decode": self.decode_dtype} if mm and mv else {}
            off = [p for p, d in timed.items() if p in fastest and d != fastest[p]]
            out.append(f"This run timed prefill in {timed.get('prefill', '?')} and decode in {timed.get('decode', '?')}"
                       + (" (quantized variants take activations in the same dtype)" if not off else
                          f"; for {' and '.join(off)} that is not the faster dtype here, so read those timings "
                          "with care") + ".")
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(native_bf16=self.native_bf16, prefill_dtype=self.prefill_dtype, decode_dtype=self.decode_dtype)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CpuFeatures":
        flags = d.get("flags")
        return cls(arch=d.get("arch", "?"), flags=None if flags is None else tuple(flags),
                   capability=d.get("capability", "?"), matmul_flops=dict(d.get("matmul_flops") or {}),
                   gemv_flops=dict(d.get("gemv_flops") or {}))


def _choose(rates: dict[str, float]) -> str:
    if rates and rates.get("float32", 0.0) > FLOAT32_MARGIN * rates.get("bfloat16", 0.0):
        return "float32"
    return "bfloat16"


def _x(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2g}x"


def _g(flops: float) -> str:
    return f"{flops / 1e9:.3g}"


def detect_cpu_features(cpuinfo: str = "/proc/cpuinfo", *, probe: bool = True) -> CpuFeatures:
    """Read the flags and (with ``probe``) time both dtypes: about a second on a CPU with native bf16,
    a few on one without."""
    flags = read_cpu_flags(cpuinfo)
    arch = platform.machine() or "?"
    wanted = ARM_FLAGS if arch.lower().startswith(("arm", "aarch")) else X86_FLAGS
    found = None if flags is None else tuple(f for f in wanted if f in flags)
    matmul, gemv = probe_dtype_rates() if probe else ({}, {})
    return CpuFeatures(arch=arch, flags=found, capability=torch.backends.cpu.get_cpu_capability(),
                       matmul_flops=matmul, gemv_flops=gemv)
