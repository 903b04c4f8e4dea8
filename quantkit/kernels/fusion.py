"""Fusing linears that read the same input (q/k/v, gate/up) into one WNA16 linear, concatenated along N.

One call over the concatenated weight replaces several (fewer launches, fewer Python-level ops per
layer, one larger N for the kernel to spread over cores or SMs). The fused weight is built in the
on-disk layout and then prepared like any other, so every backend supports it:

    packed, scale, zero = concat_wna16_weights([(q.weight_packed, q.weight_scale, q.weight_zero_point), ...],
                                               bits=4, in_features=K)
    prepared = prepare_wna16(packed, scale, zero, bits=4, in_features=K, backend=backend)
    y = wna16_linear(x, prepared, ..., out_features=sum(sizes))
    yq, yk, yv = y.split(sizes, dim=-1)

All parts must share bits, in_features and the group size; symmetric and asymmetric parts may mix (a
symmetric part gets zero point 0, which is exact).
"""

from __future__ import annotations

import torch

from .packing import pack_zero_point, unpack_zero_point
from .wna16_layout import check_wna16_weight


def concat_wna16_weights(
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    *,
    bits: int,
    in_features: int,
    group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """On-disk tensors of the linear whose output is the parts' outputs concatenated (along N).

    parts: (weight_packed int32 [N_i, ceil(K*bits/32)], weight_scale [N_i, G], weight_zero_point int32
    [ceil(N_i*bits/32), G] or None) per linear, same K, G and scale dtype; group_size as prepare_wna16's
    (needed for a ragged last group; the fused weight is then prepared with the same group_size).
    returns: (weight_packed [sum N_i, ...], weight_scale [sum N_i, G], weight_zero_point packed along the
    fused N, or None when every part is symmetric).
    """
    if not parts:
        raise ValueError("concat_wna16_weights needs at least one part")
    shapes = [check_wna16_weight(p, s, z, bits, in_features, group_size) for p, s, z in parts]
    groups = {shape.groups for shape in shapes}
    dtypes = {s.dtype for _, s, _ in parts}
    if len(groups) != 1 or len(dtypes) != 1:
        raise ValueError(
            f"fused parts must share the group size and scale dtype; got groups {sorted(groups)}, dtypes {dtypes}"
        )
    packed = torch.cat([p for p, _, _ in parts], dim=0)  # [sum N_i, W]
    scale = torch.cat([s for _, s, _ in parts], dim=0)  # [sum N_i, G]
    if all(z is None for _, _, z in parts):
        return packed, scale, None
    zero_points = [
        unpack_zero_point(z, bits, shape.out_features) if z is not None
        else torch.zeros(shape.out_features, shape.groups, dtype=torch.int32, device=p.device)
        for (p, _, z), shape in zip(parts, shapes)
    ]  # [N_i, G] each
    zp = torch.cat(zero_points, dim=0)  # [sum N_i, G]
    return packed, scale, pack_zero_point(zp, bits)
