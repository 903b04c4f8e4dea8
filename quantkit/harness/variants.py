"""The models a benchmark compares: a float baseline and quantized variants of it.

A model source is a local HF folder, a hub id, ``ref:<name>`` (a built-in reference model), or a
path to a bare ``config.json`` (a randomly initialised model of that architecture: for speed
measurements only). A variant is a recipe (name or YAML path) applied to a copy of the float
baseline, or a quantized checkpoint folder.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import quantkit
from ..core import dtypes
from ..core.errors import UsageError
from ..formats.compressed_tensors import kv_cache_scheme_of
from ..formats.loading import config_errors, is_quantized_checkpoint, load_float_model, resolve_model_source
from ..gguf.reading import is_gguf_file
from ..kernels.wna16 import describe_layouts
from ..modules.model_kernels import kernel_layouts, prepare_model_kernels
from ..quantization.recipe import load_recipe
from .roofline import RooflineScheme, scheme_from_quantization_config, scheme_from_weight_args


@dataclass
class Variant:
    """One model under test.

    name: label in tables and plots; source: where it came from ("float", "recipe:NAME",
    "checkpoint:PATH"); scheme: what the roofline assumes it stores; kv_cache: the KV-cache
    QuantScheme (None: the cache is kept in the model dtype).
    """

    name: str
    model: nn.Module
    scheme: RooflineScheme
    source: str
    kv_cache: Any = None
    backend: str | None = None
    info: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, "scheme": self.scheme.to_dict(),
                "weights": self.scheme.describe(), "backend": self.backend,
                "weight_bytes": model_tensor_bytes(self.model), **self.info}


def model_tensor_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t is None or t.is_meta:
            continue
        key = (t.untyped_storage().data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def is_random_config(source: str) -> bool:
    return str(source).endswith(".json") and Path(source).is_file()


def load_source_model(
    source: str, *, dtype: torch.dtype, device: str | torch.device, seed: int = 0, strict: bool = True,
) -> nn.Module:
    """A float model from a folder / hub id / ``ref:NAME``, or a random one from a config.json file.

    strict: refuse a folder whose weights do not match its config.json (loading.load_float_model)."""
    if is_random_config(source):
        # import time: transformers loads only where it is used
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            d = json.loads(Path(source).read_text(encoding="utf-8"))
        except ValueError as e:
            raise UsageError(f"{source} is not a JSON model config ({e})") from None
        if not isinstance(d, dict) or "model_type" not in d:
            raise UsageError(f"{source}: a random-model config needs a model_type (e.g. \"llama\")")
        with config_errors(source):
            config = AutoConfig.for_model(**d)
        torch.manual_seed(seed)
        try:
            with torch.device(device), config_errors(source):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except RuntimeError as e:  # sizes torch cannot allocate (negative, or beyond memory)
            raise UsageError(f"{source}: cannot build a model of these sizes ({str(e).splitlines()[0]})") from None
        model.name_or_path = f"random:{Path(source).name}"
        return model.eval()
    _refuse_gguf(source, "the float model")
    resolved = resolve_model_source(source)
    if is_quantized_checkpoint(resolved):
        raise UsageError(
            f"{source} is a quantized checkpoint; pass the float model as MODEL and the checkpoint with --variants"
        )
    return load_float_model(resolved, dtype=dtype, device=device, strict=strict)


def float_variant(model: nn.Module, name: str | None = None) -> Variant:
    dtype = next(model.parameters()).dtype
    scheme = RooflineScheme(name=name or str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float16", "fp16"),
                            weight_bits=8 * dtype.itemsize, scale_bytes=dtype.itemsize,
                            dtype_bytes=dtype.itemsize, kv_bytes=dtype.itemsize)
    return Variant(name=scheme.name, model=model, scheme=scheme, source="float")


def kernels_used(model: nn.Module) -> str:
    """The kernels the model's quantized linears run, e.g. "quantkit::wna16_cpu_q8dot (avx512-vnni) x 48"."""
    return describe_layouts(kernel_layouts(model))


def refuse_gguf_sources(model: str, baseline: str | None, variants) -> None:
    """UsageError, before any work, for a GGUF file among a benchmark's model, baseline and variants (_refuse_gguf)."""
    for role, spec in [("MODEL", model), ("--baseline", baseline), *(("variant", v) for v in variants)]:
        if spec is not None:
            _refuse_gguf(str(spec), role)


