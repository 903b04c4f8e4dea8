"""Checkpoint tensors checked against the model that config.json describes: names (missing and
unexpected), dtypes, shapes, the values of `weight_shape`, and scales that must be positive normal
numbers. An edited config or tensor must be an error naming the tensor, not a model that loads and
computes something else (or a traceback from inside a kernel).

``check_checkpoint_tensors`` runs them all; `quantkit.load` and `quantkit inspect` call it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from ..core.errors import CheckpointError
from ..modules.kv_scales import SCALE_NAMES, attention_modules
from ..modules.moe import from_disk_name, model_type
from ..modules.quant_linear import CHECKPOINT_TENSORS
from ..modules.quantized_layer import COMPRESSED_TENSORS, holds_format
from .safetensors_io import FLOAT_DTYPES, TORCH_DTYPES, TensorHeader

#: tensors whose values are scales: finite, positive, normal numbers of the dtype they are stored in
SCALE_TENSORS = ("weight_scale", *SCALE_NAMES)
#: safetensors dtypes weight_shape may be stored in (compressed-tensors writes I64)
INTEGER_DTYPES = ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8")


def check_checkpoint_tensors(
    folder: Path | str, model: nn.Module, tensors: Mapping[str, TensorHeader], values: Mapping[str, torch.Tensor],
    *, kv_cache: bool,
) -> None:
    """Raise CheckpointError unless a checkpoint's tensors are exactly what `model` (built from its
    config.json on the meta device, quantized linears as QuantLinear) needs.

    tensors: {name: TensorHeader} of every tensor in the files; values: at least every `weight_shape`
    and scale tensor, as stored; kv_cache: whether config.json has a kv_cache_scheme (then each
    attention module's k_scale / v_scale are expected, else they are unexpected). Names are read as
    checkpoints write them (MoE blocks under their on-disk names: quantkit.modules.moe.to_disk_name).
    """
    mtype = model_type(model)
    tensors = {from_disk_name(k, mtype): v for k, v in tensors.items()}
    values = {from_disk_name(k, mtype): v for k, v in values.items()}
    missing, unexpected = name_mismatches(model, tensors, kv_cache)
    if missing or unexpected:
        raise CheckpointError(_describe_names(folder, model, missing, unexpected))
    problems = dtype_mismatches(model, tensors)
    if problems:
        raise CheckpointError(f"{folder}: tensors stored in the wrong dtype ({_listed(problems)}); the checkpoint was "
                              f"edited or written by another tool: re-create it")
    raise_on_mismatch(folder, shape_mismatches(model, {k: t.shape for k, t in tensors.items()},
                                               weight_shape_values(values)))
    problems = scale_problems(values)
    if problems:
        raise CheckpointError(f"{folder}: scales must be positive normal numbers ({_listed(problems)}); such a scale "
                              f"zeroes, flips or blows up its weights: the checkpoint is corrupt, re-create it")


def expected_names(model: nn.Module, kv_cache: bool) -> tuple[set[str], set[str]]:
    """(required, optional) tensor names: every state-dict entry of `model` is required except tied
    aliases (stored once, under the name they share), which are optional; with `kv_cache`, each attention
    module's k_scale / v_scale are required too."""
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    required = set(model.state_dict(keep_vars=True)) - tied
    if kv_cache:
        required |= {f"{name}.{scale}" for name, _ in attention_modules(model).values() for scale in SCALE_NAMES}
    return required, tied


def name_mismatches(model: nn.Module, names: Iterable[str], kv_cache: bool) -> tuple[list[str], list[str]]:
    """(missing, unexpected) tensor names of a checkpoint, sorted (see expected_names)."""
    required, optional = expected_names(model, kv_cache)
    names = set(names)
    return sorted(required - names), sorted(names - required - optional)


def _describe_names(folder, model: nn.Module, missing: list[str], unexpected: list[str]) -> str:
    modules = dict(model.named_modules())
    split = [name.rpartition(".") for name in unexpected]
    untargeted = sorted({module for module, _, tensor in split
                         if tensor in CHECKPOINT_TENSORS and type(modules.get(module)) is nn.Linear})
    if untargeted:
        return (f"{folder}: config.json's quantization_config does not quantize {_listed(untargeted, sep=', ')}, but the "
                f"checkpoint stores quantized tensors for them: its config_groups (targets) or ignore list were "
                f"edited; restore the config.json written with the checkpoint, or re-create the checkpoint")
    parts = [f"missing: {_listed(missing)}"] if missing else []
    parts += [f"unexpected: {_listed(unexpected)}"] if unexpected else []
    return (f"{folder}: the tensors do not match the model config.json describes ({'; '.join(parts)}); the "
            f"checkpoint is incomplete or its config.json was edited: restore its files or re-create it")


def dtype_mismatches(model: nn.Module, tensors: Mapping[str, TensorHeader]) -> list[str]:
    """Descriptions of tensors stored in a dtype the model cannot use: floating tensors (scales, embeddings,
    norms, biases, float linears) must be F16, BF16, F32 or F64, weight_shape an integer, and other integer
    tensors (packed weights, zero points: int32) the dtype the model holds them in. Names the model does
    not have are left to name_mismatches."""
    expected = {name: t.dtype for name, t in model.state_dict(keep_vars=True).items()}
    problems = []
    for name, header in sorted(tensors.items()):
        want = expected.get(name, torch.float32 if name.rpartition(".")[2] in SCALE_NAMES else None)
        if want is None:
            continue
        if name.endswith(".weight_shape"):
            allowed, what = INTEGER_DTYPES, "an integer dtype"
        elif want.is_floating_point:
            allowed, what = tuple(FLOAT_DTYPES), "F16, BF16, F32 or F64"
        else:
            allowed = (next(k for k, v in TORCH_DTYPES.items() if v == want),)
            what = f"{allowed[0]} ({str(want).removeprefix('torch.')})"
        if header.dtype not in allowed:
            problems.append(f"{name} is {header.dtype}, expected {what}")
    return problems


def scale_problems(values: Mapping[str, torch.Tensor]) -> list[str]:
    """Descriptions of scale tensors (weight_scale, k_scale, v_scale) holding a value that is not a finite
    number at least the smallest normal number of the dtype it is stored in: zero, negative, denormal,
    NaN or Inf. values: {name: tensor as stored}."""
    problems = []
    for name, tensor in sorted(values.items()):
        if name.rpartition(".")[2] not in SCALE_TENSORS or not tensor.is_floating_point():
            continue
        bad = ~(torch.isfinite(tensor) & (tensor >= torch.finfo(tensor.dtype).tiny))
        if bad.any():
            first = tensor[bad][0].item()
            problems.append(f"{name}: {int(bad.sum())} of {tensor.numel()} values, e.g. {first:.3g}")
    return problems


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
    for name, shape in sorted(shapes.items()):
        want = expected.get(name)
        if want is not None and tuple(shape) != want:
            problems.append(f"{name}: expected shape {list(want)}, found {list(shape)}")
    for name, module in model.named_modules():
        if holds_format(module, COMPRESSED_TENSORS):  # its weight_shape values
            key = f"{name}.weight_shape"
            values = weight_shapes.get(key)
            want = [module.out_features, module.in_features]
            if values is not None and list(values) != want:
                problems.append(f"{key}: expected [out, in] = {want} from config.json, found {list(values)}")
    return problems


def raise_on_mismatch(folder: Path | str, problems: list[str], limit: int = 5) -> None:
    if problems:
        raise CheckpointError(
            f"{folder}: tensors do not match the model config.json describes ({_listed(problems, limit)}); the "
            f"checkpoint was edited or written for another configuration: re-create it"
        )


def weight_shape_values(state: Mapping[str, torch.Tensor]) -> dict[str, list[int]]:
    """{"<linear>.weight_shape": [out, in]} of a state dict."""
    return {k: [int(v) for v in t.reshape(-1).tolist()] for k, t in state.items() if k.endswith(".weight_shape")}


def _listed(items: list[str], limit: int = 5, sep: str = "; ") -> str:
    return sep.join(items[:limit]) + (f"{sep}and {len(items) - limit} more" if len(items) > limit else "")
