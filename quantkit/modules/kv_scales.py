"""FP8 KV-cache scales on a model: which attention layers a cache has, and the scale buffers they carry.

The buffers are what compressed-tensors and vLLM read: ``model.layers.N.self_attn.k_scale`` /
``v_scale``, shape [1], model dtype (or [num_kv_heads] per head), with the cache storing
fp8_e4m3(k / k_scale). This module reads, attaches and pops them (checkpoint load and save, the FP8
cache); quantkit.calibration.kv_scales measures them.

    attach_kv_scales(model, scales)                   # buffers model.layers.N.self_attn.k_scale / v_scale
    scales, missing = read_kv_scales(model)           # {layer: (k_scale, v_scale)}, fp32
    scales = pop_kv_scales(model, state_dict)         # before a strict load_state_dict
    attach_rotated_kv_scales(model, scales, "hadamard")  # k_scale_rotated / v_scale_rotated, not in state_dict
    kv_rotation_of(model)                             # "none" or "hadamard"

With a rotation of head_dim (quantkit.modules.kv_rotation) the cache stores fp8(x H / s) with scales of
the rotated keys and values. Those are held apart, as non-persistent buffers ``k_scale_rotated`` /
``v_scale_rotated`` (never in the state dict), so that ``k_scale`` / ``v_scale`` stay the scales of the
unrotated keys and values that an engine which does not rotate reads.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..core.errors import QuantizationError
from .kv_rotation import check_rotation

#: layer index -> (k_scale, v_scale); fp32 tensors of shape [1] (per tensor) or [num_kv_heads].
KVScales = dict[int, tuple[torch.Tensor, torch.Tensor]]

SCALE_NAMES = ("k_scale", "v_scale")
#: buffers of the rotated-basis scales (non-persistent: never written under the standard names)
ROTATED_SCALE_NAMES = ("k_scale_rotated", "v_scale_rotated")
#: attribute of the model naming its KV cache rotation (absent: "none")
ROTATION_ATTRIBUTE = "quantkit_kv_rotation"


def attention_modules(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """Layer index -> (qualified name, attention module) for every cached attention layer.

    Finds the modules named ``*.self_attn`` that carry a ``layer_idx`` (the index they pass to
    ``cache.update``): ``model.layers.N.self_attn`` in the Llama, Mistral, Qwen2 and Qwen3 families.
    """
    found: dict[int, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "self_attn" or not isinstance(getattr(module, "layer_idx", None), int):
            continue
        if module.layer_idx in found:
            raise QuantizationError(
                f"{name} and {found[module.layer_idx][0]} both use cache layer {module.layer_idx}: "
                "models that share KV caches between layers are not supported"
            )
        found[module.layer_idx] = (name, module)
    if not found:
        raise QuantizationError(
            f"no attention module named '*.self_attn' with a layer_idx was found in {type(model).__name__}; "
            "FP8 KV calibration supports decoder-only transformers models laid out as model.layers.N.self_attn "
            "(Llama, Mistral, Qwen2, Qwen3 families)"
        )
    return dict(sorted(found.items()))


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def num_cache_layers(model: nn.Module) -> int:
    """Number of layers a cache for this model holds (the decoder's num_hidden_layers)."""
    return int(_text_config(model).num_hidden_layers)


def cache_keyword(model: nn.Module) -> str:
    """The name `forward` takes the cache under: `cache` (transformers >= 5.24) or `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype the model computes in (the dtype KV scales are stored in)."""
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def attach_kv_scales(model: nn.Module, scales: KVScales, *, dtype: torch.dtype | None = None,
                     _names: tuple[str, str] = SCALE_NAMES, _persistent: bool = True) -> None:
    """Register the persistent buffers ``k_scale`` / ``v_scale`` on each layer's attention module.

    scales: {layer index: (k_scale, v_scale)}, each [1] or [num_kv_heads]; every attention layer
    must have an entry. Stored in `dtype` (default: the model dtype) on the module's device,
    clamped to that dtype's smallest normal number so that no scale rounds to 0.
    """
    modules = attention_modules(model)
    missing = sorted(set(modules) - set(scales))
    extra = sorted(set(scales) - set(modules))
    if missing or extra:
        raise QuantizationError(
            f"KV scales do not match the model's attention layers (missing layers {missing}, unknown layers "
            f"{extra}): calibrate them on this model"
        )
    dtype = dtype or model_dtype(model)
    for i, (name, module) in modules.items():
        device = next((t.device for t in module.parameters()), None) or next(model.parameters()).device
        for buffer_name, scale in zip(_names, scales[i]):
            scale = torch.as_tensor(scale).detach().float().reshape(-1)
            if not torch.isfinite(scale).all() or (scale <= 0).any():
                raise QuantizationError(f"{name}.{buffer_name} = {scale.tolist()}: scales must be finite and > 0")
            value = scale.clamp(min=torch.finfo(dtype).tiny).to(device=device, dtype=dtype)
            module.register_buffer(buffer_name, value, persistent=_persistent)


def attach_rotated_kv_scales(model: nn.Module, scales: KVScales, rotation: str, *,
                             dtype: torch.dtype | None = None) -> None:
    """Register the rotated-basis scales as non-persistent buffers ``k_scale_rotated`` / ``v_scale_rotated``
    (same shapes and checks as attach_kv_scales) and record `rotation` on the model (kv_rotation_of)."""
    if check_rotation(rotation) == "none":
        raise QuantizationError("rotated KV scales need a rotation: 'hadamard'")
    head_dim = getattr(next(iter(attention_modules(model).values()))[1], "head_dim", None)
    check_rotation(rotation, head_dim)
    attach_kv_scales(model, scales, dtype=dtype, _names=ROTATED_SCALE_NAMES, _persistent=False)
    setattr(model, ROTATION_ATTRIBUTE, rotation)


def kv_rotation_of(model: nn.Module) -> str:
    """The rotation of head_dim the model's FP8 KV cache applies: "none" or "hadamard"."""
    return getattr(model, ROTATION_ATTRIBUTE, "none")


def read_kv_scales(model: nn.Module, *, rotated: bool = False) -> tuple[KVScales, list[str]]:
    """The ``k_scale`` / ``v_scale`` buffers of the model's attention modules (rotated: the
    ``k_scale_rotated`` / ``v_scale_rotated`` ones), as fp32.

    Returns ({layer index: (k_scale, v_scale)} for the layers that have both, qualified names of
    the attention modules that lack them).
    """
    scales: KVScales = {}
    missing: list[str] = []
    for i, (name, module) in attention_modules(model).items():
        k, v = (getattr(module, n, None) for n in (ROTATED_SCALE_NAMES if rotated else SCALE_NAMES))
        if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
            scales[i] = (k.detach().float().reshape(-1), v.detach().float().reshape(-1))
        else:
            missing.append(name)
    return scales, missing


def pop_kv_scales(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> KVScales:
    """Remove the ``<attention>.k_scale`` / ``.v_scale`` entries of a checkpoint's state dict.

    For loaders that build the model from its config (which has no scale buffers) and then load
    the state dict strictly: pop the scales first, load, then ``attach_kv_scales(model, scales)``.
    Returns {layer index: (k_scale, v_scale)} as fp32 ([1] or [Hkv]); raises QuantizationError
    if only some attention layers have scales.
    """
    scales: KVScales = {}
    if not any(n.rsplit(".", 1)[-1] in SCALE_NAMES for n in state_dict):
        return scales  # no FP8 KV cache (an encoder has no cached attention to look for)
    partial: list[str] = []
    for i, (name, _) in attention_modules(model).items():
        k = state_dict.pop(f"{name}.k_scale", None)
        v = state_dict.pop(f"{name}.v_scale", None)
        if k is not None and v is not None:
            scales[i] = (k.detach().float().reshape(-1), v.detach().float().reshape(-1))
        elif k is not None or v is not None:
            partial.append(name)
    if partial or (scales and len(scales) != len(attention_modules(model))):
        raise QuantizationError(
            f"the checkpoint has FP8 KV scales for only some attention layers ({len(scales)} complete; incomplete: "
            f"{partial[:3]}): re-create it with calibrated scales for every layer"
        )
    return scales
