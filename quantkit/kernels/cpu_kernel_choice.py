"""Which CPU kernel runs a weight-only linear call: one class per path, one ``choose``.

Each path is a ``kernel_path.KernelPath``: it names itself, says why it cannot run a call
(``can_run(m, k, n, dtype, layout)``: a reason, or None), runs it (``apply(x, *operands)``, the operands
of its layout as the calling op receives them) and gives the float reference its result is tested
against (``reference``). ``choose`` takes the first path of ``PATHS`` that can run the call
(``backend_choice.choose_kernel`` asks it for the CPU layouts). Layouts (``wna16_layout``) and their
operands:

- "cpu_q8" (quantkit's C++ kernel): weight, scale, zero, bias;
- "cpu_int4" (``aten._weight_int4pack_mm_for_cpu``): weight, scales_zeros, weight_lo, scales_zeros_lo, bias;
- "cpu_int8" (``aten._weight_int8pack_mm``): weight, scale, zero_scale, bias.

The rules, and the measurements behind them:

- cpu_q8, any number of rows: ``quantkit::wna16_cpu_q8dot``, int8-rounded activations (blocks of 32,
  as llama.cpp's Q8_0) times the exact weight. From 4 (int4) / 8 (int8) rows it runs as an int8 GEMM
  (rows of x in the vector lanes: ``csrc/wna16_q8dot.cpp``). On a 2-core Xeon without native bf16
  (AVX-512 VNNI) it runs prompts at 1.2-1.6x the fp32 dense linear and 4-7x the (emulated) bf16 one
  (``evals/kernels/cpu_q8dot_batch``); on a 2-core AMD EPYC with native AVX512-BF16 and no AMX, at
  1.4-1.5x the bf16 dense linear at 64 rows and 1.1-1.4x at 512 (``evals/kernels/cpu_q8dot_epyc``):
  VNNI's int8 dot products do twice AVX512-BF16's multiply-adds per instruction. Prompts take the
  same activation rounding as decode.
- cpu_q8, bf16 activations, >= ``DEQUANT_MIN_ROWS["cpu_q8"]`` rows, on a CPU with AMX bf16 tiles: the
  weight dequantized once into bf16 and the dense bf16 GEMM (unrounded activations), which oneDNN runs
  on the tiles at several times the vector rate. Not measured against the int8 GEMM on such a CPU
  (none was at hand since the int8 GEMM landed).
- cpu_int4 / cpu_int8 (where the C++ kernel does not build): PyTorch's fused kernels below
  ``DEQUANT_MIN_ROWS`` rows, the weight dequantized once and the dense GEMM from it on
  (``wna16_cpu_dequant``, where the thresholds are reasoned).
"""

from __future__ import annotations

import torch

from . import cpu_flags
from .kernel_path import KernelPath
from .wna16_cpu_dequant import int4_block_n, int4_linear_dequantized, int8_linear_dequantized
from .wna16_cpu_q8 import unpack_cpu_q8_weight, wna16_cpu_q8dot_reference
from .wna16_layout import to_cpu_int4_layout, to_cpu_int8_layout, to_cpu_q8_layout

# Rows of x from which the dequantize-once paths run (reasoning: wna16_cpu_dequant, and above).
DEQUANT_MIN_ROWS = {"cpu_int8": 32, "cpu_int4": 128, "cpu_q8": 32}
ATEN_DTYPE = torch.bfloat16  # PyTorch's fused CPU weight-only kernels are fast for bf16 activations only


class Q8Dot(KernelPath):
    name = "quantkit::wna16_cpu_q8dot"
    layout = "cpu_q8"
    keys = ("cpu_q8_weight", "cpu_q8_scale", "cpu_q8_zero")
    prepare = staticmethod(to_cpu_q8_layout)

    def apply(self, x, weight, scale, zero, bias):
        return torch.ops.quantkit.wna16_cpu_q8dot(x, weight, scale, zero, bias)

    def reference(self, x, weight, scale, zero, bias):
        return wna16_cpu_q8dot_reference(x, weight, scale, zero, bias)


class Q8Dequantized(KernelPath):
    name = "quantkit::wna16_cpu_q8dot_unpack + bf16 at::linear"
    layout = "cpu_q8"
    keys = Q8Dot.keys
    prepare = Q8Dot.prepare

    def can_run(self, m, k, n, dtype, layout):
        if (reason := super().can_run(m, k, n, dtype, layout)) is not None:
            return reason
        if dtype != torch.bfloat16:
            return f"x is {dtype}, not bf16"
        if not cpu_flags.amx_bf16():
            return "this CPU has no AMX bf16 tiles: the int8 GEMM outruns its bf16 GEMM"
        if m < DEQUANT_MIN_ROWS["cpu_q8"]:
            return f"{m} rows < {DEQUANT_MIN_ROWS['cpu_q8']}"
        return None

    def apply(self, x, weight, scale, zero, bias):
        w = torch.ops.quantkit.wna16_cpu_q8dot_unpack(weight, scale, zero, x.shape[1], True)
        return torch.nn.functional.linear(x, w, None if bias is None else bias.to(torch.bfloat16))

    def reference(self, x, weight, scale, zero, bias):
        w = unpack_cpu_q8_weight(weight, scale, zero, x.shape[1]).to(torch.float64)
        y = x.to(torch.float64) @ w.t()
        return (y if bias is None else y + bias.to(torch.float64)).to(x.dtype)


