"""Random quantized weights in the on-disk compressed-tensors layout, and the tolerances kernels meet."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.kernels import dequantize_wna16, pack_int32


@dataclass(frozen=True)
class Scheme:
    bits: int
    group_size: int | None  # None: per output channel
    symmetric: bool

    @property
    def id(self) -> str:
        group = "ch" if self.group_size is None else f"g{self.group_size}"
        return f"int{self.bits}-{group}-{'sym' if self.symmetric else 'asym'}"


TRITON_SCHEMES = [
    Scheme(bits, group, sym)
    for bits, groups in ((4, (32, 64, 128, None)), (8, (None, 64)), (2, (64,)))
    for group in groups
    for sym in (True, False)
]


@dataclass
class Weight:
    """On-disk tensors of one random layer plus its exact fp32 dequantization."""

    weight_packed: torch.Tensor  # int32 [N, ceil(K*bits/32)]
    weight_scale: torch.Tensor  # [N, G]
    weight_zero_point: torch.Tensor | None  # int32 [ceil(N*bits/32), G]
    dequantized: torch.Tensor  # fp32 [N, K]
    bits: int
    in_features: int
    out_features: int


def random_weight(scheme: Scheme, n: int, k: int, dtype: torch.dtype, generator: torch.Generator) -> Weight:
    """Fresh random q, zero points and positive scales (never zeros) in `dtype`; a group size that does
    not divide k gives ceil(k / group_size) groups, the last one shorter (ragged)."""
    bits = scheme.bits
    groups = 1 if scheme.group_size is None else -(-k // scheme.group_size)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (n, k), generator=generator)
    scale = (torch.rand(n, groups, generator=generator) * 0.02 + 0.005).to(dtype)  # [N, G]
    zero_point = None
    if not scheme.symmetric:
        zp = torch.randint(lo, hi + 1, (n, groups), generator=generator)  # [N, G]
        zero_point = pack_int32(zp.t().contiguous(), bits).t().contiguous()  # [ceil(N*bits/32), G]
    packed = pack_int32(q, bits)
    dequantized = dequantize_wna16(packed, scale.float(), zero_point, bits, k, scheme.group_size)  # exact in fp32
    return Weight(packed, scale, zero_point, dequantized, bits, k, n)


def reference_output(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 y = x @ dequant(W).T (+ bias) from the exactly dequantized weight."""
    y = x.double() @ weight.dequantized.double().t()
    if bias is not None:
        y = y + bias.double()
    return y


def rel_mean_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """mean |out - ref| / mean |ref|; NaN anywhere counts as an infinite error."""
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref.double()).abs().mean() / ref.double().abs().mean()).item()


def tolerance(dtype: torch.dtype) -> float:
    """Bound on the relative mean error of a kernel that computes in `dtype`.

    Rounding the output to a 16-bit float moves each element by at most half a unit in the last place,
    eps/2 relative (eps = 2^-10 for fp16, 2^-7 for bf16); rounding x and the dequantized weight to the
    same format for the product adds errors of the same order that average out over K. The mean of the
    whole error stays well below eps, so eps is a safe bound that still catches any real defect (a
    wrong nibble, scale or zero moves outputs by O(1) relative). fp16: 9.8e-4 (<= the 1e-3 the design
    asks for). fp32 kernels only differ in summation order over K <= 256 terms (~sqrt(K) * 2^-24): 1e-5.
    """
    if dtype == torch.float32:
        return 1e-5
    return torch.finfo(dtype).eps
