"""QuantLinear: a weight-only quantized linear layer holding the compressed-tensors tensors."""

from __future__ import annotations

import torch
from torch import nn

from quantkit import kernels

from ..kernels.packing import pack_int32, pack_zero_point, packed_words
from ..core.quantized_weight import QuantizedWeight
from ..core.scheme import QuantScheme
from .quantized_layer import COMPRESSED_TENSORS, QuantizedLayer

CHECKPOINT_TENSORS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


class QuantLinear(QuantizedLayer):
    """y = x @ dequant(W).T + b with W stored packed (compressed-tensors "pack-quantized").

    Persistent buffers (exactly what a checkpoint stores for this layer):
      weight_packed int32 [N, ceil(K*bits/32)], weight_scale [N, G] (model dtype, G = ceil(K / group_size)),
      weight_shape int64 [2] = (N, K), weight_zero_point int32 [ceil(N*bits/32), G] (asymmetric only).
    `prepare(backend)` repacks them once for a kernel backend (quantkit.kernels); the kernel's tensors
    are non-persistent buffers, so `.to(device)` moves them and checkpoints never see them.
    """

    FORMAT = COMPRESSED_TENSORS
    PACKED_WEIGHT = "weight_packed"  # the tensor that holds the weight itself (what a weight census counts)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: QuantScheme,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if scheme.type != "int":
            raise ValueError("QuantLinear holds int weights; got a float scheme")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        groups = scheme.groups_for(in_features)
        bits = scheme.num_bits
        words = packed_words(in_features, bits)
        self.register_buffer("weight_packed", torch.empty(out_features, words, dtype=torch.int32, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int64, device=device))
        if not scheme.symmetric:
            zp_rows = packed_words(out_features, bits)
            self.register_buffer("weight_zero_point", torch.empty(zp_rows, groups, dtype=torch.int32, device=device))
        else:
            self.weight_zero_point = None
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.backend = "reference"
        self._kernel_keys: dict[str, str] = {}  # prepared-dict key -> attribute name
        self.checkpoint_tensors_released = False

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_weight(
        cls, qweight: QuantizedWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> "QuantLinear":
        """Pack a QuantizedWeight (q [N, K], scale/zero_point [N, G]) into a new layer on q's device."""
        n, k = qweight.q.shape
        layer = cls(k, n, qweight.scheme, bias=bias is not None, dtype=dtype, device=qweight.q.device)
        bits = qweight.scheme.num_bits
        layer.weight_packed.copy_(pack_int32(qweight.q, bits))
        layer.weight_scale.copy_(qweight.scale.to(dtype))
        if qweight.zero_point is not None:
            layer.weight_zero_point.copy_(pack_zero_point(qweight.zero_point, bits))
        if bias is not None:
            layer.bias.data.copy_(bias.detach().to(dtype))
        layer.prepare("reference")
        return layer

    # -- kernels ------------------------------------------------------------------------------------
    def prepare(self, backend: str = "auto", *, release_checkpoint_tensors: bool = False) -> str:
        """Repack the weight for `backend` ("auto" | "triton" | "torch" | "reference"); returns the
        concrete backend. With release_checkpoint_tensors, the on-disk tensors are freed when the
        kernel does not read them (halves memory; the layer can then no longer be saved)."""
        if self.checkpoint_tensors_released:
            raise RuntimeError("this layer released its checkpoint tensors and cannot be repacked; load it again")
        for attr in self._kernel_keys.values():
            if attr.startswith("kernel_"):
                delattr(self, attr)
        concrete = kernels.resolve_backend(backend, self.weight_packed.device, self.weight_scale.dtype)
        prepared = kernels.prepare_wna16(
            self.weight_packed, self.weight_scale, self.weight_zero_point,
            bits=self.scheme.num_bits, in_features=self.in_features, backend=concrete, group_size=self.group_size,
        )
        canonical = {id(getattr(self, n)): n for n in CHECKPOINT_TENSORS if getattr(self, n) is not None}
        self._kernel_keys = {}
        for key, tensor in prepared.items():
            if id(tensor) in canonical:  # the kernel reads the checkpoint tensor itself: no copy
                self._kernel_keys[key] = canonical[id(tensor)]
            else:
                self.register_buffer(f"kernel_{key}", tensor, persistent=False)
                self._kernel_keys[key] = f"kernel_{key}"
        self.backend = concrete
        if release_checkpoint_tensors:
            used = set(self._kernel_keys.values())
            for name in ("weight_packed", "weight_scale", "weight_zero_point"):
                if name not in used and getattr(self, name) is not None:
                    setattr(self, name, None)
                    self.checkpoint_tensors_released = True
        return concrete

    def prepared_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of the prepared layout the kernel reads (``kernel_layout``), by their layout keys."""
        return {key: getattr(self, attr) for key, attr in self._kernel_keys.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N]."""
        prepared = self.prepared_tensors()
        return kernels.wna16_linear(
            x, prepared, bits=self.scheme.num_bits, in_features=self.in_features,
            out_features=self.out_features, backend=self.backend, bias=self.bias,
        )

    def forward_rows(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Outputs start..stop-1 only: x [..., K] -> [..., stop - start], from row views of the prepared
        tensors (layouts whose tensors all run along N first, e.g. "cpu_q8", "cpu_int8")."""
        prepared = {key: getattr(self, attr)[start:stop] for key, attr in self._kernel_keys.items()}
        return kernels.wna16_linear(
            x, prepared, bits=self.scheme.num_bits, in_features=self.in_features, out_features=stop - start,
            backend=self.backend, bias=None if self.bias is None else self.bias[start:stop],
        )

    @property
    def kernel_layout(self) -> str:
        """The prepared layout forward runs: "cpu_q8", "cpu_int4", "cpu_int8", "triton" or "reference"."""
        return kernels.prepared_layout({key: None for key in self._kernel_keys})

    def kernel_inputs(self) -> tuple[dict, int, int, int, str]:
        """(prepared tensors, bits, in_features, out_features, backend): what wna16_linear reads (the
        grouped MoE op holds these per expert; bias-free layers only)."""
        if self.bias is not None:
            raise ValueError("kernel_inputs: a layer with a bias is not an expert projection")
        return self.prepared_tensors(), self.scheme.num_bits, self.in_features, self.out_features, self.backend

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K] from the checkpoint tensors (the reference dequantization)."""
        if self.checkpoint_tensors_released:
            raise RuntimeError("this layer released its checkpoint tensors; load it again to dequantize")
        return kernels.dequantize_wna16(
            self.weight_packed, self.weight_scale.float(), self.weight_zero_point, self.scheme.num_bits, self.in_features,
            self.group_size,
        )

    def stored_bits(self, scale_dtype: torch.dtype | None = None) -> int:
        """Bits the weight takes stored: packed weight, scales and zero points (floating tensors counted in
        scale_dtype when given, e.g. the dtype a checkpoint will write them in)."""
        bits = 0
        for t in (self.weight_packed, self.weight_scale, self.weight_zero_point):
            if t is not None:
                size = scale_dtype.itemsize if scale_dtype is not None and t.is_floating_point() else t.element_size()
                bits += t.numel() * size * 8
        return bits

    @property
    def group_size(self) -> int | None:
        """Inputs per scale group (None per channel); the last group is shorter when it does not divide K."""
        return self.scheme.group_size if self.scheme.strategy == "group" else None

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"scheme={self.scheme.describe()}, bias={self.bias is not None}, backend={self.backend}"
        )
