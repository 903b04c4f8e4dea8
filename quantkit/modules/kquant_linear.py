"""KQuantLinear: a linear whose weight lies on llama.cpp's Q4_K grid, held as GGUF Q4_K blocks."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import gguf_blocks
from ..kquant import SUPER_BLOCK, KQuantWeight
from ..scheme import QuantScheme

GGUF_TYPE = "Q4_K"


class KQuantLinear(nn.Module):
    """y = x @ W.T + b with W on the Q4_K grid (quantkit.kquant), stored as the Q4_K blocks a GGUF file holds.

    Buffers: weight_blocks uint8 [N, K/256 * 144] (kernels/gguf_blocks.py's layout); bias [N] in the model
    dtype or None. forward dequantizes the blocks on each call (pure torch): quantkit scores these weights
    and writes them as GGUF, which llama.cpp runs with its own Q4_K kernels; compressed-tensors (and so
    quantkit.save and vLLM's WNA16 path) cannot hold their float group minimums.
    """

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, *, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        if scheme.grid != "q4_k":
            raise ValueError(f"KQuantLinear holds Q4_K-grid weights; got {scheme.describe()}")
        if in_features % SUPER_BLOCK:
            raise ValueError(f"Q4_K weights need in_features in whole super-blocks of {SUPER_BLOCK}, got {in_features}")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        row_bytes = in_features // SUPER_BLOCK * gguf_blocks.BLOCK_BYTES[GGUF_TYPE]
        self.register_buffer("weight_blocks", torch.empty(out_features, row_bytes, dtype=torch.uint8, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_kquant(cls, qweight: KQuantWeight, bias: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> "KQuantLinear":
        """Pack a KQuantWeight (u [N, K], d / dmin [N, K/256], sc / mn [N, K/32]) into a new layer on u's device."""
        n, k = qweight.shape
        layer = cls(k, n, qweight.scheme, bias=bias is not None, dtype=dtype, device=qweight.u.device)
        layer.weight_blocks.copy_(gguf_blocks.pack_q4_k(qweight.u, qweight.d, qweight.dmin, qweight.sc, qweight.mn))
        if bias is not None:
            layer.bias.data.copy_(bias.detach().to(dtype))
        return layer

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K], as ggml's dequantize_row_q4_K computes it."""
        return gguf_blocks.dequantize_blocks(self.weight_blocks, GGUF_TYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N]."""
        return nn.functional.linear(x, self.dequantized_weight().to(x.dtype),
                                    None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.describe()}, "
                f"bias={self.bias is not None}")


def quantized_linear(qweight, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    """The layer an algorithm's result becomes: a KQuantLinear for a KQuantWeight, else a QuantLinear."""
    from .quant_linear import QuantLinear

    if isinstance(qweight, KQuantWeight):
        return KQuantLinear.from_kquant(qweight, bias, dtype=dtype)
    return QuantLinear.from_quantized(qweight, bias, dtype=dtype)
