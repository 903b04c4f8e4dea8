"""Which backend runs a model's weight-only linears, and which kernel path runs each call, on any device.

The kernel paths (``kernel_path.KernelPath``: name, layout, ``can_run``, ``apply``, ``reference``): the
Triton kernel (``TritonGemm``) and the reference (``Reference``) here, the CPU paths in
``cpu_kernel_choice``. ``choose_kernel`` picks the path of any layout; ``paths_by_rows`` says which path
each number of rows takes.

The backends, one class each (name; why weights on a device cannot run on it: ``refuses_device``; why
"auto" passes it over: ``auto_skips``; whether q/k/v and gate/up run fused: ``fuses_projections``), in
the order "auto" tries them (``BACKEND_ORDER``):

- "triton": the Triton kernels, on CUDA tensors, or CPU ones under Triton's interpreter. "auto" picks it
  on CUDA.
- "torch": the CPU paths (``cpu_kernel_choice``), CPU tensors only. "auto" picks it on the CPU for a bf16
  or fp32 model (or an unknown dtype): they compute in bf16 (README.md: fp32 models gain the speed at
  bf16 precision; an fp16 one would lose 3 mantissa bits). Fuses q/k/v and gate/up: each call's fixed
  cost (dispatch, threads, reading x) weighs on a decode step's many small products.
- "reference": dequantize and matmul in fp32 on any device; what "auto" picks everywhere else.

``resolve_backend`` turns "auto" into one of them and checks an explicit choice; ``benchmark_backend``
is the backend a speed benchmark prepares for. Which layout a layer gets on a backend is
``wna16.planned_layout``.
"""

from __future__ import annotations

import torch

from . import cpu_kernel_choice
from .kernel_path import KernelPath
from .reference import dequantize_wna16, wna16_gemm_torch, wna16_linear_reference
from .triton_ops import register_ops, triton_can_run_on
from .wna16_layout import ACTIVATION_DTYPES, check_triton_operands, to_triton_layout


class TritonGemm(KernelPath):
    """``quantkit::wna16_gemm`` on the "triton" layout. Operands: qweight int32 [KW, N], scales [G, N],
    zeros uint8 [G, N] or None, bias [N] or None, bits (2, 4 or 8); x fp16/bf16/fp32 [M, K], any M."""

    name = "quantkit::wna16_gemm (Triton)"
    layout = "triton"
    keys = ("triton_qweight", "triton_scales", "triton_zeros")

    @staticmethod
    def prepare(weight_packed, weight_scale, weight_zero_point, shape):
        register_ops()  # at load time, before the first call (and before any torch.compile or CUDA graph)
        prepared = to_triton_layout(weight_packed, weight_scale, weight_zero_point, shape)
        probe = weight_scale.new_empty((0, shape.in_features))
        check_triton_operands(probe, *TritonGemm.operands(prepared), None, shape.bits)
        return prepared

    def can_run(self, m, k, n, dtype, layout):
        if (reason := super().can_run(m, k, n, dtype, layout)) is not None:
            return reason
        return None if dtype in ACTIVATION_DTYPES else f"x is {dtype}, not one of {ACTIVATION_DTYPES}"

    def apply(self, x, qweight, scales, zeros, bias, bits):
        register_ops()  # a no-op once prepare_wna16 has run it
        return torch.ops.quantkit.wna16_gemm(x, qweight, scales, zeros, bias, bits)

    def reference(self, x, qweight, scales, zeros, bias, bits):
        return wna16_gemm_torch(x, qweight, scales, zeros, bias, bits)


class Reference(KernelPath):
    """Dequantize in fp32 and matmul in fp32 on the on-disk tensors ("reference" layout). Operands:
    weight_packed int32 [N, ceil(K*bits/32)], weight_scale [N, G], weight_zero_point int32
    [ceil(N*bits/32), G] or None, bits, bias [N] or None; x [M, K] in any float dtype, on any device."""

    name = "reference (dequantize + fp32 matmul)"
    layout = "reference"
    keys = ("weight_packed", "weight_scale", "weight_zero_point")

    @staticmethod
    def prepare(weight_packed, weight_scale, weight_zero_point, shape):
        """The on-disk tensors themselves, not copies."""
        prepared = {"weight_packed": weight_packed, "weight_scale": weight_scale}
        if weight_zero_point is not None:
            prepared["weight_zero_point"] = weight_zero_point
        return prepared

    def apply(self, x, weight_packed, weight_scale, weight_zero_point, bits, bias):
        return wna16_linear_reference(x, weight_packed, weight_scale, weight_zero_point, bits, x.shape[1], bias)

    def reference(self, x, weight_packed, weight_scale, weight_zero_point, bits, bias):
        w = dequantize_wna16(weight_packed, weight_scale.double(), weight_zero_point, bits, x.shape[1])
        y = x.double() @ w.t()
        return (y if bias is None else y + bias.double()).to(x.dtype)


