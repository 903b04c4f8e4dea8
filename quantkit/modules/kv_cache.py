"""An FP8 KV cache for `transformers` generation: K and V stored as float8_e4m3fn with fixed scales.

Each attention layer's keys and values are stored as fp8_e4m3(x / scale) (saturated to +-448,
never NaN) in the cache layout [B, Hkv, T, D]: half the bytes of bf16. The scales are the
calibrated ``k_scale`` / ``v_scale`` buffers of the attention modules (read and attached by
quantkit.modules.kv_scales, measured by quantkit.calibration.kv_scales), per tensor ([1]) or per
KV head ([Hkv]).

Two ways for attention to read the cache:

- "dequantize": ``update`` returns the dequantized K/V (model dtype) to the model's own attention
  (eager / sdpa / ...). Works on every device; the attention sees exactly the values stored.
- "kernel": decode steps (one new token) hand the fp8 tensors to
  ``torch.ops.quantkit.decode_attention_fp8`` (Triton, dequantization in registers) through the
  attention implementation registered here as ``"quantkit_fp8"``; prefill still dequantizes.

Two caches, as in transformers: ``FP8KVCache`` grows with every step (like ``DynamicCache``);
``StaticFP8KVCache`` preallocates [B, Hkv, max_cache_len, D] fp8 per layer and writes each step in
place (like ``StaticCache``): no allocation per step, so a decode step captures in a CUDA graph
and compiles with ``torch.compile`` (which ``generate`` does by itself on CUDA for static caches).

    cache = fp8_cache_for(model)                 # from the model's k_scale / v_scale buffers
    out = model.generate(ids, cache=cache)       # explicit
    enable_fp8_kv_cache(model)                   # or: every generate() and forward call uses a fresh FP8 cache,
    model.generate(ids, cache_implementation="static")   # a static one where transformers would use StaticCache

With enable_fp8_kv_cache, a forward pass given no cache (a perplexity window, a prefill) also
runs with a fresh FP8 cache, so attention reads K/V quantized and dequantized exactly as the
cache stores them, as an engine with an FP8 cache does for prefill.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
from collections.abc import Mapping

import torch
from torch import nn
from transformers.cache_utils import (
    Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, StaticCache, StaticLayer, get_layer_types_and_kwargs,
)

from ..core.errors import QuantizationError
from ..core.primitives import dequantize_fp8, quantize_fp8
from ..kernels import decode_attention
from ..kernels.kv_cache_write import fp8_kv_cache_write, fp8_kv_cache_write_reference
from .kv_rotation import check_rotation, hadamard_matrix, rotate
from .kv_scales import KVScales, kv_rotation_of, num_cache_layers, read_kv_scales

FP8_DTYPE = torch.float8_e4m3fn
ATTENTION_MODES = ("auto", "dequantize", "kernel")
#: Name of the attention implementation that sends decode steps to the Triton kernel.
KERNEL_ATTENTION_NAME = "quantkit_fp8"
#: Attribute carrying the fp32 scale on the fp8 tensors handed to the "quantkit_fp8" attention.
SCALE_ATTRIBUTE = "quantkit_fp8_scale"
#: Attribute carrying the number of written positions (a device tensor) on a static cache's fp8 tensors.
LENGTH_ATTRIBUTE = "quantkit_fp8_length"


def _layer_types_and_kwargs(config) -> list[tuple[str, dict]]:
    """[(layer type, cache-layer kwargs)] per decoder layer, on transformers 5.17 (one kwargs dict
    shared by all layers) and 5.24 (a list of per-layer dicts) alike."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if isinstance(layer_kwargs, Mapping):
        layer_kwargs = [dict(layer_kwargs)] * len(layer_types)
    return list(zip(layer_types, layer_kwargs))


