"""The grouped weight-only MoE layer: each token through the gated MLPs of the experts it was routed to.

Two entry points, one computation (``wna16_moe_reference.wna16_moe_reference`` is the ground truth):

- ``wna16_moe(x, top_k_index, top_k_weights, experts, act_fn)``: the runtime path quantkit's
  QuantExperts calls. ``experts`` holds, per expert, its three projections already prepared for their
  backend (``MoEExpertWeights``, built once at load from QuantLinear-like layers); the call visits only
  the experts that received a token and runs each projection through ``wna16_linear`` (the CPU int4 /
  int8 kernels, Triton on CUDA, or the reference), gathering that expert's tokens and scattering its
  weighted output back.
- ``torch.ops.quantkit.wna16_moe_ref(x, top_k_index, top_k_weights, <stacked on-disk tensors>...)``: the
  reference as an op with a fake implementation (torch.compile / export see its shape), for engines
  that hold the experts stacked [E, ...] in the on-disk layout.

A fused GPU kernel over the routed experts (one Triton launch for all experts) is not written: on
CUDA each routed expert's projection runs as its own ``wna16_gemm``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .wna16 import wna16_linear
from .wna16_moe_reference import StackedWNA16, wna16_moe_reference


@dataclass(frozen=True)
class PreparedProjection:
    """One projection ready for ``wna16_linear``: its prepared dict, bits, K, N and backend."""

    prepared: dict
    bits: int
    in_features: int
    out_features: int
    backend: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return wna16_linear(x, self.prepared, bits=self.bits, in_features=self.in_features,
                            out_features=self.out_features, backend=self.backend)


@dataclass(frozen=True)
class MoEExpertWeights:
    """An expert's gate, up and down projections (gate/up: H -> I, down: I -> H), prepared once."""

    gate: PreparedProjection
    up: PreparedProjection
    down: PreparedProjection

    @classmethod
    def from_layers(cls, gate, up, down) -> "MoEExpertWeights":
        """From three prepared layers that expose ``kernel_inputs()`` -> (prepared dict, bits, K, N, backend)
        (quantkit.modules.QuantLinear); the dicts are shared, not copied."""
        return cls(*(PreparedProjection(*layer.kernel_inputs()) for layer in (gate, up, down)))


def wna16_moe(
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    experts: Sequence[MoEExpertWeights], act_fn: Callable[[torch.Tensor], torch.Tensor] = torch.nn.functional.silu,
) -> torch.Tensor:
    """x [T, H], top_k_index int [T, k] (entries outside [0, E) are skipped), top_k_weights [T, k] ->
    [T, H] in x's dtype: sum_k w[t, k] * down(act(gate(x_t)) * up(x_t)) of expert top_k_index[t, k]."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    flat = top_k_index.reshape(-1)
    hit = torch.unique(flat).tolist()  # one host sync per layer call: the experts that got a token
    num_experts, k = len(experts), top_k_index.shape[1]
    for e in hit:
        if not 0 <= e < num_experts:
            continue
        where = (flat == e).nonzero().squeeze(1)
        tokens, slots = where // k, where % k
        ex = experts[e]
        h = x[tokens]
        y = ex.down(act_fn(ex.gate(h)) * ex.up(h))
        out.index_add_(0, tokens, (y * top_k_weights[tokens, slots, None]).to(out.dtype))
    return out


_LIB = torch.library.Library("quantkit", "FRAGMENT")
_LIB.define(
    "wna16_moe_ref(Tensor x, Tensor top_k_index, Tensor top_k_weights, "
    "Tensor gate_packed, Tensor gate_scale, Tensor? gate_zero_point, "
    "Tensor up_packed, Tensor up_scale, Tensor? up_zero_point, "
    "Tensor down_packed, Tensor down_scale, Tensor? down_zero_point, int bits, int? group_size=None) -> Tensor"
)


def _stacked(x, gate, up, down, bits, group_size):
    h, i = x.shape[-1], gate[0].shape[1]
    return (StackedWNA16(*gate, bits, h, group_size), StackedWNA16(*up, bits, h, group_size),
            StackedWNA16(*down, bits, i, group_size))


@torch.library.impl(_LIB, "wna16_moe_ref", "CompositeExplicitAutograd")
def _wna16_moe_ref(x, top_k_index, top_k_weights, gate_packed, gate_scale, gate_zero_point, up_packed, up_scale,
                   up_zero_point, down_packed, down_scale, down_zero_point, bits, group_size=None):
    g, u, d = _stacked(x, (gate_packed, gate_scale, gate_zero_point), (up_packed, up_scale, up_zero_point),
                       (down_packed, down_scale, down_zero_point), bits, group_size)
    return wna16_moe_reference(x, top_k_index, top_k_weights, g, u, d)


@torch.library.register_fake("quantkit::wna16_moe_ref", lib=_LIB)
def _wna16_moe_ref_fake(x, top_k_index, top_k_weights, gate_packed, gate_scale, gate_zero_point, up_packed, up_scale,
                        up_zero_point, down_packed, down_scale, down_zero_point, bits, group_size=None):
    torch._check(x.dim() == 2, lambda: f"quantkit::wna16_moe_ref: x must be [T, H], got {tuple(x.shape)}")
    torch._check(top_k_index.shape == top_k_weights.shape, lambda: "top_k_index and top_k_weights differ in shape")
    return x.new_empty(x.shape)
