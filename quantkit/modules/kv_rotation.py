"""The Hadamard rotation of head_dim for FP8 KV caches.

A normalized Hadamard matrix H (head_dim x head_dim, Sylvester's construction, H = H^T, H H^T = I)
spreads a key's or value's outlier channels over all head_dim channels, which e4m3 with one scale
per tensor rounds far better. The cache stores fp8(x H / s) and reads (code * s) H^T; attention is
unchanged in exact arithmetic, since q k^T = (q H)(k H)^T.

    h = hadamard_matrix(64)           # fp32 [64, 64]
    check_rotation("hadamard", 64)    # QuantizationError for an unknown name or a head_dim not a power of two
    xr = rotate(x, h)                 # x [..., D] -> fp32 [..., D]: x H
"""

from __future__ import annotations

import functools

import torch

from ..core.errors import QuantizationError

#: rotation names a KV cache accepts ("none": the cache stores x as it is)
ROTATIONS = ("none", "hadamard")


def check_rotation(rotation: str, head_dim: int | None = None) -> str:
    """The rotation name, checked: one of ROTATIONS; "hadamard" needs a head_dim that is a power of two
    (Sylvester's construction). QuantizationError naming the problem and the fix otherwise."""
    if not isinstance(rotation, str) or rotation not in ROTATIONS:
        raise QuantizationError(f"KV cache rotation {rotation!r} is unknown: choose one of {', '.join(ROTATIONS)}")
    if rotation == "hadamard" and head_dim is not None and (head_dim < 1 or head_dim & (head_dim - 1)):
        raise QuantizationError(
            f"the Hadamard rotation of the KV cache needs a head_dim that is a power of two, this model's is "
            f"{head_dim}: use rotation: none for it")
    return rotation


@functools.lru_cache(maxsize=8)
def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # [[H, H], [H, -H]]
    return (h / n**0.5).float()


def hadamard_matrix(n: int) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of order n (a power of two): fp32 [n, n], symmetric and
    orthogonal (entries +-1/sqrt(n)). A fresh copy each call."""
    check_rotation("hadamard", int(n))
    return _hadamard(int(n)).clone()


def rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> fp32 [..., D]: x H. Undo with rotate(y, h.T)."""
    return torch.matmul(x.float(), h.to(x.device))
