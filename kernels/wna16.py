"""Backend dispatch for the weight-only (WNA16) linear."""

from __future__ import annotations

import torch

from .reference import wna16_linear_reference

BACKENDS = ("auto", "triton", "torch", "reference")


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Map "auto" to a concrete backend for weights living on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend != "auto":
        return backend
    return "reference"


def prepare_wna16(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    *,
    bits: int,
    in_features: int,
    backend: str,
) -> dict[str, torch.Tensor]:
    """Repack on-disk tensors into what ``backend`` reads. See quantkit.kernels for the layouts."""
    prepared = {"weight_packed": weight_packed, "weight_scale": weight_scale}
    if weight_zero_point is not None:
        prepared["weight_zero_point"] = weight_zero_point
    return prepared


def wna16_linear(
    x: torch.Tensor,
    prepared: dict[str, torch.Tensor],
    *,
    bits: int,
    in_features: int,
    out_features: int,
    backend: str,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ dequant(W).T + bias; x: [..., in_features] -> [..., out_features]."""
    return wna16_linear_reference(
        x, prepared["weight_packed"], prepared["weight_scale"], prepared.get("weight_zero_point"),
        bits, in_features, bias,
    )
