"""CPU weight-only linears on PyTorch's own kernels, as ``torch.ops.quantkit.*`` custom ops.

- ``quantkit::wna16_int4_cpu`` runs ``aten._weight_int4pack_mm_for_cpu`` (int4 in groups of
  32/64/128/256, asymmetric through a float zero);
- ``quantkit::wna16_int8_cpu`` runs ``aten._weight_int8pack_mm`` (int8 per channel; asymmetric
  through a rank-1 correction).

Numerics: both aten kernels are fast for bf16 activations only (fp16 and fp32 take a scalar path,
measured 1.3-47x slower: evals/kernels/cpu/cpu_activation_paths_*.md), so these ops always compute in
bf16: x is cast to bf16, the scales are stored in bf16, and the result is cast back to x's dtype. For
fp32 or fp16 models this trades precision (about bf16's: relative error ~2^-9) for speed; backend
"reference" keeps full precision. Layouts: quantkit.kernels.wna16_layout.

Both ops switch by the number of rows (``cpu_kernel_choice``): below ``DEQUANT_MIN_ROWS`` rows (decode)
they run the fused aten kernels above; from it on (prefill) they dequantize the weight once into a
scratch and run the dense matmul (quantkit.kernels.wna16_cpu_dequant, where the rule is reasoned).
"""

from __future__ import annotations

import torch

from .cpu_kernel_choice import ATEN_DTYPE as COMPUTE_DTYPE
from .cpu_kernel_choice import choose
from .wna16_layout import ACTIVATION_DTYPES

# Registered through the low-level torch.library.Library API rather than torch.library.custom_op:
# same schema, fake implementation and opcheck, but ~4 us of dispatch per eager call instead of ~20
# (a 1B model's decode step calls these ~150 times).
_LIB = torch.library.Library("quantkit", "FRAGMENT")
_LIB.define(
    "wna16_int4_cpu(Tensor x, Tensor weight, Tensor scales_zeros, Tensor? weight_lo=None, "
    "Tensor? scales_zeros_lo=None, Tensor? bias=None) -> Tensor"
)
_LIB.define(
    "wna16_int8_cpu(Tensor x, Tensor weight, Tensor scale, Tensor? zero_scale=None, Tensor? bias=None) -> Tensor"
)


def _check_x(x: torch.Tensor, k: int, op: str) -> None:
    torch._check(x.dim() == 2, lambda: f"{op}: x must be 2-D [M, K], got {tuple(x.shape)}")
    torch._check(
        x.dtype in ACTIVATION_DTYPES,
        lambda: f"{op}: x must be fp16, bf16 or fp32, got {x.dtype}",
    )
    torch._check(x.shape[1] == k, lambda: f"{op}: x has K={x.shape[1]}, the weight has K={k}")


def _check_int4_operands(x, weight, scales_zeros, weight_lo, scales_zeros_lo, bias) -> None:
    op = "quantkit::wna16_int4_cpu"
    torch._check(
        weight.dtype == torch.uint8 and weight.dim() == 2,
        lambda: f"{op}: weight must be uint8 [N, K/2] from aten._convert_weight_to_int4pack_for_cpu",
    )
    n, k = weight.shape[0], weight.shape[1] * 2
    _check_x(x, k, op)
    torch._check(n % 16 == 0, lambda: f"{op}: N must be a multiple of 16, got {n}")
    torch._check(
        scales_zeros.dim() == 3 and scales_zeros.shape[1] == n and scales_zeros.shape[2] == 2,
        lambda: f"{op}: scales_zeros must be [K/group, N={n}, 2], got {tuple(scales_zeros.shape)}",
    )
    torch._check(scales_zeros.dtype == COMPUTE_DTYPE, lambda: f"{op}: scales_zeros must be bf16")
    torch._check(
        k % scales_zeros.shape[0] == 0 and k // scales_zeros.shape[0] in (32, 64, 128, 256),
        lambda: f"{op}: K / scales_zeros.shape[0] must be a group size in (32, 64, 128, 256)",
    )
    torch._check(
        (weight_lo is None) == (scales_zeros_lo is None), lambda: f"{op}: give both weight_lo and scales_zeros_lo"
    )
    if weight_lo is not None:
        torch._check(
            weight_lo.dtype == weight.dtype and weight_lo.shape == weight.shape,
            lambda: f"{op}: weight_lo must match weight (uint8 [N, K/2])",
        )
        torch._check(
            scales_zeros_lo.dtype == scales_zeros.dtype and scales_zeros_lo.shape == scales_zeros.shape,
            lambda: f"{op}: scales_zeros_lo must match scales_zeros",
        )
    torch._check(bias is None or tuple(bias.shape) == (n,), lambda: f"{op}: bias must be [N={n}]")