def _as_aten(x: torch.Tensor) -> torch.Tensor:
    """x in bf16, contiguous (no op when it already is)."""
    if x.dtype != ATEN_DTYPE:
        x = x.to(ATEN_DTYPE)
    return x if x.is_contiguous() else x.contiguous()


class AtenInt4Fused(KernelPath):
    name = "aten._weight_int4pack_mm_for_cpu"
    layout = "cpu_int4"
    keys = ("cpu_int4_weight", "cpu_int4_scales_zeros", "cpu_int4_weight_lo", "cpu_int4_scales_zeros_lo")
    prepare = staticmethod(to_cpu_int4_layout)

    def apply(self, x, weight, scales_zeros, weight_lo, scales_zeros_lo, bias):
        group = x.shape[1] // scales_zeros.shape[0]
        xb = _as_aten(x)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        y = mm(xb, weight, group, scales_zeros)
        if weight_lo is None and bias is None:
            return y if x.dtype == ATEN_DTYPE else y.to(x.dtype)
        y = y.to(torch.float32)
        if weight_lo is not None:
            y = y + mm(xb, weight_lo, group, scales_zeros_lo).to(torch.float32)
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(x.dtype)

    def reference(self, x, weight, scales_zeros, weight_lo, scales_zeros_lo, bias):
        return int4_linear_dequantized(x.float(), weight, scales_zeros, weight_lo, scales_zeros_lo, bias).to(x.dtype)


class AtenInt4Dequantized(AtenInt4Fused):
    name = "int4 dequantized once + at::linear"

    def can_run(self, m, k, n, dtype, layout):
        if (reason := super().can_run(m, k, n, dtype, layout)) is not None:
            return reason
        if m < DEQUANT_MIN_ROWS["cpu_int4"]:
            return f"{m} rows < {DEQUANT_MIN_ROWS['cpu_int4']}"
        if int4_block_n() is None:
            return "the CPU int4 layout of this PyTorch build is not one quantkit can read"
        return None

    def apply(self, x, weight, scales_zeros, weight_lo, scales_zeros_lo, bias):
        return int4_linear_dequantized(x, weight, scales_zeros, weight_lo, scales_zeros_lo, bias)


class AtenInt8Fused(KernelPath):
    name = "aten._weight_int8pack_mm"
    layout = "cpu_int8"
    keys = ("cpu_int8_weight", "cpu_int8_scale", "cpu_int8_zero_scale")
    prepare = staticmethod(to_cpu_int8_layout)

    def apply(self, x, weight, scale, zero_scale, bias):
        xb = _as_aten(x)
        y = torch.ops.aten._weight_int8pack_mm(xb, weight, scale)
        if zero_scale is None and bias is None:
            return y if x.dtype == ATEN_DTYPE else y.to(x.dtype)
        y = y.to(torch.float32)
        if zero_scale is not None:
            y = y - xb.to(torch.float32).sum(dim=1, keepdim=True) * zero_scale  # [M, 1] * [N]
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(x.dtype)

    def reference(self, x, weight, scale, zero_scale, bias):
        return int8_linear_dequantized(x.float(), weight, scale, zero_scale, bias).to(x.dtype)


class AtenInt8Dequantized(AtenInt8Fused):
    name = "int8 dequantized once + at::linear"

    def can_run(self, m, k, n, dtype, layout):
        if (reason := super().can_run(m, k, n, dtype, layout)) is not None:
            return reason
        return f"{m} rows < {DEQUANT_MIN_ROWS['cpu_int8']}" if m < DEQUANT_MIN_ROWS["cpu_int8"] else None

    def apply(self, x, weight, scale, zero_scale, bias):
        return int8_linear_dequantized(x, weight, scale, zero_scale, bias)


# In order of preference: the first that can run a call runs it.
PATHS = (Q8Dequantized(), Q8Dot(), AtenInt4Dequantized(), AtenInt4Fused(), AtenInt8Dequantized(), AtenInt8Fused())


def choose(m: int, k: int, n: int, dtype: torch.dtype, layout: str) -> KernelPath:
    """The path that runs x [m, k] (``dtype``) by a weight [n, k] in ``layout`` ("cpu_q8", "cpu_int4", "cpu_int8")."""
    for path in PATHS:
        if path.can_run(m, k, n, dtype, layout) is None:
            return path
    raise ValueError(f"no CPU kernel path reads the {layout!r} layout")
