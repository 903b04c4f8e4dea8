"""Bit packing of signed integers into int32 words, in the compressed-tensors order.

Element k of a row goes to word k // (32 // bits), at bit offset (k % (32 // bits)) * bits,
least-significant first, no interleave. Values are stored offset by 2**(bits-1) so that they
are unsigned: int4 [0..7, -8..-1] -> words 0xfedcba98, 0x76543210.

Weights pack along the input dim (the last: ``pack_int32``), zero points along the output dim
(the first: ``pack_zero_point``). The only home of these layouts in quantkit.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (2, 4, 8)


def check_bits(bits: int, where: str = "") -> int:
    """Raise ValueError unless `bits` is a packable width; returns the values per int32 word (32 // bits).

    where: prefix of the message (e.g. the op's name).
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{where + ': ' if where else ''}bits={bits} is not supported: bits must be one of {SUPPORTED_BITS}")
    return 32 // bits


def packed_words(size: int, bits: int) -> int:
    """Number of int32 words that hold `size` values of `bits` bits: ceil(size * bits / 32)."""
    return -(-size // check_bits(bits))


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed integers along the last dim.

    values: integer tensor [..., K] with entries in [-2**(bits-1), 2**(bits-1) - 1].
    returns: int32 [..., ceil(K * bits / 32)]; a ragged tail is padded with the offset (value 0).
    """
    per_word = check_bits(bits)
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise TypeError(f"pack_int32 expects an integer tensor, got {values.dtype}")
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if values.numel():
        low, high = torch.aminmax(values)
        if int(low) < lo or int(high) > hi:
            raise ValueError(f"values out of the signed {bits}-bit range [{lo}, {hi}]")
    k = values.shape[-1]
    n_words = packed_words(k, bits)
    pad = n_words * per_word - k
    u = values.to(torch.int32) + (1 << (bits - 1))  # unsigned, [..., K]
    if pad:
        u = torch.nn.functional.pad(u, (0, pad), value=1 << (bits - 1))
    u = u.reshape(*u.shape[:-1], n_words, per_word)  # [..., words, per_word]
    # value i of a word to bits [i * bits, (i + 1) * bits): int32 shifts wrap into the sign bit, as the words do
    words = u[..., 0].clone()  # [..., words]
    for i in range(1, per_word):
        words |= u[..., i] << (i * bits)
    return words


def unpack_int32(packed: torch.Tensor, bits: int, size: int) -> torch.Tensor:
    """Inverse of pack_int32.

    packed: int32 [..., W]; size: number of elements K to keep (K <= W * 32 / bits).
    returns: int8 [..., K] (signed values).
    """
    per_word = check_bits(bits)
    if packed.dtype != torch.int32:
        raise TypeError(f"unpack_int32 expects int32 words, got {packed.dtype}")
    if size > packed.shape[-1] * per_word:
        raise ValueError(f"cannot unpack {size} values from {packed.shape[-1]} words of {bits}-bit values")
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int32) * bits
    mask = (1 << bits) - 1
    u = (packed.unsqueeze(-1) >> shifts) & mask  # [..., W, per_word]; >> is arithmetic, & fixes sign
    u = u.reshape(*packed.shape[:-1], -1)[..., :size]
    return (u - (1 << (bits - 1))).to(torch.int8)


def pack_zero_point(zero_point: torch.Tensor, bits: int) -> torch.Tensor:
    """Zero points packed along the output dim (``weight_zero_point``).

    zero_point: integer [N, G] signed. returns: int32 [ceil(N*bits/32), G].
    """
    return pack_int32(zero_point.t().contiguous(), bits).t().contiguous()


def unpack_zero_point(weight_zero_point: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """Inverse of pack_zero_point: int32 [ceil(N*bits/32), G] -> int32 [N, G] signed zero points."""
    return unpack_int32(weight_zero_point.t().contiguous(), bits, out_features).t().to(torch.int32).contiguous()
