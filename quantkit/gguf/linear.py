"""GgufLinear: a linear whose weight lies on a GGUF grid (gguf.types.GRID_TYPES: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q4_1,
Q5_1, Q4_0, Q5_0, Q8_0, IQ4_NL, IQ4_XS), held as the GGUF blocks themselves."""

from __future__ import annotations

import torch
from torch import nn

from ..core.scheme import QuantScheme
from ..modules.quantized_layer import GGUF, QuantizedLayer
from .grids import GRID_WEIGHTS, GridWeight
from .types import GRID_TYPES


class GgufLinear(QuantizedLayer):
    """y = x @ W.T + b with W on a GGUF grid (quantkit.gguf.grids), stored as the blocks a GGUF file holds.

    Buffers: weight_blocks uint8 [N, K / block * block bytes] (quantkit/gguf/blocks.py's layout of
    `gguf_type`: e.g. Q4_K 144 bytes per 256 inputs, Q4_1 20 per 32); bias [N] in the model dtype or None.
    forward dequantizes the blocks on each call (pure torch): quantkit scores these weights and writes
    them as GGUF, which llama.cpp runs with its own kernels; compressed-tensors (and so quantkit.save and
    vLLM's WNA16 path) cannot hold their float group minimums.
    """

    FORMAT = GGUF
    PACKED_WEIGHT = "weight_blocks"  # the tensor that holds the weight itself (what a weight census counts)

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, *, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        if scheme.grid not in GRID_TYPES:
            raise ValueError(f"GgufLinear holds GGUF-grid weights; got {scheme.describe()}")
        ggml = GRID_TYPES[scheme.grid]
        self.gguf_type = ggml.name
        if in_features % ggml.block:
            raise ValueError(f"{self.gguf_type} weights need in_features in whole blocks of {ggml.block}, got "
                             f"{in_features}")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        row_bytes = in_features // ggml.block * ggml.block_bytes
        self.register_buffer("weight_blocks", torch.empty(out_features, row_bytes, dtype=torch.uint8, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_weight(cls, qweight: GridWeight, bias: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> "GgufLinear":
        """Pack a grids.GridWeight (levels [N, K] and its fields) into a new layer on its device."""
        n, k = qweight.shape
        layer = cls(k, n, qweight.scheme, bias=bias is not None, dtype=dtype, device=qweight.u.device)
        layer.weight_blocks.copy_(qweight.blocks())
        if bias is not None:
            layer.bias.data.copy_(bias.detach().to(dtype))
        return layer

    def grid_weight(self) -> GridWeight:
        """The weight its blocks hold (levels and fields, quantkit.gguf.grids)."""
        return GRID_WEIGHTS[self.scheme.grid].from_blocks(self.weight_blocks, self.scheme)

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K], as ggml's dequantize_row_* computes it."""
        return self.grid_weight().dequantize()

    def stored_bits(self, scale_dtype: torch.dtype | None = None) -> int:
        """Bits the weight takes stored: its blocks (their fp16 / 6-bit fields whatever scale_dtype)."""
        return self.weight_blocks.numel() * 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N]."""
        return nn.functional.linear(x, self.dequantized_weight().to(x.dtype),
                                    None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.describe()}, "
                f"bias={self.bias is not None}")
