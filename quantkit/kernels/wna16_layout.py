"""Validation of WNA16 inputs and the in-memory layouts each backend reads.

On disk (compressed-tensors "pack-quantized", W is [N=out, K=in]):

- ``weight_packed``      int32 [N, ceil(K*bits/32)]: packed along K, least-significant first,
                         values stored unsigned (offset by 2**(bits-1));
- ``weight_scale``       fp16/bf16/fp32 [N, G], G = ceil(K / group_size) (G = 1: per channel); when the
                         group size does not divide K the last group is shorter ("ragged": K % group_size
                         inputs), which only an explicit ``group_size`` tells apart;
- ``weight_zero_point``  int32 [ceil(N*bits/32), G] packed along N (asymmetric only) or None;
- w = (q - zp) * s with q and zp signed.

Layouts built from it, once, by ``prepare_wna16`` (keys of the prepared dict); a ragged weight is
first rewritten exactly in uniform groups of gcd(group_size, K) (``uniform_groups``), so every layout
below only ever sees groups that divide K:

- "reference": the on-disk tensors themselves (``weight_packed``, ``weight_scale``,
  ``weight_zero_point``).
- "triton" (``triton_*`` keys), see ``to_triton_layout``.
- "torch" on CPU (``cpu_int4_*`` / ``cpu_int8_*`` keys), see ``to_cpu_int4_layout`` and
  ``to_cpu_int8_layout``; schemes those kernels cannot run keep the reference keys.

A prepared dict holds tensors only, and its keys alone say which layout it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .packing import check_bits, pack_int32, pack_zero_point, packed_words, unpack_int32, unpack_zero_point

# The activation (and scale) dtypes every WNA16 backend accepts: the one definition the kernels import.
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The CPU int4 kernel (_weight_int4pack_mm_for_cpu) accepts exactly these group sizes.
CPU_INT4_GROUP_SIZES = (256, 128, 64, 32)
CPU_INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0


@dataclass(frozen=True)
class WNA16Shape:
    """What the on-disk tensors describe: W [out_features, in_features] in groups of group_size."""

    out_features: int  # N
    in_features: int  # K
    bits: int
    groups: int  # G
    symmetric: bool
    ragged_group_size: int | None = None  # set when the last of the G groups is shorter (see uniform_groups)

    @property
    def group_size(self) -> int:
        return self.ragged_group_size or self.in_features // self.groups

    @property
    def per_channel(self) -> bool:
        return self.groups == 1

    @property
    def offset(self) -> int:
        """The unsigned storage offset 2**(bits-1)."""
        return 1 << (self.bits - 1)


def check_wna16_weight(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    bits: int,
    in_features: int,
    group_size: int | None = None,
) -> WNA16Shape:
    """Validate the on-disk tensors against each other; return their shape. Raises ValueError/TypeError.

    group_size: None (G must divide K: K / G inputs per group, or per channel) or the scheme's group size
    (G must be ceil(K / group_size); a shorter last group makes the shape ragged)."""
    check_bits(bits)
    if in_features <= 0:
        raise ValueError(f"in_features must be positive, got {in_features}")
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        raise TypeError(
            f"weight_packed must be a 2-D int32 tensor [N, ceil(K*bits/32)], got {weight_packed.dtype} "
            f"{tuple(weight_packed.shape)}"
        )
    n = weight_packed.shape[0]
    words = packed_words(in_features, bits)
    if weight_packed.shape[1] != words:
        raise ValueError(
            f"weight_packed has {weight_packed.shape[1]} words per row; in_features={in_features} at {bits} bits "
            f"needs ceil({in_features}*{bits}/32) = {words}"
        )
    if weight_scale.dtype not in ACTIVATION_DTYPES or weight_scale.dim() != 2 or weight_scale.shape[0] != n:
        raise ValueError(
            f"weight_scale must be [N={n}, G] in one of {ACTIVATION_DTYPES}, got {weight_scale.dtype} "
            f"{tuple(weight_scale.shape)}"
        )
    groups = weight_scale.shape[1]
    ragged = None
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive integer or None, got {group_size!r}")
        if groups != -(-in_features // group_size):
            raise ValueError(
                f"weight_scale has {groups} groups; in_features={in_features} in groups of {group_size} needs "
                f"ceil({in_features}/{group_size}) = {-(-in_features // group_size)}"
            )
        ragged = group_size if in_features % group_size else None
    elif groups < 1 or in_features % groups:
        raise ValueError(
            f"weight_scale has {groups} groups, which does not divide in_features={in_features}: "
            "G must be in_features / group_size (1 for per-channel); pass group_size= for a ragged last group"
        )
    if weight_zero_point is not None:
        zp_rows = packed_words(n, bits)
        if weight_zero_point.dtype != torch.int32 or tuple(weight_zero_point.shape) != (zp_rows, groups):
            raise ValueError(
                f"weight_zero_point must be int32 [ceil(N*bits/32)={zp_rows}, G={groups}] (packed along N), got "
                f"{weight_zero_point.dtype} {tuple(weight_zero_point.shape)}"
            )
    if weight_scale.device != weight_packed.device or (
        weight_zero_point is not None and weight_zero_point.device != weight_packed.device
    ):
        raise ValueError("weight_packed, weight_scale and weight_zero_point must be on the same device")
    return WNA16Shape(n, in_features, bits, groups, weight_zero_point is None, ragged)


def uniform_groups(
    weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None, shape: WNA16Shape
) -> tuple[torch.Tensor, torch.Tensor | None, WNA16Shape]:
    """A ragged weight's scales (and zero points) rewritten in uniform groups of d = gcd(group_size, K).

    Group j of a ragged weight covers inputs [j*g, min((j+1)*g, K)); d divides both g and K, so group j is
    exactly the small groups j*g/d .. of it, and repeating each scale g/d times (then keeping K/d of them)
    describes the same weight: w = (q - zp) * s unchanged, weight_packed untouched.
    returns: (weight_scale [N, K/d], weight_zero_point [ceil(N*bits/32), K/d] or None, the uniform shape).
    A shape that is not ragged comes back as it is.
    """
    if shape.ragged_group_size is None:
        return weight_scale, weight_zero_point, shape
    g, k = shape.ragged_group_size, shape.in_features
    repeat, groups = g // math.gcd(g, k), k // math.gcd(g, k)
    scale = weight_scale.repeat_interleave(repeat, dim=1)[:, :groups].contiguous()  # [N, K/d]
    zero_point = None
    if weight_zero_point is not None:
        zp = unpack_zero_point(weight_zero_point, shape.bits, shape.out_features)  # [N, G]
        zero_point = pack_zero_point(zp.repeat_interleave(repeat, dim=1)[:, :groups].contiguous(), shape.bits)
    return scale, zero_point, replace(shape, groups=groups, ragged_group_size=None)


def check_activation(x: torch.Tensor, in_features: int) -> None:
    """x: [..., K] floating point, K == in_features."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"x must be one of {ACTIVATION_DTYPES}, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"x must be [..., in_features={in_features}], got {tuple(x.shape)}")


