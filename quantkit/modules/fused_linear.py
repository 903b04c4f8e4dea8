"""Fused projections: q/k/v and gate/up QuantLinears that read the same input run as one linear each.

A decode step of a small model is many small GEMVs, each paying a fixed cost (dispatch, threads,
reading x); fusing the three attention input projections and the two MLP input projections
(``quantkit.kernels.fusion.concat_wna16_weights``: one weight concatenated along N, prepared like any
other) makes 2 kernel calls of 7 per layer out of 5.

The model's code is not changed: each original projection becomes a ``FusedPart`` that asks its
``FusedLinearGroup`` for its slice of the fused output. The group computes the fused product on the
first call with a new input and serves the siblings' calls with the *same* tensor (identity and
version checked) from it; once every part has taken its slice the group drops it. Any other call
pattern is still correct (a part called with another input recomputes). Under ``torch.compile`` no
Python state is traced: each part runs the kernel on its own rows of the fused layout (views, for the
layouts whose tensors run along N: ``ROW_SLICEABLE``), which costs what the unfused layers did; other
layouts compute the fused product per part and slice it (the compiler does not merge the calls).

A fused model's state dict no longer matches the checkpoint: ``quantkit.save`` writes the parts'
tensors back from the fused ones (``unfused_state_dict``), so a fused model saves the checkpoint it
was loaded from.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.fusion import concat_wna16_weights
from ..kernels.packing import pack_zero_point, unpack_zero_point
from .quant_linear import QuantLinear
from .quantized_layer import is_quantized_layer

# Prepared layouts whose tensors all run along N first, so a part's rows are a contiguous slice of them.
ROW_SLICEABLE = ("cpu_q8", "cpu_int8")
# (parts, name of the fused group on the parent): projections that read one input in HF decoder layers.
FUSIBLE = ((("q_proj", "k_proj", "v_proj"), "qkv_proj_fused"), (("gate_proj", "up_proj"), "gate_up_proj_fused"))


class FusedLinearGroup(nn.Module):
    """One QuantLinear over parts concatenated along N; hands each part its slice."""

    def __init__(self, fused: QuantLinear, sizes: list[int], names: list[str] | None = None,
                 biased: list[bool] | None = None) -> None:
        super().__init__()
        self.fused, self.sizes = fused, list(sizes)
        self.names = list(names or [str(i) for i in range(len(sizes))])  # the parts' attribute names
        self.biased = list(biased or [fused.bias is not None] * len(sizes))  # which parts had a bias
        self._x: torch.Tensor | None = None
        self._version = -1
        self._parts: list[torch.Tensor | None] = []

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """x [..., K] -> part ``index``'s output [..., sizes[index]] (a view of the fused output)."""
        if torch.compiler.is_compiling():  # no Python state in a traced graph
            start = sum(self.sizes[:index])
            if self.fused.kernel_layout in ROW_SLICEABLE:  # the part's rows of the fused layout: one call per part
                return self.fused.forward_rows(x, start, start + self.sizes[index])
            return self.fused(x).split(self.sizes, dim=-1)[index]
        version = None if x.is_inference() else x._version  # inference tensors keep no version counter
        if self._x is not x or self._version != version or self._parts[index] is None:
            self._parts = list(self.fused(x).split(self.sizes, dim=-1))
            self._x, self._version = x, version
        y = self._parts[index]
        self._parts[index] = None
        if all(p is None for p in self._parts):  # every sibling served: hold no tensors between steps
            self._x, self._parts = None, []
        return y

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"


