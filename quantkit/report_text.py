"""Plain-text summaries printed by the CLI."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .modules.quant_linear import QuantLinear


def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def state_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers as they are in memory (tied tensors once)."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.numel())
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def quantized_bits_per_weight(model: nn.Module) -> tuple[float, int]:
    """Stored bits per weight over the quantized linears (packed weights + scales + zero points), and their count."""
    bits = weights = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            for t in (m.weight_packed, m.weight_scale, m.weight_zero_point):
                if t is not None:
                    bits += t.numel() * t.element_size() * 8
            weights += m.in_features * m.out_features
    return (bits / weights if weights else float("nan")), weights


def dtype_name(model: nn.Module) -> str:
    return str(getattr(model, "dtype", "")).replace("torch.", "")


def quantization_summary(model, recipe, source, out: Path, size_before, size_after, seconds: float) -> str:
    bpw, n = quantized_bits_per_weight(model)
    layers = sum(isinstance(m, QuantLinear) for m in model.modules())
    ratio = f" ({size_before / size_after:.2f}x smaller)" if size_before and size_after else ""
    return "\n".join([
        f"quantized {source} with {recipe.name} ({recipe.weights.describe() if recipe.weights else 'no weights'}"
        f"{', kv ' + recipe.kv_cache.describe() if recipe.kv_cache else ''})",
        f"  layers quantized : {layers} ({n / 1e6:.2f}M weights, {bpw:.3f} bits/weight stored)",
        f"  size             : {human_bytes(size_before)} ({dtype_name(model)}) -> {human_bytes(size_after)} checkpoint{ratio}",
        f"  time             : {seconds:.1f} s",
        f"  checkpoint       : {out}",
    ])
