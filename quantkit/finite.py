"""NaN/Inf checks on named tensors: a model or checkpoint with them gives wrong answers that look right."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def nonfinite_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, int]]:
    """(name, number of NaN/Inf values) of every floating tensor that has any, in the order given.

    Integer tensors (packed weights) cannot hold NaN and meta tensors (offloaded) have no values:
    both are skipped.
    """
    found = []
    for name, tensor in named:
        if tensor is None or not tensor.is_floating_point() or tensor.is_meta:
            continue
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            found.append((name, bad))
    return found


def describe_nonfinite(found: list[tuple[str, int]], limit: int = 3) -> str:
    """'a.weight (2 NaN/Inf values), b.weight_scale (1 NaN/Inf value)[, and N more tensors]'."""
    parts = [f"{name} ({n} NaN/Inf value{'s' if n != 1 else ''})" for name, n in found[:limit]]
    more = f", and {len(found) - limit} more tensor(s)" if len(found) > limit else ""
    return ", ".join(parts) + more
