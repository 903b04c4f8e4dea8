"""CPU WNA16 linear with int8-rounded activations and integer dot products (the "cpu_q8" layout).

``torch.ops.quantkit.wna16_cpu_q8dot(x, weight, scale, zero=None, bias=None)`` (C++:
``csrc/wna16_q8dot.cpp``, built on first use by ``cpu_extension``) streams an int4 or int8 weight once
per call, for decode and short prompts: x is rounded to int8 in blocks of 32 values (one fp32 scale per
block, round-to-nearest-even, as llama.cpp's Q8_0), each block's product with a weight row is an exact
int32 dot product (AVX-512 VNNI ``vpdpbusd``; AVX2 ``vpmaddubsw`` + ``vpmaddwd``; scalar), scaled by
(activation scale x weight scale) and summed in fp32. The weight scales are fp32 (exact copies of the
checkpoint's), so the only rounding beyond fp32 is the activations' (``quantize_activations_q8``):
relative error of one block ~ 2^-9 of its largest value.

Batches and prompts run the same op (an int8 GEMM from a few rows on, with the same rounding);
``cpu_kernel_choice`` says which path runs a call (on a CPU with AMX bf16 tiles, bf16 prompts dequantize
the weight once with ``wna16_cpu_q8dot_unpack`` and run the dense bf16 matmul).

The pure-torch reference ``wna16_cpu_q8dot_reference`` reproduces the activation rounding bit for bit
and multiplies exactly (float64), so the kernel matches it to fp32 summation error, and
reference-vs-float-product is the error of the rounding alone.
"""

from __future__ import annotations

import torch

BLOCK = 32  # activation values per fp32 scale

def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation rounding, in torch: x [M, K] (K % 32 == 0) -> (q int8 [M, K], d fp32 [M, K/32]).

    Per block of 32: d = max|x| / 127 (fp32), q = round-half-even(x * (1/d)) clamped to [-127, 127]
    (q = 0 where d = 0); x ~ q * d. Identical, bit for bit, to the C++ code (same fp32 operations)."""
    m, k = x.shape
    xf = x.to(torch.float32).reshape(m, k // BLOCK, BLOCK)
    d = xf.abs().amax(dim=-1) / 127.0  # [M, K/32]
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xf * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q.reshape(m, k), d


def unpack_cpu_q8_weight(
    weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, in_features: int
) -> torch.Tensor:
    """The cpu_q8 layout -> fp32 [N, K] dequantized weight, in torch (the reference's reading of it)."""
    n, k = weight.shape[0], in_features
    if weight.dtype == torch.uint8:  # [N, Kp/2]: superblock t, byte j -> k = 64t + j (low), 64t + 32 + j (high)
        b = weight.view(n, -1, 32).to(torch.int32)
        u = torch.cat([b & 0x0F, b >> 4], dim=-1).reshape(n, -1)[:, :k].to(torch.float32)
        z = 8.0 if zero is None else zero
    else:
        u = weight[:, :k].to(torch.float32)
        z = 0.0 if zero is None else zero
    group = k // scale.shape[1]
    if isinstance(z, torch.Tensor):
        z = z.repeat_interleave(group, dim=1)
    return (u - z) * scale.repeat_interleave(group, dim=1)


def wna16_cpu_q8dot_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """What ``wna16_cpu_q8dot`` computes, in torch: the rounded activations times the exact weight, in
    float64; x [M, K] -> [M, N] in x's dtype."""
    q, d = quantize_activations_q8(x)
    x_hat = (q.to(torch.float64).reshape(*d.shape, BLOCK) * d.to(torch.float64).unsqueeze(-1)).reshape(x.shape)
    w = unpack_cpu_q8_weight(weight, scale, zero, x.shape[1]).to(torch.float64)
    y = x_hat @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(x.dtype)


_FAKES_REGISTERED = False


def register_fakes() -> None:
    """Fake (meta) implementations of the C++ ops, for torch.compile; once, after the library loads."""
    global _FAKES_REGISTERED
    if _FAKES_REGISTERED:
        return
    _FAKES_REGISTERED = True

    @torch.library.register_fake("quantkit::wna16_cpu_q8dot")
    def _q8dot_fake(x, weight, scale, zero=None, bias=None):
        torch._check(x.dim() == 2 and x.shape[1] % BLOCK == 0, lambda: "wna16_cpu_q8dot: x must be [M, K], K % 32 == 0")
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("quantkit::wna16_cpu_q8dot_unpack")
    def _unpack_fake(weight, scale, zero, in_features, bf16):
        return weight.new_empty((weight.shape[0], in_features), dtype=torch.bfloat16 if bf16 else torch.float32)
