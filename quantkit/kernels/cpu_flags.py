"""What this CPU offers the CPU kernels: its feature flags (/proc/cpuinfo) and native bf16 arithmetic.

The one place quantkit reads the CPU's features (and the one reader of /proc/cpuinfo); the kernel chooser
(``cpu_kernel_choice``) and the harness's report (``quantkit.harness.cpu_features``, ``hardware.cpu_name``)
ask here. The C++ kernels pick their code path
from ``cpuid`` themselves (``csrc/wna16_q8dot.cpp``).
"""

from __future__ import annotations

import functools

import torch

# Flags of native bf16 arithmetic, as /proc/cpuinfo spells them (x86: AVX512-BF16, AMX-BF16; ARM: BF16).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16", "asimdbf16")
# Flags of AMX's bf16 matrix tiles (x86), whose GEMM runs several times AVX512-BF16's vector rate.
AMX_BF16_FLAGS = ("amx_bf16",)


def cpuinfo_value(keys: tuple[str, ...], cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The value of the first line of ``cpuinfo`` whose key is one of ``keys`` (the first CPU's), stripped;
    None when no line has one, or the file is unreadable."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in keys:
                    return value.strip()
    except OSError:
        return None
    return None


def read_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The feature flags of the first CPU in ``cpuinfo`` (x86 "flags", ARM "Features"); None when unreadable."""
    value = cpuinfo_value(("flags", "Features"), cpuinfo)
    return None if value is None else set(value.split())


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """This machine's flags (read once per process), or None."""
    flags = read_cpu_flags()
    return None if flags is None else frozenset(flags)


def _probe_native_bf16() -> bool:
    cpu = getattr(torch, "cpu", None)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    if any(bool(getattr(cpu, name, lambda: False)()) for name in probes):
        return True
    return any(f in NATIVE_BF16_FLAGS for f in cpu_flags() or ())


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles, by PyTorch's probe (the one vLLM picks its AMX kernels by), asked
    each call (not traceable by torch.compile: ``amx_bf16`` holds the answer for compiled code)."""
    cpu = getattr(torch, "cpu", None)
    return bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def _probe_amx_bf16() -> bool:
    return amx_tiles() or any(f in AMX_BF16_FLAGS for f in cpu_flags() or ())


# Probed once at import: torch.compile cannot trace torch.cpu's probes (dynamo skips them), and a
# compiled forward (vLLM's, fullgraph) reaches compute_dtype.
_NATIVE_BF16 = _probe_native_bf16()
_AMX_BF16 = _probe_amx_bf16()


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (torch's probe of AVX512-BF16 / AMX, or the flags)."""
    return _NATIVE_BF16


def amx_bf16() -> bool:
    """Whether this CPU has AMX bf16 tiles (torch's probe of AMX, or the flags)."""
    return _AMX_BF16


def compute_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The dtype a dense GEMM on a dequantized weight runs in for activations of ``x_dtype``: bf16 for
    bf16 where the CPU computes bf16 natively, else fp32 (bf16 GEMM is emulated there, far slower)."""
    if x_dtype == torch.bfloat16 and native_bf16():
        return torch.bfloat16
    return torch.float32
