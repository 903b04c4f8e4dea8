"""Plain-text summaries printed by the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.scheme import QuantScheme
from ..core.units import human_bytes
from ..gguf.types import GRID_TYPES, SUPER_BLOCK
from ..modules.quantized_layer import is_quantized_layer
from .weight_census import weight_census


def state_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers as they are in memory (tied tensors once)."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.numel())
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def quantized_bits_per_weight(model: nn.Module, scale_dtype: torch.dtype | None = None) -> tuple[float, int]:
    """Stored bits per weight over the quantized linears (packed weights + scales + zero points), and their count.

    scale_dtype: the dtype the scales are saved in (default: as held in memory).
    """
    bits = weights = 0
    for m in model.modules():
        if is_quantized_layer(m):
            bits += m.stored_bits(scale_dtype)
            weights += m.in_features * m.out_features
    return (bits / weights if weights else float("nan")), weights


def layer_kinds(names: list[str]) -> str:
    """'q_proj, k_proj, ...' : the distinct last components of module names, in first-seen order."""
    return ", ".join(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))


def refit_notes(schemes: dict[str, QuantScheme], in_features: dict[str, int], recipe) -> list[str]:
    """One line per (width, scheme) whose group the recipe's weight scheme does not divide: what those
    linears got under the recipe's `indivisible` rule. schemes / in_features: linear name -> its own."""
    by_fit: dict[tuple[int, QuantScheme], list[str]] = {}
    for name, scheme in schemes.items():
        if not recipe.weights.divides(in_features[name]):
            by_fit.setdefault((in_features[name], scheme), []).append(name)
    notes = []
    for (k, scheme), names in by_fit.items():
        if not scheme.divides(k):
            got = f"keep {scheme.describe()} with a ragged last group of {k % scheme.group_size} inputs"
        else:
            got = f"get {scheme.describe()}"
        spec = GRID_TYPES.get(recipe.weights.grid)  # a GGUF grid: its block (IQ4_XS's super-block of 256)
        unit = (f"{spec.name}'s {'super-block' if spec.block == SUPER_BLOCK else 'block'} of {spec.block}"
                if spec is not None else f"group_size {recipe.weights.group_size}")
        notes.append(f"{unit} does not divide in_features {k}: {len(names)} linears "
                     f"({layer_kinds(names)}) {got} (recipe indivisible: {recipe.indivisible})")
    return notes


def scheme_lines(model: nn.Module) -> list[str]:
    """'int4 g64 sym: 180 linears (q_proj, ...)' per weight scheme of the model's quantized linears."""
    by_scheme: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        if is_quantized_layer(m):
            ragged = " ragged" if not m.scheme.divides(m.in_features) else ""
            by_scheme.setdefault(m.scheme.describe() + ragged, []).append(name)
    return [f"{scheme}: {len(names)} linears ({layer_kinds(names)})" for scheme, names in by_scheme.items()]


def dtype_name(model_or_dtype: "nn.Module | torch.dtype") -> str:
    """'bfloat16' for torch.bfloat16 or for a model in bf16."""
    dtype = model_or_dtype if isinstance(model_or_dtype, torch.dtype) else getattr(model_or_dtype, "dtype", "")
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class SizeOnDisk:
    """A model's size for the quantize summary: bytes, the dtype of its floating tensors, and what was
    measured ("on disk": the safetensors files; "as loaded": tensors in memory, for hub models)."""

    bytes: int
    dtype: str
    measured: str


def quantization_summary(model, recipe, source, out: Path, before: SizeOnDisk, after: SizeOnDisk,
                         seconds: float, kind: str = "checkpoint", scale_dtype: torch.dtype | None = None,
                         embedding_is_head: bool = False) -> str:
    """kind: what was written, "checkpoint" or "GGUF file"; scale_dtype: the dtype its scales are stored
    in (default: after.dtype, a checkpoint's float dtype); embedding_is_head: the file's token embedding is
    the quantized output head (GGUF tie_output), so the float embedding is not counted."""
    census = weight_census(model).tied_to_head() if embedding_is_head else weight_census(model)
    bpw, n = quantized_bits_per_weight(model, scale_dtype or getattr(torch, after.dtype))
    layers = sum(is_quantized_layer(m) for m in model.modules())
    ratio = f", {before.bytes / after.bytes:.2f}x smaller" if before.bytes and after.bytes else ""
    quantized = (f"{layers} ({n / 1e6:.2f}M weights, {bpw:.3f} bits/weight stored)" if layers
                 else "none (weights kept as they are)")
    mix = f", in llama.cpp's {recipe.mix.upper()} mix" if recipe.mix else ""
    return "\n".join([
        f"quantized {source} with {recipe.name} ({recipe.weights.describe() if recipe.weights else 'no weights'}{mix}"
        f"{', kv ' + recipe.kv_cache.describe() if recipe.kv_cache else ''})",
        f"  layers quantized : {quantized}",
        *(f"    {line}" for line in scheme_lines(model)),
        *(f"  {'weights' if i == 0 else '':<17}: {line}" for i, line in enumerate(census.lines())),
        f"  size             : {human_bytes(before.bytes)} source ({before.dtype}, {before.measured}) -> "
        f"{human_bytes(after.bytes)} {kind} ({after.dtype}, {after.measured}){ratio}",
        f"  time             : {seconds:.1f} s",
        f"  {kind:<17}: {out}",
    ])