class FusedPart(nn.Module):
    """Stands where one projection was; its output is its slice of the group's fused output."""

    def __init__(self, group: FusedLinearGroup, index: int, in_features: int, out_features: int) -> None:
        super().__init__()
        object.__setattr__(self, "_group", group)  # not a submodule: the parent holds the group once
        self.index, self.in_features, self.out_features = index, in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._group.part(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part={self.index} of a fused group"


def _fused_linear(parts: list[QuantLinear]) -> QuantLinear | None:
    """One QuantLinear equal to ``parts`` side by side along N, or None when they cannot be fused."""
    first = parts[0]
    if any(p.scheme != first.scheme or p.in_features != first.in_features or p.checkpoint_tensors_released
           or p.weight_scale.dtype != first.weight_scale.dtype or p.weight_packed.device != first.weight_packed.device
           for p in parts):
        return None
    packed, scale, zero = concat_wna16_weights(
        [(p.weight_packed, p.weight_scale, p.weight_zero_point) for p in parts],
        bits=first.scheme.num_bits, in_features=first.in_features, group_size=first.group_size,
    )
    has_bias = any(p.bias is not None for p in parts)
    fused = QuantLinear(first.in_features, packed.shape[0], first.scheme, bias=has_bias,
                        dtype=first.weight_scale.dtype, device=packed.device)
    fused.weight_packed, fused.weight_scale = packed, scale
    if zero is not None:
        fused.weight_zero_point = zero
    if has_bias:
        fused.bias.data.copy_(torch.cat([
            p.bias.detach() if p.bias is not None else torch.zeros(p.out_features, dtype=fused.bias.dtype,
                                                                   device=packed.device)
            for p in parts]))
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Fuse every q/k/v and gate/up group of QuantLinears in ``model`` (same scheme and input size),
    prepared for the backend the parts were prepared for; returns the number of groups fused."""
    count = 0
    # Modules that run their children's kernels themselves (QuantExperts: the grouped MoE op holds each
    # expert's prepared tensors) declare fuse_children = False; nothing under them is fused.
    held = [name + "." for name, m in model.named_modules() if getattr(m, "fuse_children", True) is False]
    for name, parent in list(model.named_modules()):
        if any((name + ".").startswith(prefix) for prefix in held):
            continue
        for names, group_name in FUSIBLE:
            parts = [getattr(parent, n, None) for n in names]
            if not all(isinstance(p, QuantLinear) for p in parts):
                continue
            fused = _fused_linear(parts)
            if fused is None:
                continue
            fused.prepare(parts[0].backend)
            group = FusedLinearGroup(fused, [p.out_features for p in parts], list(names),
                                     [p.bias is not None for p in parts])
            parent.add_module(group_name, group)
            for i, (name, p) in enumerate(zip(names, parts)):
                setattr(parent, name, FusedPart(group, i, p.in_features, p.out_features))
            count += 1
    return count


def checkpoint_linear_count(model: nn.Module) -> int:
    """The number of quantized linears as the checkpoint has them: each part of a fused group counted, the
    group's fused layer not."""
    fused = {id(m.fused) for m in model.modules() if isinstance(m, FusedLinearGroup)}
    return sum(isinstance(m, FusedPart) or (is_quantized_layer(m) and id(m) not in fused) for m in model.modules())


def is_fused(model: nn.Module) -> bool:
    return any(isinstance(m, FusedLinearGroup) for m in model.modules())


def unfused_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the model's state dict) with every fused group's tensors split back into the parts'
    checkpoint tensors (``<parent>.q_proj.weight_packed`` ...), as the checkpoint the model was loaded
    from had them: weights and scales by rows, zero points unpacked, split and packed again."""
    out = dict(state)
    for name, group in model.named_modules():
        if not isinstance(group, FusedLinearGroup):
            continue
        parent = name.rsplit(".", 1)[0] + "." if "." in name else ""
        fused, bits = group.fused, group.fused.scheme.num_bits
        for key in list(out):
            if key.startswith(f"{name}.fused."):
                del out[key]
        zero = None
        if fused.weight_zero_point is not None:
            zero = unpack_zero_point(fused.weight_zero_point, bits, fused.out_features)  # [N, G]
        start = 0
        for part, size, biased in zip(group.names, group.sizes, group.biased):
            rows = slice(start, start + size)
            prefix = f"{parent}{part}."
            out[prefix + "weight_packed"] = fused.weight_packed[rows].clone()
            out[prefix + "weight_scale"] = fused.weight_scale[rows].clone()
            out[prefix + "weight_shape"] = torch.tensor([size, fused.in_features], dtype=torch.int64)
            if zero is not None:
                out[prefix + "weight_zero_point"] = pack_zero_point(zero[rows].contiguous(), bits)
            if biased:
                out[prefix + "bias"] = fused.bias.detach()[rows].clone()
            start += size
    return out