def _dequantize_table(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S] scales -> [S * 256] table: entry s * 256 + c = dtype(fp32(fp8 code c) * scale[s])."""
    codes = torch.arange(256, dtype=torch.uint8, device=scale.device).view(FP8_DTYPE).float()  # [256]
    return (codes[None, :] * scale.float().reshape(-1, 1)).to(dtype).reshape(-1)  # [S * 256]


def dequantize_fp8_by_table(q: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """fp8 codes [B, H, T, D] -> table values, table from _dequantize_table ([256] or [H * 256]).

    Gives exactly dequantize_fp8(q, scale, dtype) (one product rounded to dtype), about 5x faster on
    CPU, where torch converts float8 element by element.
    """
    index = q.view(torch.uint8).to(torch.int32)  # [B, H, T, D]
    if table.numel() > 256:  # per-head scales: head h reads entries [h * 256, (h + 1) * 256)
        offsets = torch.arange(q.shape[1], dtype=torch.int32, device=q.device) * 256
        index = index + offsets.view(1, -1, 1, 1)
    return table.index_select(0, index.reshape(-1)).view(q.shape)


def _as_scale(scale: torch.Tensor | float, what: str) -> torch.Tensor:
    scale = torch.as_tensor(scale, dtype=torch.float32).detach().reshape(-1)
    if scale.numel() == 0 or not torch.isfinite(scale).all() or (scale <= 0).any():
        raise ValueError(f"{what} must be finite and > 0, got {scale.tolist()}")
    return scale


class _FP8KVStorage:
    """Storage shared by the FP8 cache layers: fp8 codes in ``keys`` / ``values``, fixed scales.

    keys / values: float8_e4m3fn [B, Hkv, T, D]. k_scale / v_scale: fp32 [1] or [Hkv];
    stored = fp8_e4m3(clamp(x / scale, -448, 448)), read = stored * scale.
    return_fp8_on_decode: on a one-token update hand the fp8 tensors themselves to attention
    (with the scale attached as ``tensor.quantkit_fp8_scale``) for the "quantkit_fp8" attention;
    otherwise the dequantized tensors in the model dtype.
    """

    keys: torch.Tensor | None
    values: torch.Tensor | None

    def _init_fp8(self, k_scale, v_scale, return_fp8_on_decode: bool, rotation: str = "none") -> None:
        self.k_scale = _as_scale(k_scale, "k_scale")
        self.v_scale = _as_scale(v_scale, "v_scale")
        self.return_fp8_on_decode = return_fp8_on_decode
        self.rotation = check_rotation(rotation)
        if self.rotation != "none" and return_fp8_on_decode:
            raise QuantizationError("the rotated FP8 KV cache reads through the model's own attention only: use "
                                    "attention='dequantize' with rotation 'hadamard'")
        self.hadamard: torch.Tensor | None = None  # fp32 [D, D] once initialized, with a rotation
        self.dtype: torch.dtype | None = None

    def _scale_view(self, scale: torch.Tensor, num_heads: int) -> torch.Tensor:
        if scale.numel() not in (1, num_heads):
            raise ValueError(
                f"a per-head KV scale has {scale.numel()} entries but the layer caches {num_heads} KV heads"
            )
        return scale.to(self.device).reshape(1, -1, 1, 1)  # [1, 1|Hkv, 1, 1]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)  # device, is_initialized (and window tensor)
        self.dtype = key_states.dtype
        num_heads = key_states.shape[1]
        self._k_scale_b = self._scale_view(self.k_scale, num_heads)
        self._v_scale_b = self._scale_view(self.v_scale, num_heads)
        if self.rotation == "hadamard":
            check_rotation(self.rotation, key_states.shape[-1])
            if value_states.shape[-1] != key_states.shape[-1]:
                raise QuantizationError("the rotated FP8 KV cache needs keys and values of one head_dim")
            self.hadamard = hadamard_matrix(key_states.shape[-1]).to(self.device)
        if self.device.type == "cpu":
            self._k_table = _dequantize_table(self.k_scale, self.dtype)
            self._v_table = _dequantize_table(self.v_scale, self.dtype)
        self.keys = torch.tensor([], dtype=FP8_DTYPE, device=self.device)
        self.values = torch.tensor([], dtype=FP8_DTYPE, device=self.device)

    def _quantize(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Hkv, T, D] model dtype -> fp8 codes, saturated (never NaN for finite inputs); with the
        rotation the codes of x H (fp32), with scales of the rotated basis."""
        if self.hadamard is not None:
            key_states, value_states = rotate(key_states, self.hadamard), rotate(value_states, self.hadamard)
        return quantize_fp8(key_states, self._k_scale_b), quantize_fp8(value_states, self._v_scale_b)

    def _dequantize(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 codes [B, Hkv, T, D] -> model dtype (a lookup table on CPU, same values); with the rotation
        (code * scale) H^T in fp32, then rounded to the model dtype once."""
        if self.hadamard is not None:
            h_t = self.hadamard.T
            return (rotate(dequantize_fp8(keys, self._k_scale_b), h_t).to(self.dtype),
                    rotate(dequantize_fp8(values, self._v_scale_b), h_t).to(self.dtype))
        if self.device.type == "cpu":
            return dequantize_fp8_by_table(keys, self._k_table), dequantize_fp8_by_table(values, self._v_table)
        return dequantize_fp8(keys, self._k_scale_b, self.dtype), dequantize_fp8(values, self._v_scale_b, self.dtype)

    def _for_attention(self, keys: torch.Tensor, values: torch.Tensor, new_tokens: int):
        """fp8 [B, Hkv, T, D] codes -> what attention reads (see the class docstring)."""
        if self.return_fp8_on_decode and new_tokens == 1:
            setattr(keys, SCALE_ATTRIBUTE, self.k_scale.to(self.device))
            setattr(values, SCALE_ATTRIBUTE, self.v_scale.to(self.device))
            return keys, values
        return self._dequantize(keys, values)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values, dequantized to the model dtype: [B, Hkv, T, D] each."""
        return self._dequantize(self.keys, self.values)

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored keys and values."""
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class FP8KVLayer(_FP8KVStorage, DynamicLayer):
    """A full-attention layer's cache in float8_e4m3fn (see _FP8KVStorage for the contract)."""

    def __init__(self, k_scale: torch.Tensor | float, v_scale: torch.Tensor | float, *,
                 return_fp8_on_decode: bool = False, rotation: str = "none"):
        DynamicLayer.__init__(self)
        self._init_fp8(k_scale, v_scale, return_fp8_on_decode, rotation)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key/value states [B, Hkv, T_new, D]; return what attention reads over all T."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_keys, new_values = self._quantize(key_states, value_states)
        self.keys = torch.cat([self.keys, new_keys], dim=-2)
        self.values = torch.cat([self.values, new_values], dim=-2)
        return self._for_attention(self.keys, self.values, key_states.shape[-2])


class FP8SlidingWindowKVLayer(_FP8KVStorage, DynamicSlidingWindowLayer):
    """A sliding-window layer's cache in float8_e4m3fn: keeps the last `sliding_window - 1` tokens.

    Mirrors DynamicSlidingWindowLayer.update, with fp8 storage (see _FP8KVStorage).
    """

    def __init__(self, sliding_window: int, k_scale: torch.Tensor | float, v_scale: torch.Tensor | float, *,
                 return_fp8_on_decode: bool = False, rotation: str = "none"):
        DynamicSlidingWindowLayer.__init__(self, sliding_window)
        self._init_fp8(k_scale, v_scale, return_fp8_on_decode, rotation)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        new_keys, new_values = self._quantize(key_states, value_states)
        full_keys = torch.cat([self.keys, new_keys], dim=-2)  # [B, Hkv, cached + T_new, D]
        full_values = torch.cat([self.values, new_values], dim=-2)
        if not self.record_past:
            self.keys = full_keys[:, :, -self.sliding_window + 1 :, :]
            self.values = full_values[:, :, -self.sliding_window + 1 :, :]
        else:
            self.keys, self.values = full_keys, full_values
            num_visible = self.sliding_window - 1 + key_states.shape[-2]
            full_keys, full_values = full_keys[:, :, -num_visible:, :], full_values[:, :, -num_visible:, :]
        return self._for_attention(full_keys, full_values, key_states.shape[-2])


def _check_scales_cover(scales: Mapping[int, tuple], num_layers: int) -> None:
    missing = [i for i in range(num_layers) if i not in scales]
    if missing:
        raise ValueError(f"no KV scales for layers {missing}: give (k_scale, v_scale) for all {num_layers} layers")


class FP8KVCache(Cache):
    """A `transformers` Cache of FP8 layers, one per decoder layer (full or sliding-window attention).

    config: the model config (its decoder layer types decide full vs sliding-window layers).
    scales: {layer index: (k_scale, v_scale)} covering every layer, each a float or a tensor
    [1] / [Hkv]. attention: "dequantize" or "kernel" (see the module docstring). rotation: "none" or
    "hadamard" (quantkit.modules.kv_rotation: stored fp8(x H / s), read (code * s) H^T; the scales are
    then those of the rotated keys and values; "dequantize" attention only).
    """

    def __init__(self, config, scales: Mapping[int, tuple], *, attention: str = "dequantize",
                 rotation: str = "none"):
        if attention not in ("dequantize", "kernel"):
            raise ValueError(f"attention must be 'dequantize' or 'kernel', got {attention!r}")
        layer_types = _layer_types_and_kwargs(config)
        _check_scales_cover(scales, len(layer_types))
        fp8 = attention == "kernel"
        layers = []
        for i, (layer_type, kwargs) in enumerate(layer_types):
            if layer_type == "full_attention":
                layers.append(FP8KVLayer(*scales[i], return_fp8_on_decode=fp8, rotation=rotation))
            elif layer_type in ("sliding_attention", "chunked_attention"):
                layers.append(FP8SlidingWindowKVLayer(kwargs["sliding_window"], *scales[i], return_fp8_on_decode=fp8,
                                                      rotation=rotation))
            else:
                raise QuantizationError(
                    f"layer {i} is a {layer_type!r} layer: the FP8 KV cache supports full and sliding-window attention"
                )
        super().__init__(layers=layers)
        self.attention = attention
        self.rotation = rotation

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers' stored keys and values."""
        return sum(layer.nbytes for layer in self.layers)


class StaticFP8KVLayer(StaticLayer):
    """A full-attention layer's static cache in float8_e4m3fn: preallocated, written in place.

    keys / values: float8_e4m3fn [B, Hkv, max_cache_len, D], allocated at the first update (or by
    ``Cache.early_initialization``) and never reallocated; ``cumulative_length`` (int64 0-d tensor
    on the cache's device) counts the written positions. A step writes its K/V at positions
    cumulative_length ... with ``torch.ops.quantkit.fp8_kv_cache_write`` on CUDA (one fused Triton
    launch) and its pure-torch reference on CPU (the same codes), so nothing in a step depends on
    host values.

    Attention reads all max_cache_len positions, the unwritten ones masked, as with StaticCache
    (on CPU outside torch.compile only the written ones): "dequantize" returns them in the model
    dtype; with return_fp8_on_decode a one-token step returns the fp8 buffers themselves, which
    carry their scale (``quantkit_fp8_scale``) and the written length (``quantkit_fp8_length``, so
    the kernel skips the unwritten tail) as attributes set once at allocation.
    """

    def __init__(self, max_cache_len: int, k_scale: torch.Tensor | float, v_scale: torch.Tensor | float, *,
                 return_fp8_on_decode: bool = False):
        super().__init__(max_cache_len=max_cache_len)
        self.k_scale = _as_scale(k_scale, "k_scale")
        self.v_scale = _as_scale(v_scale, "v_scale")
        self.return_fp8_on_decode = return_fp8_on_decode
        self.dtype: torch.dtype | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, _, head_dim = key_states.shape
        if value_states.shape[-1] != head_dim:
            raise QuantizationError("the static FP8 KV cache needs keys and values of one head_dim")
        self.k_head_dim = self.v_head_dim = head_dim
        shape = (self.batch_size, self.num_heads, self.max_cache_len, head_dim)
        self.keys = torch.zeros(shape, dtype=FP8_DTYPE, device=self.device)
        self.values = torch.zeros(shape, dtype=FP8_DTYPE, device=self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        for name in ("k_scale", "v_scale"):
            scale = getattr(self, name)
            if scale.numel() not in (1, self.num_heads):
                raise ValueError(
                    f"a per-head KV scale has {scale.numel()} entries but the layer caches {self.num_heads} KV heads"
                )
            setattr(self, name, scale.to(self.device))  # fp32 [1] or [Hkv]
        if self.device.type == "cpu":
            self._k_table = _dequantize_table(self.k_scale, self.dtype)
            self._v_table = _dequantize_table(self.v_scale, self.dtype)
        for tensor, scale in ((self.keys, self.k_scale), (self.values, self.v_scale)):
            setattr(tensor, SCALE_ATTRIBUTE, scale)
            setattr(tensor, LENGTH_ATTRIBUTE, self.cumulative_length)
        if not torch.compiler.is_compiling():  # fixed addresses: CUDA graphs replay the in-place writes
            for tensor in (self.keys, self.values, self.cumulative_length, self.k_scale, self.v_scale):
                torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write key/value states [B, Hkv, T_new, D] at the next positions; return what attention reads."""
        prefix = self._reads_written_prefix()  # decided before a first update initializes the layer
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # CUDA: one fused launch; CPU: the same codes by torch ops, without the custom op's dispatch cost
        write = fp8_kv_cache_write if self.device.type == "cuda" else fp8_kv_cache_write_reference
        write(key_states.to(self.dtype), value_states.to(self.dtype), self.keys, self.values,
              self.k_scale, self.v_scale, self.cumulative_length)
        self.cumulative_length.add_(key_states.shape[-2])
        keys, values = self.keys, self.values
        if prefix:
            length = int(self.cumulative_length)
            keys, values = keys[:, :, :length], values[:, :, :length]  # [B, Hkv, length, D] views
            if self.return_fp8_on_decode:
                for tensor, scale in ((keys, self.k_scale), (values, self.v_scale)):
                    setattr(tensor, SCALE_ATTRIBUTE, scale)
        if self.return_fp8_on_decode and key_states.shape[-2] == 1:
            return keys, values
        return self._dequantize(keys, values)

    def _reads_written_prefix(self) -> bool:
        """Whether attention gets only the written positions rather than all max_cache_len.

        On CPU in eager mode (no graph to keep static) reading the written prefix costs what the
        growing cache costs and lets attention skip the mask; compiled code and CUDA (graph
        capture) get the whole buffer, masked. ``get_mask_sizes`` follows the same choice.
        """
        return self.is_initialized and self.device.type == "cpu" and not torch.compiler.is_compiling()

    @property
    def is_compileable(self) -> bool:
        """True (as for StaticLayer) except while attention reads the written prefix (CPU, eager):
        transformers then builds decode masks as for a growing cache, and SDPA may skip them."""
        return not self._reads_written_prefix()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self._reads_written_prefix():
            return int(self.cumulative_length) + query_length, 0
        return super().get_mask_sizes(query_length)

    def _dequantize(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 codes [B, Hkv, T, D] -> model dtype (a lookup table on CPU, same values)."""
        if self.device.type == "cpu":
            return dequantize_fp8_by_table(keys, self._k_table), dequantize_fp8_by_table(values, self._v_table)
        k_scale, v_scale = self.k_scale.reshape(1, -1, 1, 1), self.v_scale.reshape(1, -1, 1, 1)
        return dequantize_fp8(keys, k_scale, self.dtype), dequantize_fp8(values, v_scale, self.dtype)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All max_cache_len positions dequantized to the model dtype: [B, Hkv, max_cache_len, D] each."""
        return self._dequantize(self.keys, self.values)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove positions (a negative int, as StaticLayer.crop): in place."""
        if tokens_to_remove > 0:
            raise RuntimeError("static layers are cropped by a negative int: the number of positions to remove")
        self.cumulative_length.sub_(-tokens_to_remove)

    @property
    def nbytes(self) -> int:
        """Bytes held by the preallocated keys and values."""
        return 2 * self.keys.numel() if self.is_initialized else 0


class StaticFP8KVCache(Cache):
    """A `transformers` Cache of StaticFP8KVLayer, one per decoder layer (full attention only).

    config: the model config; max_cache_len: positions preallocated per layer; scales: {layer
    index: (k_scale, v_scale)} covering every layer, each a float or a tensor [1] / [Hkv];
    attention: "dequantize" or "kernel" (see the module docstring).
    """

    def __init__(self, config, max_cache_len: int, scales: Mapping[int, tuple], *, attention: str = "dequantize"):
        if attention not in ("dequantize", "kernel"):
            raise ValueError(f"attention must be 'dequantize' or 'kernel', got {attention!r}")
        if int(max_cache_len) < 1:
            raise ValueError(f"max_cache_len must be >= 1, got {max_cache_len}")
        layer_types = [layer_type for layer_type, _ in _layer_types_and_kwargs(config)]
        _check_scales_cover(scales, len(layer_types))
        layers = []
        for i, layer_type in enumerate(layer_types):
            if layer_type != "full_attention":
                raise QuantizationError(
                    f"layer {i} is a {layer_type!r} layer: the static FP8 KV cache supports full attention only; "
                    "use the growing FP8KVCache (cache_implementation=None) for sliding-window models"
                )
            layers.append(StaticFP8KVLayer(int(max_cache_len), *scales[i], return_fp8_on_decode=attention == "kernel"))
        super().__init__(layers=layers)
        self.attention = attention

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers' preallocated keys and values."""
        return sum(layer.nbytes for layer in self.layers)


def fp8_cache_for(model: nn.Module, *, attention: str = "dequantize", max_cache_len: int | None = None,
                  rotation: str | None = None) -> FP8KVCache | StaticFP8KVCache:
    """A fresh FP8 cache with the scales of the model's ``k_scale`` / ``v_scale`` buffers: a growing
    FP8KVCache, or a StaticFP8KVCache of ``max_cache_len`` positions when that is given.

    Attention modules without the buffers get scale 1.0, with a warning (values beyond +-448
    then saturate): calibrate them with quantkit.calibration.kv_scales.
    attention: "dequantize" (default) or "kernel" (needs enable_fp8_kv_cache(model, attention="kernel")
    so that the model's attention reads fp8 tensors).
    rotation: None (the model's own: quantkit.modules.kv_scales.kv_rotation_of), "none" or "hadamard";
    with "hadamard" the scales are the rotated-basis buffers (``k_scale_rotated`` / ``v_scale_rotated``),
    which every layer must have, and the cache is a growing one read in "dequantize" mode.
    """
    rotation = check_rotation(kv_rotation_of(model) if rotation is None else rotation)
    if rotation != "none":
        scales, missing = read_kv_scales(model, rotated=True)
        if missing or not scales:
            raise QuantizationError(
                f"a {rotation}-rotated FP8 KV cache needs scales of the rotated keys and values on every attention "
                f"layer ({len(missing)} lack them): calibrate them with quantkit.calibration.kv_scales."
                f"quantize_kv_cache(model, batches, rotation={rotation!r})")
        if max_cache_len is not None:
            raise QuantizationError("the static FP8 KV cache has no rotation: use the growing one "
                                    "(cache_implementation=None) with a rotated cache")
        return FP8KVCache(model.config, scales, attention=attention, rotation=rotation)
    scales, missing = read_kv_scales(model)
    if missing:
        warnings.warn(
            f"{len(missing)} attention module(s) have no k_scale/v_scale buffers ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): using scale 1.0 for them; calibrate the scales with "
            "quantkit.calibration.kv_scales.quantize_kv_cache(model, batches)",
            stacklevel=2,
        )
    all_scales: KVScales = dict(scales)
    for i in range(num_cache_layers(model)):
        all_scales.setdefault(i, (torch.ones(1), torch.ones(1)))
    if max_cache_len is not None:
        return StaticFP8KVCache(model.config, max_cache_len, all_scales, attention=attention)
    return FP8KVCache(model.config, all_scales, attention=attention)


def _fp8_decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The "quantkit_fp8" attention: fp8 decode steps through the Triton op, the rest through sdpa.

    query: [B, Hq, Tq, D]; key/value: [B, Hkv, T, D] (fp8 with a scale attribute on decode steps
    of an FP8KVCache in "kernel" mode); attention_mask: sdpa's bool mask [B, 1, Tq, T] or None.
    Returns ([B, Tq, Hq, D], None) as every transformers attention function does.
    """
    # import time: transformers loads only where it is used
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if key.dtype != FP8_DTYPE:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    k_scale = getattr(key, SCALE_ATTRIBUTE, None)
    v_scale = getattr(value, SCALE_ATTRIBUTE, None)
    if k_scale is None or v_scale is None:
        raise QuantizationError("fp8 keys/values reached attention without their scales: use an FP8KVCache")
    batch, _, q_len, head_dim = query.shape
    if q_len != 1 or kwargs.get("softcap") is not None:
        raise QuantizationError("the quantkit_fp8 attention reads fp8 caches for one-token decode steps only")
    # A sliding window needs nothing more: the cache returns only the window and the mask covers it.
    kv_mask = None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        if attention_mask.shape[1] != 1 or attention_mask.shape[2] != 1:
            raise QuantizationError(f"unexpected decode attention mask of shape {tuple(attention_mask.shape)}")
        kv_mask = attention_mask[:, 0, 0, :].expand(batch, key.shape[2]).contiguous()  # [B, T]
    out = decode_attention.decode_attention_fp8(  # looked up on the module at each call (patchable)
        query[:, :, 0, :], key, value, k_scale, v_scale, kv_mask,
        sm_scale=scaling if scaling is not None else head_dim**-0.5,
        kv_len=getattr(key, LENGTH_ATTRIBUTE, None),  # a static cache: positions past it are unwritten
    )  # [B, Hq, D]
    return out.unsqueeze(1), None  # [B, 1, Hq, D]


def register_kernel_attention() -> str:
    """Register the "quantkit_fp8" attention (and its mask: sdpa's) with transformers; returns the name."""
    # import time: transformers loads only where it is used
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(KERNEL_ATTENTION_NAME, _fp8_decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(KERNEL_ATTENTION_NAME, sdpa_mask)
    return KERNEL_ATTENTION_NAME


def _resolve_attention(model: nn.Module, attention: str) -> str:
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if attention == "auto":
        device = next(model.parameters()).device
        rotated = kv_rotation_of(model) != "none"  # the rotated cache reads through the model's attention
        return "kernel" if device.type == "cuda" and not rotated else "dequantize"
    return attention


def enable_fp8_kv_cache(model: nn.Module, *, attention: str = "auto") -> nn.Module:
    """Make every `model.generate()` and `model(...)` call store its KV cache in FP8 (scales from the model's buffers).

    Overrides `_prepare_cache_for_generation` on this instance only: where transformers would
    create its default DynamicCache, a fresh FP8KVCache (fp8_cache_for) takes its place; where it
    would create a StaticCache (``generate(..., cache_implementation="static")``), a
    StaticFP8KVCache of the same length. A cache passed explicitly to generate(), or another
    `cache_implementation`, is left alone. `forward` is wrapped likewise: a call given no cache
    gets a fresh FP8KVCache, so full forward passes (perplexity windows, prefill) see K/V as the
    FP8 cache stores them.
    attention: "dequantize", "kernel" (decode steps through torch.ops.quantkit.decode_attention_fp8;
    sets the model's attention implementation to "quantkit_fp8") or "auto" (kernel on CUDA).
    Returns the model. Undo with disable_fp8_kv_cache(model).
    """
    attention = _resolve_attention(model, attention)
    fp8_cache_for(model)  # fail now, not at generation time, on unsupported models
    disable_fp8_kv_cache(model)
    if attention == "kernel":
        model._quantkit_previous_attn_implementation = model.config._attn_implementation
        model.set_attn_implementation(register_kernel_attention())
    original = model._prepare_cache_for_generation  # the class's bound method

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        result = original(generation_config, model_kwargs, *args, **kwargs)
        # transformers >= 5.24 passes the cache as `cache`, earlier versions as `past_key_values`
        key = "cache" if "cache" in model_kwargs else "past_key_values"
        created = model_kwargs.get(key)
        if created is None or getattr(created, "_is_user_defined", False):
            return result
        if type(created) is DynamicCache:
            model_kwargs[key] = fp8_cache_for(self, attention=attention)
        elif type(created) is StaticCache:
            model_kwargs[key] = fp8_cache_for(self, attention=attention, max_cache_len=created.layers[0].max_cache_len)
        return result

    model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)
    model.forward = _forward_with_fp8_cache(model, attention)
    model._quantkit_fp8_kv_attention = attention
    return model


def _forward_with_fp8_cache(model: nn.Module, attention: str):
    """The model's forward as a method of this instance, given a fresh FP8KVCache whenever the caller
    passes no cache (bound to the instance, so that a deep copy of the model calls its own forward)."""
    class_forward = type(model).forward
    names = list(inspect.signature(class_forward).parameters)[1:]  # without self
    cache_names = [n for n in ("cache", "past_key_values") if n in names]
    if not cache_names:
        raise QuantizationError(f"{type(model).__name__}.forward takes no cache: the FP8 KV cache cannot be used")
    position = names.index(cache_names[0])

    @functools.wraps(class_forward)
    def forward(self, *args, **kwargs):
        given = len(args) > position and args[position] is not None
        if not given and all(kwargs.get(n) is None for n in ("cache", "past_key_values")):
            kwargs[cache_names[0]] = fp8_cache_for(self, attention=attention)
        return class_forward(self, *args, **kwargs)

    return types.MethodType(forward, model)


def disable_fp8_kv_cache(model: nn.Module) -> nn.Module:
    """Undo enable_fp8_kv_cache: generate() creates transformers' default cache again."""
    for name in ("_prepare_cache_for_generation", "forward"):
        if name in vars(model):
            delattr(model, name)
    previous = vars(model).pop("_quantkit_previous_attn_implementation", None)
    if previous is not None:
        model.set_attn_implementation(previous)
    vars(model).pop("_quantkit_fp8_kv_attention", None)
    return model


def fp8_kv_cache_enabled(model: nn.Module) -> str | None:
    """The attention mode if enable_fp8_kv_cache is active on this model, else None."""
    return vars(model).get("_quantkit_fp8_kv_attention")
