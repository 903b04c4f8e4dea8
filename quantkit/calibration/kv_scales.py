"""Calibrated FP8 KV-cache scales: absmax of the cached keys (after RoPE) and values / 448.

The model runs on calibration batches with an observing `transformers` cache: every attention
layer hands its keys and values to ``cache.update`` exactly as it would store them (keys after
RoPE and any key norm), and the observing layers record their absolute maximum instead of storing
them. No model family is special-cased: whatever a model caches is what gets measured.

    scales = calibrate_kv_scales(model, batches)      # {layer: (k_scale, v_scale)}, fp32
    attach_kv_scales(model, scales)                   # buffers model.layers.N.self_attn.k_scale / v_scale

The buffers are what compressed-tensors and vLLM read: ``model.layers.N.self_attn.k_scale``,
shape [1], model dtype (or [num_kv_heads] with ``per_head=True``), with the cache storing
fp8_e4m3(k / k_scale).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers.cache_utils import Cache, DynamicLayer

from ..errors import QuantizationError
from ..primitives import fp8_scale

#: layer index -> (k_scale, v_scale); fp32 tensors of shape [1] (per tensor) or [num_kv_heads].
KVScales = dict[int, tuple[torch.Tensor, torch.Tensor]]

SCALE_NAMES = ("k_scale", "v_scale")


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


class AbsmaxObserverLayer(DynamicLayer):
    """A cache layer that records the absolute maximum of the keys and values it is given.

    Nothing is stored: each calibration batch is a fresh prefill, so `update` returns its inputs
    and the sequence length stays 0. absmax: fp32 [1] (per tensor) or [Hkv] (per KV head).
    """

    def __init__(self, layer_name: str, per_head: bool = False):
        super().__init__()
        self.layer_name = layer_name
        self.per_head = per_head
        self.k_absmax: torch.Tensor | None = None
        self.v_absmax: torch.Tensor | None = None
        self.batch_index = 0

    def _absmax(self, states: torch.Tensor, what: str) -> torch.Tensor:
        # states: [B, Hkv, T, D]
        if not torch.isfinite(states).all():
            bad = int((~torch.isfinite(states)).sum())
            raise QuantizationError(
                f"{self.layer_name}: {bad} NaN/Inf value(s) in the {what} on calibration batch {self.batch_index}; "
                "FP8 KV scales cannot be calibrated on them: check the model weights and the calibration "
                "token ids (e.g. fp16 overflow: run calibration in bfloat16 or float32)"
            )
        states = states.detach().abs()
        if self.per_head:
            return states.amax(dim=(0, 2, 3)).float()  # [Hkv]
        return states.amax().float().reshape(1)  # [1]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._absmax(key_states, "keys (after RoPE)")
        v = self._absmax(value_states, "values")
        self.k_absmax = k if self.k_absmax is None else torch.maximum(self.k_absmax, k)
        self.v_absmax = v if self.v_absmax is None else torch.maximum(self.v_absmax, v)
        return key_states, value_states


def _input_ids(batch: Any, index: int) -> torch.Tensor:
    """A calibration batch -> int64 token ids [B, T]: a [B, T] or [T] tensor, or a mapping with input_ids."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).all()):
            raise QuantizationError(
                f"calibration batch {index} is padded (attention_mask has zeros); pad tokens would enter the "
                "KV scales: pass unpadded [B, T] token ids (e.g. fixed-length windows of text)"
            )
        if "input_ids" not in batch:
            raise QuantizationError(f"calibration batch {index} is a mapping without 'input_ids'")
        batch = batch["input_ids"]
    if not isinstance(batch, torch.Tensor):
        batch = torch.as_tensor(batch)
    if batch.dim() == 1:
        batch = batch.unsqueeze(0)
    if batch.dim() != 2 or batch.dtype.is_floating_point or batch.numel() == 0:
        raise QuantizationError(
            f"calibration batch {index} must be integer token ids [B, T] (or [T]), got {batch.dtype} "
            f"{tuple(batch.shape)}"
        )
    return batch.long()


@torch.no_grad()
def calibrate_kv_scales(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    per_head: bool = False,
    progress: bool = False,
) -> KVScales:
    """Per-layer FP8 e4m3 KV scales = absmax over the calibration data / 448.

    model: a transformers causal LM. batches: token ids [B, T] (or [T], or mappings with
    "input_ids"), unpadded. per_head: one scale per KV head ([Hkv]) instead of per tensor ([1]).
    Returns {layer index: (k_scale, v_scale)} as fp32 tensors on the CPU. Keys are observed as they
    enter the cache, i.e. after RoPE. Raises QuantizationError naming the layer on NaN/Inf.
    """
    modules = attention_modules(model)
    n_layers = num_cache_layers(model)
    layers = [AbsmaxObserverLayer(modules[i][0] if i in modules else f"layer {i}", per_head) for i in range(n_layers)]
    cache_kw = cache_keyword(model)
    extra: dict[str, Any] = {}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        extra["logits_to_keep"] = 1  # the logits are not needed: skip most of the lm_head work
    device = next(model.parameters()).device
    seen = 0
    was_training = model.training
    model.eval()  # no dropout while measuring
    try:
        for index, batch in enumerate(tqdm(batches, desc="calibrate KV scales", unit="batch", disable=not progress)):
            input_ids = _input_ids(batch, index).to(device)
            for layer in layers:
                layer.batch_index = index
            # A fresh observing cache per batch: no state is carried between batches.
            model(input_ids=input_ids, use_cache=True, **{cache_kw: Cache(layers=layers)}, **extra)
            seen += 1
    finally:
        model.train(was_training)
    if seen == 0:
        raise QuantizationError("no calibration batches were given: FP8 KV scales need data to calibrate on")
    scales: KVScales = {}
    for i in modules:
        layer = layers[i]
        if layer.k_absmax is None:
            raise QuantizationError(
                f"{layer.layer_name} never wrote to the cache during calibration; it cannot get KV scales"
            )
        scales[i] = (fp8_scale(layer.k_absmax).cpu(), fp8_scale(layer.v_absmax).cpu())
    return scales


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype the model computes in (the dtype KV scales are stored in)."""
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def attach_kv_scales(model: nn.Module, scales: KVScales, *, dtype: torch.dtype | None = None) -> None:
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
        for buffer_name, scale in zip(SCALE_NAMES, scales[i]):
            scale = torch.as_tensor(scale).detach().float().reshape(-1)
            if not torch.isfinite(scale).all() or (scale <= 0).any():
                raise QuantizationError(f"{name}.{buffer_name} = {scale.tolist()}: scales must be finite and > 0")
            value = scale.clamp(min=torch.finfo(dtype).tiny).to(device=device, dtype=dtype)
            module.register_buffer(buffer_name, value, persistent=True)


def read_kv_scales(model: nn.Module) -> tuple[KVScales, list[str]]:
    """The ``k_scale`` / ``v_scale`` buffers of the model's attention modules, as fp32.

    Returns ({layer index: (k_scale, v_scale)} for the layers that have both, qualified names of
    the attention modules that lack them).
    """
    scales: KVScales = {}
    missing: list[str] = []
    for i, (name, module) in attention_modules(model).items():
        k, v = (getattr(module, n, None) for n in SCALE_NAMES)
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


def quantize_kv_cache(
    model: nn.Module, batches: Iterable[torch.Tensor], *, per_head: bool = False, progress: bool = False
) -> KVScales:
    """Calibrate FP8 KV scales on `batches` and attach them to the model (both steps above)."""
    scales = calibrate_kv_scales(model, batches, per_head=per_head, progress=progress)
    attach_kv_scales(model, scales)
    return scales