def wna16_int4_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales_zeros: torch.Tensor,
    weight_lo: torch.Tensor | None = None,
    scales_zeros_lo: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T (+ bias) with W in PyTorch's CPU int4 layout (one or two int4 halves), computed in bf16.

    Args:
        x: fp16/bf16/fp32 [M, K], any M. Cast to bf16 for the fused product; from
            ``DEQUANT_MIN_ROWS`` rows on, W is dequantized once and multiplied in ``cpu_flags.compute_dtype(x.dtype)``.
        weight: uint8 [N, K/2], the output of ``aten._convert_weight_to_int4pack_for_cpu(u, 1)`` where u
            is int32 [N, K] of unsigned values in [0, 15]. N % 16 == 0.
        scales_zeros: bf16 [K/gc, N, 2], gc = K / scales_zeros.shape[0] in {32, 64, 128, 256}:
            [..., 0] the scale s, [..., 1] the zero z; w[n, k] = (u[n, k] - 8) * s[k//gc, n] + z[k//gc, n].
        weight_lo, scales_zeros_lo: optional second int4 half with the same shapes and meaning; W is the
            sum of both halves (int8 weights are split this way: see wna16_layout.to_cpu_int4_layout).
        bias: optional [N], any float dtype.
    Returns:
        [M, N] in x's dtype: the bf16 product(s) summed in fp32 with the bias, cast once.
    """
    if not (  # the common case in a few attribute reads; the full check names what is wrong
        x.dim() == 2 and x.dtype in ACTIVATION_DTYPES
        and weight.dtype == torch.uint8 and scales_zeros.dtype == COMPUTE_DTYPE
        and x.shape[1] == 2 * weight.shape[1] and scales_zeros.dim() == 3 and scales_zeros.shape[1] == weight.shape[0]
        and weight_lo is None and scales_zeros_lo is None and (bias is None or bias.shape == (weight.shape[0],))
    ):
        _check_int4_operands(x, weight, scales_zeros, weight_lo, scales_zeros_lo, bias)
    path = choose(x.shape[0], x.shape[1], weight.shape[0], x.dtype, "cpu_int4")
    return path.apply(x, weight, scales_zeros, weight_lo, scales_zeros_lo, bias)


@torch.library.register_fake("quantkit::wna16_int4_cpu", lib=_LIB)
def _wna16_int4_cpu_fake(x, weight, scales_zeros, weight_lo=None, scales_zeros_lo=None, bias=None):
    _check_int4_operands(x, weight, scales_zeros, weight_lo, scales_zeros_lo, bias)
    return x.new_empty((x.shape[0], weight.shape[0]))


def _check_int8_operands(x, weight, scale, zero_scale, bias) -> None:
    op = "quantkit::wna16_int8_cpu"
    torch._check(weight.dtype == torch.int8 and weight.dim() == 2, lambda: f"{op}: weight must be int8 [N, K]")
    n, k = weight.shape
    _check_x(x, k, op)
    torch._check(
        scale.dtype == COMPUTE_DTYPE and tuple(scale.shape) == (n,), lambda: f"{op}: scale must be bf16 [N={n}]"
    )
    torch._check(
        zero_scale is None or (zero_scale.dtype == torch.float32 and tuple(zero_scale.shape) == (n,)),
        lambda: f"{op}: zero_scale must be fp32 [N={n}] or None",
    )
    torch._check(bias is None or tuple(bias.shape) == (n,), lambda: f"{op}: bias must be [N={n}]")


def wna16_int8_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T (+ bias) with W int8 per output channel, computed in bf16 (``aten._weight_int8pack_mm``).

    Args:
        x: fp16/bf16/fp32 [M, K], any M. Cast to bf16 for the fused product; from
            ``DEQUANT_MIN_ROWS`` rows on, q is converted once and multiplied in ``cpu_flags.compute_dtype(x.dtype)``.
        weight: int8 [N, K], signed q (row-major, K contiguous).
        scale: bf16 [N]; w[n, k] = (q[n, k] - zp[n]) * scale[n].
        zero_scale: fp32 [N] = zp * scale for asymmetric weights (y -= sum_k x[m, k] * zero_scale[n]), or None.
        bias: optional [N], any float dtype.
    Returns:
        [M, N] in x's dtype.
    """
    if not (
        x.dim() == 2 and x.dtype in ACTIVATION_DTYPES and weight.dtype == torch.int8 and scale.dtype == COMPUTE_DTYPE
        and x.shape[1] == weight.shape[1] and scale.shape == (weight.shape[0],) and zero_scale is None
        and (bias is None or bias.shape == (weight.shape[0],))
    ):
        _check_int8_operands(x, weight, scale, zero_scale, bias)
    return choose(x.shape[0], x.shape[1], weight.shape[0], x.dtype, "cpu_int8").apply(x, weight, scale, zero_scale, bias)


@torch.library.register_fake("quantkit::wna16_int8_cpu", lib=_LIB)
def _wna16_int8_cpu_fake(x, weight, scale, zero_scale=None, bias=None):
    _check_int8_operands(x, weight, scale, zero_scale, bias)
    return x.new_empty((x.shape[0], weight.shape[0]))


_LIB.impl("wna16_int4_cpu", wna16_int4_cpu, "CPU")
_LIB.impl("wna16_int8_cpu", wna16_int8_cpu, "CPU")
