"""Backend dispatch for the weight-only (WNA16) linear: the contract quantkit.modules.QuantLinear calls.

Backends (``resolve_backend`` turns "auto" into one of them, from the weight's device and the model dtype):

- "triton": the Triton kernels (``torch.ops.quantkit.wna16_gemm``, registered by ``triton_ops.register_ops``
  when a layer is first prepared or run on this backend). "auto" picks it for CUDA tensors.
  Runs int2/int4/int8, per channel or in groups of a multiple of 32/bits, symmetric or not,
  activations fp16/bf16/fp32 (fp32 accumulation, output in x's dtype).
- "torch": the CPU kernels. "auto" picks it for CPU tensors of a bf16 or fp32 model (or an unknown
  dtype). Per layer, at prepare time: int4/int8 with K and the group size multiples of 32 ->
  ``torch.ops.quantkit.wna16_cpu_q8dot`` (quantkit's C++ kernel, int8-rounded activations and integer
  dot products: ``wna16_cpu_q8``) when its library builds and loads; otherwise PyTorch's kernels:
  int8 per channel -> ``torch.ops.quantkit.wna16_int8_cpu`` (aten._weight_int8pack_mm);
  int4, or int8 in groups, with N % 16 == 0 and a group size that is a multiple of 32 (or per
  channel with K % 32 == 0) -> ``torch.ops.quantkit.wna16_int4_cpu`` (aten._weight_int4pack_mm_for_cpu;
  int8 groups run as two exact int4 halves); any other layer (int2, odd shapes) -> the reference.
  Numerics: below ``DEQUANT_MIN_ROWS`` rows (decode) these kernels compute in bf16 whatever x's dtype
  (their fp16/fp32 paths are 1.3-47x slower: ``evals/kernels/cpu/cpu_activation_paths_*.md``);
  from it on (prefill) fp32/fp16 activations multiply in fp32 a weight dequantized with the bf16
  scales. An fp32 model thus gets bf16 precision: relative mean error <= 2^-7 (bf16's eps) against
  the fp32 product with the exactly dequantized weight, 1e-3 to 3e-3 measured.
- "reference": dequantize in fp32 and matmul in fp32 on any device (``wna16_linear_reference``): exact,
  slow. "auto" picks it for fp16 models on CPU (bf16 would drop 3 of fp16's mantissa bits, and at
  M = 1 fp16 dense GEMVs are as fast as the bf16 kernels there) and for devices that are neither CUDA
  nor CPU.

Beside ``resolve_backend``, the rest of the backend policy callers ask instead of restating it: the backend a
speed benchmark prepares for (``benchmark_backend``) and where q/k/v and gate/up run fused
(``fuses_projections``, which ``quantkit.modules.model_kernels`` applies to a model).
"""

from __future__ import annotations

from collections import Counter

import torch

from . import wna16_cpu  # noqa: F401  (registers torch.ops.quantkit.wna16_int4_cpu / wna16_int8_cpu)
from .cpu_extension import cpu_kernel_isa, load_cpu_kernels
from .reference import wna16_linear_reference
from .wna16_layout import (
    ACTIVATION_DTYPES as _ACTIVATION_DTYPES,
    WNA16Shape,
    check_activation,
    check_triton_operands,
    check_wna16_weight,
    cpu_int4_supports,
    cpu_int8_supports,
    cpu_q8_supports,
    require_triton_layout,
    to_cpu_int4_layout,
    to_cpu_q8_layout,
    triton_supports,
    to_cpu_int8_layout,
    to_triton_layout,
    uniform_groups,
)
from .cpu_kernel_choice import choose as choose_cpu_kernel
from .triton_ops import register_ops, triton_can_run_on

BACKENDS = ("auto", "triton", "torch", "reference")