# ----------------------------------------------------------------------------------------------
# Triton layout
# ----------------------------------------------------------------------------------------------
# Word rows per interleave block of the Triton layout (see to_triton_layout); group sizes must be a multiple of it.
TRITON_WORD_BLOCK = 8
TRITON_REPACK_ROWS = 1024  # output rows repacked at a time by to_triton_layout


def triton_word_rows(in_features: int, bits: int) -> int:
    """Rows of ``triton_qweight``: ceil(K*bits/32) words, padded up to a whole number of interleave blocks."""
    words = packed_words(in_features, bits)
    return -(-words // TRITON_WORD_BLOCK) * TRITON_WORD_BLOCK


def to_triton_layout(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None, shape: WNA16Shape
) -> dict[str, torch.Tensor]:
    """On-disk tensors -> the layout the Triton kernels read: N-contiguous words, K interleaved in blocks.

    With PW = 32 / bits values per word and B = TRITON_WORD_BLOCK (8) word rows per block:

    - ``triton_qweight`` int32 [KW, N], KW = ceil(K*bits/32) rounded up to a multiple of B. Block b
      (word rows b*B .. b*B + B - 1) holds the values k = b*B*PW .. (b+1)*B*PW - 1, and word row
      b*B + r holds k = b*B*PW + i*B + r in bits [i*bits, (i+1)*bits) for i = 0 .. PW-1, stored
      unsigned (offset 2**(bits-1)); values past K are zero (their x is masked to 0).
      Why: bit field i of the B words a thread loads (one 16-byte load per row: 4 adjacent columns)
      covers B *consecutive* values of K, so the matching activations are one contiguous 16-byte
      load of x instead of B strided scalar loads, and the B x PW values of a block, taken bit field by
      bit field, are the block's K values in order (a plain reshape gives the tile a ``tl.dot`` needs).
      N stays contiguous so a tile of words is one coalesced load.
    - ``triton_scales`` [G, N] in the scale dtype.
    - ``triton_zeros`` uint8 [G, N] (asymmetric only): the *unsigned* zero zp + 2**(bits-1), so that
      w = (u - zeros) * s exactly, with u the stored unsigned value; symmetric layers subtract the
      constant 2**(bits-1) instead and store no zeros.

    Group sizes must be a multiple of B (so the B consecutive values of one bit field share a scale)
    or cover the whole row (per channel).
    """
    k, bits = shape.in_features, shape.bits
    require_triton_layout(shape)
    per_word = 32 // bits
    rows = triton_word_rows(k, bits)
    words = []
    for chunk in weight_packed.split(TRITON_REPACK_ROWS):  # bounds the int64 temporaries of pack_int32
        q = unpack_int32(chunk, bits, k).to(torch.int32)  # [n', K] signed
        q = torch.nn.functional.pad(q, (0, rows * per_word - k))  # [n', Kp]: padding stored as the value 0
        # [n', blocks, PW (bit field i), B (row r)] -> [n', blocks, B, PW]: word (b, r) packs k = b*B*PW + i*B + r
        q = q.view(q.shape[0], rows // TRITON_WORD_BLOCK, per_word, TRITON_WORD_BLOCK).transpose(2, 3)
        words.append(pack_int32(q.reshape(q.shape[0], -1), bits))  # [n', KW]
    out = {
        "triton_qweight": torch.cat(words).t().contiguous(),  # [KW, N]
        "triton_scales": weight_scale.t().contiguous(),
    }
    if weight_zero_point is not None:
        zp = unpack_zero_point(weight_zero_point, shape.bits, shape.out_features)  # [N, G]
        out["triton_zeros"] = (zp + shape.offset).to(torch.uint8).t().contiguous()  # [G, N]
    return out


def check_triton_operands(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
) -> tuple[int, int, int, int]:
    """Validate the operands of quantkit::wna16_gemm; returns (M, N, K, group_size)."""
    op = "quantkit::wna16_gemm"
    check_bits(bits, op)
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{op}: x must be 2-D [M, K] in one of {ACTIVATION_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    rows = triton_word_rows(k, bits)
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] != rows:
        raise ValueError(
            f"{op}: qweight must be int32 [{rows}, N] for K={k} at {bits} bits (ceil(K*bits/32) words rounded up "
            f"to a multiple of {TRITON_WORD_BLOCK}: the layout prepare_wna16 builds), got {qweight.dtype} "
            f"{tuple(qweight.shape)}"
        )
    n = qweight.shape[1]
    if scales.dim() != 2 or scales.shape[1] != n or scales.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{op}: scales must be [G, N={n}] float, got {scales.dtype} {tuple(scales.shape)}")
    groups = scales.shape[0]
    if groups < 1 or k % groups:
        raise ValueError(f"{op}: scales has G={groups} groups, which does not divide K={k}")
    group_size = k // groups
    if groups > 1 and group_size % TRITON_WORD_BLOCK:
        raise ValueError(
            f"{op}: group_size={group_size} must be a multiple of {TRITON_WORD_BLOCK} or cover the whole row "
            "(per channel); use backend='reference' for other group sizes"
        )
    if zeros is not None and (zeros.dtype != torch.uint8 or tuple(zeros.shape) != (groups, n)):
        raise ValueError(f"{op}: zeros must be uint8 [G={groups}, N={n}], got {zeros.dtype} {tuple(zeros.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"{op}: bias must be [N={n}], got {tuple(bias.shape)}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}")
    return m, n, k, group_size


# ----------------------------------------------------------------------------------------------
# CPU layouts (PyTorch's weight-only CPU kernels)
# ----------------------------------------------------------------------------------------------
def triton_supports(shape: WNA16Shape) -> bool:
    """Whether the Triton layout can hold this layer: per-channel scales or a group size that is a
    multiple of TRITON_WORD_BLOCK (the consecutive K values of one bit field share a scale)."""
    return shape.per_channel or shape.group_size % TRITON_WORD_BLOCK == 0


def require_triton_layout(shape: WNA16Shape) -> None:
    """ValueError naming the fix where the Triton layout cannot hold ``shape`` (see ``triton_supports``)."""
    if not triton_supports(shape):
        raise ValueError(
            f"the Triton kernels need a group size that is a multiple of {TRITON_WORD_BLOCK} (or per-channel "
            f"scales), got {shape.group_size}; use backend='reference' for this layer"
        )


def cpu_int4_group_size(shape: WNA16Shape) -> int | None:
    """The group size the CPU int4 kernel runs this weight with, or None if it cannot.

    The kernel takes groups of 32/64/128/256; a larger group (or per-channel: one group of K) is run as
    the largest of those that divides it, with its scale repeated, which is exact.
    """
    if shape.out_features % CPU_INT4_N_MULTIPLE:
        return None
    return next((g for g in CPU_INT4_GROUP_SIZES if shape.group_size % g == 0), None)


def cpu_int4_supports(shape: WNA16Shape) -> bool:
    """int4 any group layout, or int8 grouped (split into two int4 halves), on the CPU int4 kernel."""
    return shape.bits in (4, 8) and cpu_int4_group_size(shape) is not None


def cpu_int8_supports(shape: WNA16Shape) -> bool:
    """int8 per channel on _weight_int8pack_mm (any N, K)."""
    return shape.bits == 8 and shape.per_channel


def _int4_scales_zeros(scale: torch.Tensor, zero: torch.Tensor, repeat: int) -> torch.Tensor:
    """scale, zero: fp32 [N, G] -> bf16 [G*repeat, N, 2] (the CPU kernel's scales_and_zeros)."""
    sz = torch.stack([scale, zero], dim=-1)  # [N, G, 2]
    sz = sz.repeat_interleave(repeat, dim=1)  # [N, G*repeat, 2]
    return sz.transpose(0, 1).contiguous().to(torch.bfloat16)  # [G*repeat, N, 2]


def to_cpu_int4_layout(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None, shape: WNA16Shape
) -> dict[str, torch.Tensor]:
    """On-disk tensors -> ``_weight_int4pack_mm_for_cpu`` operands (CPU tensors).

    That kernel computes w = (u - 8) * scale + zero for u in [0, 15] stored unsigned, with
    scales_and_zeros [K/gc, N, 2] (gc in 32/64/128/256) in the activation dtype; quantkit runs it in
    bf16, its fast path. With u = q + 8 (the stored value): zero = -zp * s.

    int4 -> ``cpu_int4_weight`` uint8 [N, K/2] (the kernel's packed form) and ``cpu_int4_scales_zeros``
    bf16 [K/gc, N, 2].

    int8 grouped -> the same for two int4 halves, exact: q = 16*hi + lo with hi in [-8, 7], lo in [0, 15],
    w = (hi + 8 - 8) * 16s + (lo - 8) * s + (8 - zp) * s: ``cpu_int4_weight`` / ``cpu_int4_scales_zeros`` hold
    the high half (scale 16s, zero 0) and ``cpu_int4_weight_lo`` / ``cpu_int4_scales_zeros_lo`` the low half
    (scale s, zero (8 - zp) s). Two int4 passes read the same bytes as one int8 pass.
    """
    gc = cpu_int4_group_size(shape)
    if shape.bits not in (4, 8) or gc is None:
        raise ValueError(f"the CPU int4 kernel cannot run {shape}: it needs N % 16 == 0 and groups of a multiple of 32")
    repeat = shape.group_size // gc
    n, k = shape.out_features, shape.in_features
    q = unpack_int32(weight_packed.cpu(), shape.bits, k).to(torch.int32)  # [N, K] signed
    s = weight_scale.cpu().to(torch.float32)  # [N, G]
    zp = (
        unpack_zero_point(weight_zero_point.cpu(), shape.bits, n).to(torch.float32)
        if weight_zero_point is not None
        else torch.zeros_like(s)
    )  # [N, G]
    convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    if shape.bits == 4:
        return {
            "cpu_int4_weight": convert((q + 8).contiguous(), 1),  # uint8 [N, K/2]
            "cpu_int4_scales_zeros": _int4_scales_zeros(s, -zp * s, repeat),
        }
    hi = torch.div(q, 16, rounding_mode="floor")  # [N, K] in [-8, 7]
    lo = q - 16 * hi  # [N, K] in [0, 15]
    return {
        "cpu_int4_weight": convert((hi + 8).contiguous(), 1),
        "cpu_int4_scales_zeros": _int4_scales_zeros(16 * s, torch.zeros_like(s), repeat),
        "cpu_int4_weight_lo": convert(lo.contiguous(), 1),
        "cpu_int4_scales_zeros_lo": _int4_scales_zeros(s, (8 - zp) * s, repeat),
    }


def to_cpu_int8_layout(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None, shape: WNA16Shape
) -> dict[str, torch.Tensor]:
    """On-disk int8 per-channel tensors -> ``_weight_int8pack_mm`` operands (CPU tensors).

    - ``cpu_int8_weight`` int8 [N, K] (signed q), ``cpu_int8_scale`` bf16 [N];
    - asymmetric: ``cpu_int8_zero_scale`` fp32 [N] = zp * s, applied as y -= rowsum(x) * zp * s.
    """
    if not cpu_int8_supports(shape):
        raise ValueError(f"the CPU int8 kernel runs int8 per-channel weights only, got {shape}")
    n, k = shape.out_features, shape.in_features
    s = weight_scale.cpu().to(torch.float32)[:, 0]  # [N]
    out = {
        "cpu_int8_weight": unpack_int32(weight_packed.cpu(), 8, k).contiguous(),  # int8 [N, K]
        "cpu_int8_scale": s.to(torch.bfloat16),
    }
    if weight_zero_point is not None:
        zp = unpack_zero_point(weight_zero_point.cpu(), 8, n)[:, 0].to(torch.float32)  # [N]
        out["cpu_int8_zero_scale"] = (zp * s).contiguous()
    return out


# ----------------------------------------------------------------------------------------------
# CPU q8dot layout (quantkit's own C++ kernel: quantkit/kernels/csrc/wna16_q8dot.cpp)
# ----------------------------------------------------------------------------------------------
CPU_Q8_BLOCK = 32  # the kernel's activation block: K and the group size must be multiples of it
CPU_Q8_SUPER = 64  # values per superblock of its weight layout (K padded to a multiple)


def cpu_q8_supports(shape: WNA16Shape) -> bool:
    """int4 / int8, symmetric or not, per channel or in groups of a multiple of 32, K % 32 == 0, any N."""
    return (
        shape.bits in (4, 8)
        and shape.in_features % CPU_Q8_BLOCK == 0
        and shape.group_size % CPU_Q8_BLOCK == 0
    )


def to_cpu_q8_layout(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None, shape: WNA16Shape
) -> dict[str, torch.Tensor]:
    """On-disk tensors -> the layout ``quantkit::wna16_cpu_q8dot`` streams (CPU tensors), K padded to
    Kp = a multiple of 64 (padding weights 0; the kernel pads the activations with 0):

    - ``cpu_q8_weight``: int4 -> uint8 [N, Kp/2], superblock t (64 values of K) in 32 bytes, byte j
      holding u = q + 8 of k = 64t + j (low nibble) and of k = 64t + 32 + j (high nibble): one 32-byte
      load is two blocks of 32 consecutive values. int8 -> int8 [N, Kp], q itself.
    - ``cpu_q8_scale``: fp32 [N, G] (exact copies of the checkpoint's scales).
    - ``cpu_q8_zero`` (asymmetric only): fp32 [N, G], the zero in the kernel's domain: zp + 8 (int4) or
      zp (int8); w = (u - zero) * scale.
    """
    if not cpu_q8_supports(shape):
        raise ValueError(f"the CPU q8dot kernel cannot run {shape}: it needs int4/int8 with K and the group size "
                         f"multiples of {CPU_Q8_BLOCK}")
    n, k = shape.out_features, shape.in_features
    kp = -(-k // CPU_Q8_SUPER) * CPU_Q8_SUPER
    q = unpack_int32(weight_packed.cpu(), shape.bits, k)  # int8 [N, K] signed
    if shape.bits == 4:
        u = torch.nn.functional.pad((q + 8).to(torch.uint8), (0, kp - k)).view(n, kp // CPU_Q8_SUPER, 2, 32)
        weight = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n, kp // 2).contiguous()
    else:
        weight = torch.nn.functional.pad(q, (0, kp - k)).contiguous()
    out = {"cpu_q8_weight": weight, "cpu_q8_scale": weight_scale.cpu().to(torch.float32).contiguous()}
    if weight_zero_point is not None:
        zp = unpack_zero_point(weight_zero_point.cpu(), shape.bits, n).to(torch.float32)  # [N, G]
        out["cpu_q8_zero"] = (zp + (8 if shape.bits == 4 else 0)).contiguous()
    return out
