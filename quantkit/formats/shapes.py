"""Checkpoint tensors checked against the model that config.json describes: shapes, and the values of
`weight_shape`. An edited config or tensor must be an error naming the tensor, not a model that
loads and computes something else."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError
from ..modules.quant_linear import QuantLinear


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{state-dict name: shape} of a model built from config.json (on the meta device is fine)."""
    return {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}


def shape_mismatches(
    model: nn.Module, shapes: Mapping[str, tuple[int, ...]], weight_shapes: Mapping[str, list[int]],
) -> list[str]:
    """Descriptions of every checkpoint tensor whose shape differs from what `model` expects.

    shapes: {name: shape} of the checkpoint's tensors; weight_shapes: {"<linear>.weight_shape": its
    values [out, in]}. Names the model does not have are left to the caller (missing/unexpected keys).
    """
    expected = expected_shapes(model)
    problems = []
    for name, shape in shapes.items():
        want = expected.get(name)
        if want is not None and tuple(shape) != want:
            problems.append(f"{name}: expected shape {list(want)}, found {list(shape)}")
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            key = f"{name}.weight_shape"
            values = weight_shapes.get(key)
            want = [module.out_features, module.in_features]
            if values is not None and list(values) != want:
                problems.append(f"{key}: expected [out, in] = {want} from config.json, found {list(values)}")
    return problems


def raise_on_mismatch(folder: Path | str, problems: list[str], limit: int = 5) -> None:
    if problems:
        shown = "; ".join(problems[:limit]) + (f"; and {len(problems) - limit} more" if len(problems) > limit else "")
        raise CheckpointError(
            f"{folder}: tensors do not match the model config.json describes ({shown}); the checkpoint was edited "
            f"or written for another configuration: re-create it"
        )


def weight_shape_values(state: Mapping[str, torch.Tensor]) -> dict[str, list[int]]:
    """{"<linear>.weight_shape": [out, in]} of a state dict."""
    return {k: [int(v) for v in t.reshape(-1).tolist()] for k, t in state.items() if k.endswith(".weight_shape")}
