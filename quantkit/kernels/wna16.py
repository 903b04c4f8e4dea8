"""The weight-only (WNA16) linear's contract, which quantkit.modules.QuantLinear calls: ``prepare_wna16``
once at load, ``wna16_linear`` per call.

Which backend a model runs on ("triton", "torch", "reference"; "auto" resolved) is ``backend_choice``'s
rule (``resolve_backend``); which layout a layer gets on it is ``planned_layout`` (here): on "torch",
int4/int8 with K and the group size multiples of 32 -> "cpu_q8" (quantkit's C++ kernel) when its library
builds and loads; otherwise PyTorch's kernels: int8 per channel -> "cpu_int8"
(aten._weight_int8pack_mm); int4, or int8 in groups, with N % 16 == 0 and a group size that is a
multiple of 32 (or per channel with K % 32 == 0) -> "cpu_int4" (aten._weight_int4pack_mm_for_cpu; int8
groups run as two exact int4 halves); any other layer (int2, odd shapes) -> "reference". Which path runs
each call on a layout is ``backend_choice.choose_kernel`` (the CPU layouts' paths: ``cpu_kernel_choice``).
Numerics of every path: README.md here.
"""

from __future__ import annotations

from collections import Counter

import torch

from . import wna16_cpu  # noqa: F401  (registers torch.ops.quantkit.wna16_int4_cpu / wna16_int8_cpu)
from .backend_choice import REFERENCE, TRITON_GEMM, resolve_backend
from .cpu_extension import cpu_kernel_isa, load_cpu_kernels
from .cpu_kernel_choice import AtenInt4Fused, AtenInt8Fused, Q8Dot
from .cpu_kernel_choice import choose as choose_cpu_kernel
from .wna16_layout import (
    ACTIVATION_DTYPES as _ACTIVATION_DTYPES,
    WNA16Shape,
    check_activation,
    check_wna16_weight,
    cpu_int4_supports,
    cpu_int8_supports,
    cpu_q8_supports,
    require_triton_layout,
    triton_supports,
    uniform_groups,
)


