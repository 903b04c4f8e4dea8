"""Calibrated FP8 KV-cache scales: absmax of the cached keys (after RoPE) and values / 448.

The model runs on calibration batches with an observing `transformers` cache: every attention
layer hands its keys and values to ``cache.update`` exactly as it would store them (keys after
RoPE and any key norm), and the observing layers record their absolute maximum instead of storing
them. No model family is special-cased: whatever a model caches is what gets measured.

    scales = calibrate_kv_scales(model, batches)      # {layer: (k_scale, v_scale)}, fp32
    plain, rotated = calibrate_kv_scales(model, batches, rotation="hadamard")  # also of k H and v H
    attach_kv_scales(model, scales)                   # quantkit.modules.kv_scales: the checkpoint buffers

The scale buffers, their names and shapes: quantkit.modules.kv_scales.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers.cache_utils import Cache, DynamicLayer

from ..core.errors import QuantizationError
from ..modules.kv_rotation import check_rotation, hadamard_matrix, rotate
from ..modules.kv_scales import (
    KVScales, attach_kv_scales, attach_rotated_kv_scales, attention_modules, cache_keyword, num_cache_layers,
)
from ..core.primitives import fp8_scale


class AbsmaxObserverLayer(DynamicLayer):
    """A cache layer that records the absolute maximum of the keys and values it is given.

    Nothing is stored: each calibration batch is a fresh prefill, so `update` returns its inputs
    and the sequence length stays 0. absmax: fp32 [1] (per tensor) or [Hkv] (per KV head).
    """

    def __init__(self, layer_name: str, per_head: bool = False, rotation: str = "none"):
        super().__init__()
        self.layer_name = layer_name
        self.per_head = per_head
        self.rotation = rotation
        self.k_absmax: torch.Tensor | None = None
        self.v_absmax: torch.Tensor | None = None
        self.k_absmax_rotated: torch.Tensor | None = None  # with a rotation: absmax of k H / v H
        self.v_absmax_rotated: torch.Tensor | None = None
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
        if self.rotation != "none":
            check_rotation(self.rotation, key_states.shape[-1])
            h = hadamard_matrix(key_states.shape[-1]).to(key_states.device)
            k = self._absmax(rotate(key_states, h), "rotated keys")
            v = self._absmax(rotate(value_states, h), "rotated values")
            self.k_absmax_rotated = k if self.k_absmax_rotated is None else torch.maximum(self.k_absmax_rotated, k)
            self.v_absmax_rotated = v if self.v_absmax_rotated is None else torch.maximum(self.v_absmax_rotated, v)
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


def check_kv_cache_model(model: nn.Module) -> None:
    """QuantizationError unless `model` is a decoder-only causal LM whose generate() caches keys and values
    (the FP8 KV cache is built by generate()): a base model (LlamaModel), a classifier
    (LlamaForSequenceClassification) or an encoder-decoder (Whisper) is named with the fix."""
    name = type(model).__name__
    can_generate = getattr(model, "can_generate", None)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        why = "an encoder-decoder model (its cross-attention cache is not calibrated)"
    elif not callable(can_generate) or not can_generate():
        why = "not a model that generates text (no generate(), so no KV cache to hold in FP8)"
    else:
        attention_modules(model)  # the cached attention layers are found, or named as missing
        return
    raise QuantizationError(f"{name} is {why}: an FP8 KV cache needs a decoder-only causal LM, e.g. "
                            f"AutoModelForCausalLM's (LlamaForCausalLM); use a weight-only recipe for this model")


@torch.no_grad()
def calibrate_kv_scales(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    per_head: bool = False,
    progress: bool = False,
    rotation: str = "none",
) -> KVScales | tuple[KVScales, KVScales]:
    """Per-layer FP8 e4m3 KV scales = absmax over the calibration data / 448.

    rotation "hadamard" (quantkit.modules.kv_rotation): returns (scales of the keys and values, scales
    of k H and v H), both measured in the one pass.

    model: a transformers causal LM. batches: token ids [B, T] (or [T], or mappings with
    "input_ids"), unpadded. per_head: one scale per KV head ([Hkv]) instead of per tensor ([1]).
    Returns {layer index: (k_scale, v_scale)} as fp32 tensors on the CPU. Keys are observed as they
    enter the cache, i.e. after RoPE. Raises QuantizationError naming the layer on NaN/Inf.
    """
    check_rotation(rotation)
    modules = attention_modules(model)
    n_layers = num_cache_layers(model)
    layers = [AbsmaxObserverLayer(modules[i][0] if i in modules else f"layer {i}", per_head, rotation)
              for i in range(n_layers)]
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
    if rotation == "none":
        return scales
    rotated = {i: (fp8_scale(layers[i].k_absmax_rotated).cpu(), fp8_scale(layers[i].v_absmax_rotated).cpu())
               for i in modules}
    return scales, rotated


def quantize_kv_cache(
    model: nn.Module, batches: Iterable[torch.Tensor], *, per_head: bool = False, progress: bool = False,
    rotation: str = "none",
) -> KVScales:
    """Calibrate FP8 KV scales on `batches` and attach them to the model (both steps above); with a
    rotation also the rotated-basis scales (attach_rotated_kv_scales). Returns the unrotated scales."""
    found = calibrate_kv_scales(model, batches, per_head=per_head, progress=progress, rotation=rotation)
    scales, rotated = (found, None) if rotation == "none" else found
    attach_kv_scales(model, scales)
    if rotated is not None:
        attach_rotated_kv_scales(model, rotated, rotation)
    return scales