TRITON_GEMM = TritonGemm()
REFERENCE = Reference()


def choose_kernel(m: int, k: int, n: int, dtype: torch.dtype, layout: str) -> KernelPath:
    """The path that runs x [m, k] (``dtype``) by a weight [n, k] prepared in ``layout`` (any of them)."""
    for path in (TRITON_GEMM, REFERENCE):
        if path.can_run(m, k, n, dtype, layout) is None:
            return path
    return cpu_kernel_choice.choose(m, k, n, dtype, layout)


def paths_by_rows(k: int, n: int, dtype: torch.dtype, layout: str) -> list[tuple[int, KernelPath]]:
    """(first row count, path) for each run of row counts that ``choose_kernel`` gives one path, from one
    row on: every row rule is a threshold of ``cpu_kernel_choice.DEQUANT_MIN_ROWS``, so the choices at one
    row and at each threshold are the choices at every count."""
    runs: list[tuple[int, KernelPath]] = []
    for m in sorted({1, *cpu_kernel_choice.DEQUANT_MIN_ROWS.values()}):
        path = choose_kernel(m, k, n, dtype, layout)
        if not runs or runs[-1][1] is not path:
            runs.append((m, path))
    return runs


class Backend:
    """One backend: what a model's linears are prepared for and run on."""

    name = ""
    fuses_projections = False

    def refuses_device(self, device: torch.device) -> str | None:
        """Why weights on ``device`` cannot run on this backend, or None."""
        return None

    def auto_skips(self, device: torch.device, dtype: torch.dtype | None) -> str | None:
        """Why "auto" does not pick this backend for a model of ``dtype`` (None: unknown) on ``device``, or None."""
        return None


class TritonBackend(Backend):
    name = "triton"

    def refuses_device(self, device):
        if triton_can_run_on(device):
            return None
        return (f"backend 'triton' needs the weights on a CUDA device (got {device}); on CPU use 'torch' or "
                "'reference' (or set TRITON_INTERPRET=1 before importing quantkit to run the kernels interpreted)")

    def auto_skips(self, device, dtype):
        return None if device.type == "cuda" else f"{device} is not a CUDA device"


class CpuBackend(Backend):
    name = "torch"
    fuses_projections = True
    #: model dtypes "auto" runs on the CPU paths (None: unknown); fp16 keeps the reference's precision
    AUTO_DTYPES = (torch.bfloat16, torch.float32, None)

    def refuses_device(self, device):
        return None if device.type == "cpu" else (
            f"backend 'torch' runs PyTorch's CPU kernels and needs CPU weights, got {device}")

    def auto_skips(self, device, dtype):
        if device.type != "cpu":
            return f"{device} is not the CPU"
        if dtype not in self.AUTO_DTYPES:
            return f"a {dtype} model keeps the reference's precision (the CPU kernels compute in bf16)"
        return None


class ReferenceBackend(Backend):
    name = "reference"


#: the concrete backends, in the order "auto" tries them (the first it does not skip)
BACKEND_ORDER = (TritonBackend(), CpuBackend(), ReferenceBackend())
BACKENDS = ("auto", *(b.name for b in BACKEND_ORDER))
_BY_NAME = {b.name: b for b in BACKEND_ORDER}


def resolve_backend(backend: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """Map "auto" to a concrete backend for weights living on ``device`` (a model of ``dtype``, None:
    unknown); check explicit choices (ValueError with the backend's reason)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    device = torch.device(device)
    if backend == "auto":
        return next(b.name for b in BACKEND_ORDER if b.auto_skips(device, dtype) is None)
    reason = _BY_NAME[backend].refuses_device(device)
    if reason is not None:
        raise ValueError(reason)
    return backend


def benchmark_backend(backend: str, device: torch.device | str) -> str:
    """The backend a speed benchmark prepares its variants for: "auto" on the CPU is "torch" whatever the
    model dtype (an fp16 model's too, which ``resolve_backend``'s "auto" keeps on the exact but slow reference:
    a benchmark times the CPU kernels, which take its activations in bf16); any other choice as given."""
    return "torch" if backend == "auto" and torch.device(device).type == "cpu" else backend


def fuses_projections(backend: str) -> bool:
    """Whether the linears of a concrete ``backend`` run q/k/v and gate/up as one fused linear each
    (``quantkit.modules.fused_linear``) by default."""
    return backend in _BY_NAME and _BY_NAME[backend].fuses_projections
