"""Pure-torch reference of the weight-only mixture-of-experts layer: dequantize each routed expert in
fp32, run its gated MLP in fp32.

Experts are stacked along a leading expert dimension in the on-disk compressed-tensors layout:
gate and up [E, I, ...] (W [I, H]), down [E, H, ...] (W [H, I]); see ``StackedWNA16``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import dequantize_wna16


@dataclass(frozen=True)
class StackedWNA16:
    """One projection of every expert, stacked: packed int32 [E, N, ceil(K*bits/32)], scale [E, N, G],
    zero_point int32 [E, ceil(N*bits/32), G] or None; bits, in_features K, group_size (None: K / G)."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    bits: int
    in_features: int
    group_size: int | None = None

    def dequantized(self, e: int) -> torch.Tensor:
        """fp32 [N, K] of expert e."""
        zp = None if self.zero_point is None else self.zero_point[e]
        return dequantize_wna16(self.packed[e], self.scale[e].float(), zp, self.bits, self.in_features,
                                self.group_size).float()


def wna16_moe_reference(
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    gate: StackedWNA16, up: StackedWNA16, down: StackedWNA16,
) -> torch.Tensor:
    """out[t] = sum_k top_k_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = top_k_index[t, k].

    x: [T, H] fp16/bf16/fp32; top_k_index: int [T, k] in [0, E) (entries >= E are skipped, as
    transformers' expert-parallel padding); top_k_weights: [T, k]. returns [T, H] in x's dtype, fp32 math.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in range(gate.packed.shape[0]):
        tokens, slots = (top_k_index == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = xf[tokens]
        a = torch.nn.functional.silu(h @ gate.dequantized(e).T) * (h @ up.dequantized(e).T)
        y = (a @ down.dequantized(e).T) * top_k_weights[tokens, slots, None].float()
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)