def resolve_backend(backend: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """Map "auto" to a concrete backend for weights living on ``device``; check explicit choices.

    "auto": CUDA -> "triton"; CPU -> "torch" for a bf16 or fp32 model (or ``dtype`` None: fast, bf16
    precision), "reference" for an fp16 one; any other device -> "reference".
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cuda":
            return "triton"
        if device.type == "cpu" and dtype in (torch.bfloat16, torch.float32, None):
            return "torch"
        return "reference"
    if backend == "triton" and not triton_can_run_on(device):
        raise ValueError(
            f"backend 'triton' needs the weights on a CUDA device (got {device}); on CPU use 'torch' or "
            "'reference' (or set TRITON_INTERPRET=1 before importing quantkit to run the kernels interpreted)"
        )
    if backend == "torch" and device.type != "cpu":
        raise ValueError(f"backend 'torch' runs PyTorch's CPU kernels and needs CPU weights, got {device}")
    return backend


def benchmark_backend(backend: str, device: torch.device | str) -> str:
    """The backend a speed benchmark prepares its variants for: "auto" on the CPU is "torch" whatever the
    model dtype (an fp16 model's too, which ``resolve_backend``'s "auto" keeps on the exact but slow reference:
    a benchmark times the CPU kernels, which take its activations in bf16); any other choice as given."""
    return "torch" if backend == "auto" and torch.device(device).type == "cpu" else backend


def fuses_projections(backend: str) -> bool:
    """Whether the linears of a concrete ``backend`` run q/k/v and gate/up as one fused linear each
    (``quantkit.modules.fused_linear``) by default: the CPU kernels ("torch"), where each call's fixed cost
    (dispatch, threads, reading x) weighs on a decode step's many small products."""
    return backend == "torch"


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
        "torch": cpu_int4_* or cpu_int8_* (wna16_layout.to_cpu_int4_layout / to_cpu_int8_layout).
    """
    shape = check_wna16_weight(weight_packed, weight_scale, weight_zero_point, bits, in_features, group_size)
    weight_scale, weight_zero_point, shape = uniform_groups(weight_scale, weight_zero_point, shape)
    if backend != "triton":  # the Triton layout may be built on CPU and moved to a GPU afterwards
        chosen = resolve_backend(backend, weight_packed.device, weight_scale.dtype)
        # "auto" never fails on a layer a kernel cannot hold: it keeps the exact reference instead.
        backend = "reference" if backend == "auto" and chosen == "triton" and not triton_supports(shape) else chosen
    layout = planned_layout(shape, backend)
    if layout == "triton":
        register_ops()  # at load time, before the first call (and before any torch.compile or CUDA graph)
        prepared = to_triton_layout(weight_packed, weight_scale, weight_zero_point, shape)
        probe = weight_scale.new_empty((0, in_features))
        check_triton_operands(
            probe, prepared["triton_qweight"], prepared["triton_scales"], prepared.get("triton_zeros"), None, bits
        )
        return prepared
    if layout == "cpu_q8":
        return to_cpu_q8_layout(weight_packed, weight_scale, weight_zero_point, shape)
    if layout == "cpu_int8":
        return to_cpu_int8_layout(weight_packed, weight_scale, weight_zero_point, shape)
    if layout == "cpu_int4":
        return to_cpu_int4_layout(weight_packed, weight_scale, weight_zero_point, shape)
    prepared = {"weight_packed": weight_packed, "weight_scale": weight_scale}
    if weight_zero_point is not None:
        prepared["weight_zero_point"] = weight_zero_point
    return prepared


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


def prepared_layout(prepared: dict[str, torch.Tensor]) -> str:
    """Which layout a prepared dict holds: "triton", "cpu_q8", "cpu_int4", "cpu_int8" or "reference"."""
    for layout, key in (
        ("triton", "triton_qweight"),
        ("cpu_q8", "cpu_q8_weight"),
        ("cpu_int4", "cpu_int4_weight"),
        ("cpu_int8", "cpu_int8_weight"),
        ("reference", "weight_packed"),
    ):
        if key in prepared:
            return layout
    raise ValueError(f"not a prepared WNA16 weight (keys {sorted(prepared)}); build it with prepare_wna16")


KERNEL_NAMES = {
    "cpu_q8": "quantkit::wna16_cpu_q8dot",
    "cpu_int4": "aten._weight_int4pack_mm_for_cpu",
    "cpu_int8": "aten._weight_int8pack_mm",
    "triton": "quantkit::wna16_gemm (Triton)",
    "reference": "reference (dequantize + fp32 matmul)",
}


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
        w = prepared["cpu_q8_weight"]
        path = choose_cpu_kernel(x2.shape[0], in_features, w.shape[0], x2.dtype, "cpu_q8")
        y = path.apply(x2, w, prepared["cpu_q8_scale"], prepared.get("cpu_q8_zero"), bias)
    elif "cpu_int4_weight" in prepared and backend == "torch":
        y = torch.ops.quantkit.wna16_int4_cpu(
            x2, prepared["cpu_int4_weight"], prepared["cpu_int4_scales_zeros"],
            prepared.get("cpu_int4_weight_lo"), prepared.get("cpu_int4_scales_zeros_lo"), bias,
        )
    elif "cpu_int8_weight" in prepared and backend == "torch":
        y = torch.ops.quantkit.wna16_int8_cpu(
            x2, prepared["cpu_int8_weight"], prepared["cpu_int8_scale"], prepared.get("cpu_int8_zero_scale"), bias
        )
    elif "triton_qweight" in prepared and backend == "triton":
        register_ops()  # a no-op once prepare_wna16 has run it
        y = torch.ops.quantkit.wna16_gemm(
            x2, prepared["triton_qweight"], prepared["triton_scales"], prepared.get("triton_zeros"), bias, bits
        )
    elif "weight_packed" in prepared and backend in ("reference", "torch"):
        y = wna16_linear_reference(
            x2, prepared["weight_packed"], prepared["weight_scale"], prepared.get("weight_zero_point"),
            bits, in_features, bias,
        )
    else:
        layout = prepared_layout(prepared)  # raises for a dict that is no prepared weight
        raise ValueError(
            f"the weight was prepared in the {layout!r} layout, which backend {backend!r} does not read; "
            f"call prepare_wna16(..., backend={backend!r}) again"
        )
    if y.shape[-1] != out_features:
        raise ValueError(f"the prepared weight has {y.shape[-1]} outputs, out_features={out_features}")
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], out_features)