def prepare_wna16(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    *,
    bits: int,
    in_features: int,
    backend: str,
    group_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Repack on-disk compressed-tensors tensors into what ``backend`` reads, once, at load time.

    Args (on-disk layout, W is [N=out, K=in]):
        weight_packed: int32 [N, ceil(K*bits/32)], packed along K, least-significant first, offset 2**(bits-1).
        weight_scale: fp16/bf16/fp32 [N, G], G = ceil(K / group_size) (1 per channel).
        weight_zero_point: int32 [ceil(N*bits/32), G] packed along N (asymmetric), or None.
        bits: 2, 4 or 8. in_features: K.
        group_size: the scheme's group size, needed when it does not divide K (a ragged last group, which
            is rewritten in uniform groups of gcd(group_size, K) first: ``wna16_layout.uniform_groups``);
            None: G must divide K.
        backend: "triton" | "torch" | "reference" ("auto" is resolved from weight_packed's device).
            "torch" needs CPU tensors; the "triton" layout can be built on any device.
    Returns:
        dict name -> tensor, self-sufficient (only tensors; the keys say which layout it is):
        "reference" (and "torch" layers its kernels cannot run): the inputs themselves, not copies (a
        ragged weight: weight_packed itself and its scales / zero points in uniform groups);
        "triton": triton_qweight / triton_scales / triton_zeros (wna16_layout.to_triton_layout);
        "torch": cpu_q8_*, cpu_int4_* or cpu_int8_* (wna16_layout.to_cpu_q8_layout / to_cpu_int4_layout /
        to_cpu_int8_layout). Built by the layout's kernel path (its ``prepare``: ``LAYOUT_PATHS``).
    """
    shape = check_wna16_weight(weight_packed, weight_scale, weight_zero_point, bits, in_features, group_size)
    weight_scale, weight_zero_point, shape = uniform_groups(weight_scale, weight_zero_point, shape)
    if backend != "triton":  # the Triton layout may be built on CPU and moved to a GPU afterwards
        chosen = resolve_backend(backend, weight_packed.device, weight_scale.dtype)
        # "auto" never fails on a layer a kernel cannot hold: it keeps the exact reference instead.
        backend = "reference" if backend == "auto" and chosen == "triton" and not triton_supports(shape) else chosen
    return LAYOUT_PATHS[planned_layout(shape, backend)].prepare(weight_packed, weight_scale, weight_zero_point, shape)


def planned_layout(shape: WNA16Shape, backend: str) -> str:
    """The layout ``prepare_wna16`` builds for a layer of ``shape`` on a concrete ``backend``:
    "triton", "cpu_q8", "cpu_int8", "cpu_int4" or "reference" (the "torch" backend keeps the reference
    for layers its kernels cannot run). "cpu_q8" (quantkit's C++ kernel) wherever it runs the layer and
    its library loads (``cpu_extension.load_cpu_kernels``, which builds it on first use); PyTorch's
    kernels otherwise. Raises ValueError where the backend cannot hold the layer at all (the Triton
    layout and a group size that is not a multiple of its word block).

    ``shape`` comes from ``check_wna16_weight``, which reads only dtypes and shapes: an engine can ask
    before any weight exists, with tensors on the meta device.
    """
    if backend == "triton":
        require_triton_layout(shape)
        return "triton"
    if backend == "torch":
        if cpu_q8_supports(shape) and load_cpu_kernels().available:
            return "cpu_q8"
        if cpu_int8_supports(shape):
            return "cpu_int8"
        if cpu_int4_supports(shape):
            return "cpu_int4"
    return "reference"


#: the path that decodes (one row) on each layout, in the order ``prepared_layout`` looks for their tensors
LAYOUT_KERNELS = (TRITON_GEMM, Q8Dot(), AtenInt4Fused(), AtenInt8Fused(), REFERENCE)
LAYOUT_PATHS = {path.layout: path for path in LAYOUT_KERNELS}  # each layout's decode path, which prepares it
KERNEL_NAMES = {path.layout: path.name for path in LAYOUT_KERNELS}


def prepared_layout(prepared: dict[str, torch.Tensor]) -> str:
    """Which layout a prepared dict holds: "triton", "cpu_q8", "cpu_int4", "cpu_int8" or "reference"."""
    for path in LAYOUT_KERNELS:
        if path.keys[0] in prepared:
            return path.layout
    raise ValueError(f"not a prepared WNA16 weight (keys {sorted(prepared)}); build it with prepare_wna16")


def describe_layouts(layouts: list[str]) -> str:
    """Which kernels run a model's linears, from their prepared layouts: "quantkit::wna16_cpu_q8dot
    (avx512-vnni) x 30, aten._weight_int8pack_mm x 2" (the C++ kernel's code path named)."""
    parts = []
    for layout, count in Counter(layouts).most_common():
        name = KERNEL_NAMES.get(layout, layout)
        if layout == "cpu_q8":
            name += f" ({cpu_kernel_isa()})"
        parts.append(f"{name} x {count}")
    return ", ".join(parts) or "none"


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
    """y = x @ dequant(W).T + bias; x: [..., in_features] fp16/bf16/fp32 -> [..., out_features] in x's dtype.

    ``prepared`` comes from ``prepare_wna16`` with the same ``backend`` (it may since have been moved
    with ``.to(device)``). This runs once per linear per decode step, so it is kept to a few
    attribute reads before the op call.
    """
    if x.dtype not in _ACTIVATION_DTYPES or x.shape[-1] != in_features:
        check_activation(x, in_features)  # raises, naming the problem
    x2 = x.reshape(-1, in_features) if x.dim() != 2 else x  # [M, K]
    if "cpu_q8_weight" in prepared and backend == "torch":
        path = choose_cpu_kernel(x2.shape[0], in_features, prepared["cpu_q8_weight"].shape[0], x2.dtype, "cpu_q8")
        y = path.apply(x2, *path.operands(prepared), bias)
    elif "cpu_int4_weight" in prepared and backend == "torch":
        y = torch.ops.quantkit.wna16_int4_cpu(x2, *AtenInt4Fused.operands(prepared), bias)
    elif "cpu_int8_weight" in prepared and backend == "torch":
        y = torch.ops.quantkit.wna16_int8_cpu(x2, *AtenInt8Fused.operands(prepared), bias)
    elif "triton_qweight" in prepared and backend == "triton":
        y = TRITON_GEMM.apply(x2, *TRITON_GEMM.operands(prepared), bias, bits)
    elif "weight_packed" in prepared and backend in ("reference", "torch"):
        y = REFERENCE.apply(x2, *REFERENCE.operands(prepared), bits, bias)
    else:
        layout = prepared_layout(prepared)  # raises for a dict that is no prepared weight
        raise ValueError(
            f"the weight was prepared in the {layout!r} layout, which backend {backend!r} does not read; "
            f"call prepare_wna16(..., backend={backend!r}) again"
        )
    if y.shape[-1] != out_features:
        raise ValueError(f"the prepared weight has {y.shape[-1]} outputs, out_features={out_features}")
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], out_features)