def _refuse_gguf(spec: str, role: str) -> None:
    """UsageError for a GGUF file as a benchmark's model or variant (`role`): transformers dequantizes its blocks
    into float weights, so its timings would be a float model's, not the file's."""
    if any(is_gguf_file(part) for part in spec.split("+")):
        raise UsageError(
            f"{role} {spec}: a GGUF file loads as float weights (transformers dequantizes its blocks), so bench would "
            f"time a float model, not the file's quantized format; bench the checkpoint folder the file was exported "
            f"from (or the recipe, on the float model), or time the file with llama.cpp's llama-bench")


def _split_recipes(spec: str):
    """``"w4a16-rtn+kv-fp8"`` -> (the recipe quantizing weights or None, the KV-cache scheme or None)."""
    _refuse_gguf(spec, "variant")
    recipes = [load_recipe(part) for part in spec.split("+") if part]
    if not recipes:
        raise UsageError(f"variant {spec!r} names no recipe; give a recipe (e.g. w4a16-rtn, w4a16-rtn+kv-fp8) or a "
                         f"checkpoint folder")
    weights = [r for r in recipes if r.weights is not None]
    kv = [r for r in recipes if r.kv_cache is not None]
    if len(weights) > 1 or len(kv) > 1:
        raise UsageError(f"variant {spec!r} combines several weight or several KV-cache recipes; give at most one of each")
    return (weights[0] if weights else None), (kv[0].kv_cache if kv else None)


def build_variant(
    spec: str, base: nn.Module, *, dtype: torch.dtype, device: str | torch.device, backend: str = "auto",
    calibration_data: Any = None,
) -> Variant:
    """A variant from ``spec``: a quantized checkpoint folder, or recipes applied to a copy of ``base``
    (``"w4a16-rtn"``, ``"kv-fp8"``, ``"w4a16-rtn+kv-fp8"``, or YAML paths).

    A KV-cache recipe gives the variant an FP8 KV cache at benchmark time; its scales are left at
    1.0 (timing does not depend on them: use ``quantkit eval`` for the quality of calibrated scales).
    """
    device = torch.device(device)
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        model = quantkit.load(str(path), backend=backend, device=device, dtype=dtype)
        config = model.config.to_dict() | {"torch_dtype": str(dtype).removeprefix("torch.")}
        variant = Variant(name=path.name, model=model, scheme=scheme_from_quantization_config(config, name=path.name),
                          source=f"checkpoint:{path}", kv_cache=kv_cache_scheme_of(model))
        variant.backend = prepare_model_kernels(model, backend, release_checkpoint_tensors=True)
    else:
        weights_recipe, kv_scheme = _split_recipes(spec)
        model = copy.deepcopy(base)
        if weights_recipe is not None:
            quantkit.quantize(model, dataclasses.replace(weights_recipe, kv_cache=None), calibration_data, progress=False)
        name = "+".join(Path(p).stem if p.endswith((".yaml", ".yml")) else p for p in spec.split("+") if p)
        scheme = scheme_from_weight_args(weights_recipe.weights if weights_recipe else None, kv_scheme, name=name,
                                         dtype_bytes=dtypes.dtype_bytes(dtype))
        if weights_recipe is not None:  # each linear as quantize stored it (the indivisible rule, the ignore list)
            config = model.config.to_dict() | {"torch_dtype": str(dtype).removeprefix("torch.")}
            scheme = dataclasses.replace(scheme_from_quantization_config(config, name=name), kv_bytes=scheme.kv_bytes)
        variant = Variant(name=name, model=model.eval(), scheme=scheme, source=f"recipe:{spec}", kv_cache=kv_scheme)
        variant.backend = prepare_model_kernels(model, backend, release_checkpoint_tensors=True)
    if variant.backend is not None:
        variant.info["kernels"] = kernels_used(variant.model)
    if variant.kv_cache is not None:
        variant.info["kv_attention"] = _enable_fp8_attention(variant.model, device)
    return variant


def _enable_fp8_attention(model: nn.Module, device: torch.device) -> str:
    """How attention reads the FP8 cache: "kernel" (fused dequant, CUDA) or "dequantize"."""
    # import time: it loads transformers' cache classes, needed only with an fp8 cache
    from quantkit.modules import kv_cache

    mode = "kernel" if device.type == "cuda" else "dequantize"
    with warnings.catch_warnings():  # scales left at 1.0 on purpose: timing does not depend on them
        warnings.filterwarnings("ignore", message=".*k_scale/v_scale.*")
        kv_cache.enable_fp8_kv_cache(model, attention=mode)
    return mode
