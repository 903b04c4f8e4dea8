"""The Python API: quantize a transformers model in place, save it, load it back ready to run."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .algorithms.registry import ALGORITHMS
from .calibration import calibration_batches, quantize_blockwise
from .calibration.data import describe_calibration
from .calibration.kv_scales import check_kv_cache_model, quantize_kv_cache
from .calibration.offload import map_large_allocations, release_freed_memory
from .calibration.spill import BlockSpill
from .core.device import resolve_device
from .core.dtypes import checkpoint_dtype
from .core.errors import CheckpointError, QuantizationError, UsageError, first_names
from .core.finite import describe_nonfinite, nonfinite_tensors
from .core.scheme import QuantScheme
from .files.outputs import OutputState, atomic_output_dir
from .formats.compressed_tensors import build_quantization_config, kv_cache_scheme_of
from .formats.kv_rotation_file import CONFIG_KEY as ROTATION_CONFIG_KEY, read_rotated_scales, write_rotated_scales
from .formats.loading import (
    SOURCE_DTYPE_ATTRIBUTE, copy_tokenizer_files, empty_quantized_model, is_quantized_checkpoint, load_float_model,
    read_config_json, resolve_model_source, source_dtype, tokenizer_bytes,
)
from .formats.safetensors_io import folder_tensors, read_state_dict, stored_float_dtype, write_state_dict
from .formats.shapes import check_checkpoint_tensors
from .gguf.reading import gguf_origin, is_gguf_file, load_gguf_model
from .kernels.backend_choice import BACKENDS
from .modules.fused_linear import is_fused, unfused_state_dict
from .modules.kv_cache import enable_fp8_kv_cache
from .modules.kv_rotation import check_rotation
from .modules.kv_scales import (
    ROTATED_SCALE_NAMES, SCALE_NAMES, attach_kv_scales, attach_rotated_kv_scales, attention_modules, kv_rotation_of,
    pop_kv_scales, read_kv_scales,
)
from .modules.moe import (
    from_disk_name, model_type, moe_config_problem, routed_token_summary, router_names, to_disk_name,
    unfuse_experts,
)
from .modules.model_kernels import prepare_model_kernels
from .modules.quantized_layer import COMPRESSED_TENSORS, GGUF, holds_format, is_quantized_layer, to_layer
from .modules.targets import set_submodule
from .quantization import provenance
from .quantization.recipe import Recipe, load_recipe
from .quantization.summaries import refit_notes
from .quantization.weight_census import unquantizable_weights
from .runtime.fast_generate import install as install_fast_generate


def _check_finite(model: nn.Module) -> None:
    """Refuse a model with NaN/Inf in any float parameter or buffer (norm weights included)."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    found = nonfinite_tensors(named)
    if found:
        raise QuantizationError(
            f"{describe_nonfinite(found)}: a model with NaN/Inf weights cannot be quantized (its outputs would be "
            f"NaN or wrong); fix or re-download the source weights"
        )


def _layer_schemes(model: nn.Module, names: list[str], recipe: Recipe) -> dict[str, QuantScheme]:
    """Each targeted linear's weight scheme (the recipe's `indivisible` rule and mix applied), checked before any work."""
    try:
        return recipe.schemes_for(model, names)
    except ValueError as e:
        raise QuantizationError(f"{e}; or add it to the recipe's ignore list") from None


def _warn_refitted(schemes: dict[str, QuantScheme], model: nn.Module, recipe: Recipe) -> None:
    """One warning naming the linears whose scheme the `indivisible` rule changed or left ragged."""
    notes = refit_notes(schemes, {n: model.get_submodule(n).in_features for n in schemes}, recipe)
    if notes:
        warnings.warn("; ".join(notes), stacklevel=3)


def _moe_aware_targets(model: nn.Module, recipe: Recipe, leave_float: bool) -> list[str]:
    """The linears `recipe` quantizes in a model whose fused MoE experts are split already (`quantize` splits
    them first); routers never. QuantizationError naming the large matrices no nn.Linear rule reaches (unless
    ignored or `leave_float`)."""
    if not leave_float:
        unreachable = unquantizable_weights(model, recipe.ignore)
        if unreachable:
            shown = first_names(unreachable, 4)
            raise QuantizationError(
                f"{shown}: weight matrices that are not in an nn.Linear, so quantkit cannot quantize them and "
                f"would leave them float; add their modules to the recipe's ignore list (or pass --leave-float / "
                f"leave_float=True) to keep them float knowingly"
            )
    names, _ = recipe.linears(model)
    routers = set(router_names(model))
    return [n for n in names if n not in routers]


def quantize(
    model: nn.Module, recipe: "str | os.PathLike | Recipe | dict", calibration_data: Any = None, *,
    progress: bool = True, tokenizer: Any = None, device: "str | torch.device | None" = None,
    leave_float: bool = False, scale_dtype: "torch.dtype | None" = None,
    spill_folder: "str | os.PathLike | None" = None,
) -> nn.Module:
    """Quantize `model`'s targeted nn.Linear layers in place per `recipe`; returns the model.

    recipe: a built-in name ("w4a16-rtn"), a YAML path, a dict or a Recipe.
    calibration_data (GPTQ, AWQ, FP8 KV scales; RTN weights ignore it): a source string (text/JSONL/Parquet file or folder,
      "hub:NAME[:CONFIG]:SPLIT:COLUMN", "ref"), a quantkit.calibration.CalibrationConfig (source, samples,
      length, seed), or token ids ([T], [B, T] or a list); None: the built-in reference models' training text.
    tokenizer: for text calibration sources (default: the model folder's tokenizer).
    device: where calibration computes, one decoder block at a time (default: cuda if available, else cpu).
    scale_dtype: the dtype the output will store scales in, which the algorithms round them to first
      (default: the dtype the source weights are stored in; GGUF output: torch.float16, its block scales).
      Models loaded with accelerate CPU/disk offloading are supported and come back as plain CPU models.
    leave_float: leave weights quantkit cannot quantize (matrices that are no nn.Linear, e.g. fused 3-D
      experts of an unknown layout) in full precision instead of refusing (QuantizationError naming them).
    spill_folder: a folder on a disk where each finished block's (or RTN layer's) quantized tensors are
      written and then mapped back, so that they sit in the page cache instead of the process's memory
      (quantkit.calibration.spill; the files are unlinked at once, their space freed with the model).
      With the source weights memory-mapped (from_pretrained of safetensors in their stored dtype), the
      process holds one float block at a time whatever the depth (large allocations are then mapped one by
      one for the rest of the process: calibration.offload.map_large_allocations). None: quantized tensors
      stay in memory.
    Mixture-of-experts models (Qwen2/3-MoE, Mixtral, OLMoE, ...): the fused experts are first split into
    per-expert linears (quantkit.modules.QuantExperts), which the recipe's targets then reach; routers
    stay float.
    """
    recipe = load_recipe(recipe)
    if device is not None:
        device = resolve_device(device)
    origin = gguf_origin(model)
    if origin is not None and origin.quantized_tensors and recipe.weights is not None:
        raise QuantizationError(
            f"this model is the GGUF file {origin.path} dequantized to float ({origin.quantized_tensors} of its "
            f"tensors on llama.cpp's grids): quantizing it rounds weights that were rounded already, and its "
            f"figures would measure both roundings; quantize the float model it was made from (a GGUF file in F16, "
            f"BF16 or F32 is one)")
    _check_finite(model)
    problem = moe_config_problem(getattr(model, "config", None))
    if problem:
        raise QuantizationError(f"{type(model).__name__}'s config: {problem}")
    if recipe.kv_cache is not None:
        check_kv_cache_model(model)
        if recipe.kv_cache_rotation != "none":
            attention = next(iter(attention_modules(model).values()))[1]
            check_rotation(recipe.kv_cache_rotation, getattr(attention, "head_dim", None))  # before any work
    calibrated = recipe.needs_calibration
    spill = None
    if spill_folder is not None:
        spill = BlockSpill(spill_folder)
        map_large_allocations()  # freed float temporaries leave the process, block after block
    unfuse_experts(model)  # MoE: per-expert linears, as checkpoints store them (a KV-only recipe too)
    if recipe.weights is not None:
        if recipe.weights.grid != "uniform" and router_names(model):
            raise QuantizationError(
                f"recipe {recipe.name} quantizes onto a GGUF grid ({recipe.weights.grid}), written only as GGUF, "
                f"which quantkit writes for dense Llama, Mistral, Qwen2 and Qwen3 models; this is a mixture-of-"
                f"experts model: use a checkpoint recipe (e.g. w4a16-gptq-asym)")
        if any(is_quantized_layer(m) for m in model.modules()):
            raise QuantizationError(
                "the model's weights are already quantized; quantize the float model (quantkit.load of a "
                "float folder, or transformers' from_pretrained) instead"
            )
        names = _moe_aware_targets(model, recipe, leave_float)
        schemes = _layer_schemes(model, names, recipe)
        _warn_refitted(schemes, model, recipe)
        algorithm = ALGORITHMS[recipe.algorithm.name]
        if algorithm.needs_calibration:
            names = quantize_blockwise(
                model, recipe, names, calibration_data, tokenizer=tokenizer, device=device, progress=progress,
                scale_dtype=scale_dtype, schemes=schemes, spill=spill,
            )
            if names:
                warnings.warn(f"{', '.join(names)}: outside the decoder blocks, quantized with "
                              f"{algorithm.leftovers.upper()} (no calibration)", stacklevel=2)
        # the recipe's algorithm with its options, or (calibrated) its leftovers' algorithm with that one's defaults
        quantize_linear = algorithm.linear_quantizer(recipe.algorithm.options)
        for name in tqdm(names, desc=f"quantize {recipe.name}", unit="layer", disable=not progress or not names):
            linear = model.get_submodule(name)
            stored = scale_dtype or source_dtype(model)  # the scales come rounded to what the output will hold
            qweight = quantize_linear(linear.weight.detach(), schemes[name], stored)
            layer = to_layer(qweight, linear.bias, dtype=linear.weight.dtype)
            set_submodule(model, name, layer)
            if spill is not None:
                spill.keep(layer)
            del linear, qweight, layer
            release_freed_memory()  # the freed float temporaries' pages, which glibc would keep (calibration.offload)
    if recipe.kv_cache is not None:
        quantize_kv_cache(model, calibration_batches(calibration_data, model, tokenizer), progress=progress,
                          rotation=recipe.kv_cache_rotation)
        enable_fp8_kv_cache(model)  # generate() and forward passes now run with the calibrated FP8 cache
    _untie_quantized_lm_head(model)
    model.config.quantization_config = build_quantization_config(model, recipe.kv_cache)
    provenance.record(model, recipe, describe_calibration(calibration_data, model) if calibrated else None,
                      routed_token_summary(model))
    return model


def save(
    model: nn.Module, out_dir: "str | os.PathLike", *, tokenizer_source: str | None = None, force: bool = False,
    dtype: "torch.dtype | str | None" = None, expect: OutputState | None = None,
) -> Path:
    """Write a quantized model as a compressed-tensors checkpoint folder, atomically, with
    ``recipe.yaml`` (the recipe and calibration data quantize used) when this process quantized it.

    tokenizer_source: folder or hub id whose tokenizer files are copied beside the weights
    (default: where the model was loaded from).
    force: replace an existing `out_dir` that quantkit wrote (an empty folder, or one whose
    .quantkit-output.json lists every file in it); never the folder the model or tokenizer was loaded
    from or one holding it, the working folder, or a folder holding other files.
    dtype: the dtype of every floating tensor written (embeddings, norms, scales, KV scales):
    torch.bfloat16, torch.float16 or torch.float32, or its name; default: the dtype the source weights
    were stored in (a bf16 model stays bf16 even when it was loaded in fp32 to compute), or the model's
    dtype for a model quantkit did not load.
    expect: what `out_dir` held when the caller's work began (quantkit.files.outputs.output_state); the write
    is refused if another process wrote `out_dir` since (default: since this call).
    A disk too full for the checkpoint is found before anything is written (NoSpaceError, an OSError).
    """
    dtype = source_dtype(model) if dtype is None else checkpoint_dtype(dtype)
    quantized = [m for m in model.modules() if holds_format(m, COMPRESSED_TENSORS)]
    origin = gguf_origin(model)
    if origin is not None and not quantized:
        raise QuantizationError(
            f"this model is the GGUF file {origin.path} dequantized to float weights (quantkit.load of a .gguf file): a "
            f"checkpoint of it would hold no quantized layer and no tokenizer; keep the GGUF file as it is, or "
            f"quantize and save the float model it was made from")
    if any(holds_format(m, GGUF) for m in model.modules()):
        raise QuantizationError(
            "this model's weights are on a GGUF grid (llama.cpp's block types: float group minimums or scales on "
            "llama.cpp's 6- and 8-bit grids), which a compressed-tensors checkpoint cannot hold: write it as GGUF (quantkit quantize ... --out FILE.gguf, "
            "or quantkit.gguf.writing.export_gguf)")
    if not quantized and not getattr(model.config, "quantization_config", None):
        raise QuantizationError("the model has no quantized layers: call quantkit.quantize(model, recipe) first")
    if any(m.checkpoint_tensors_released for m in quantized):
        raise QuantizationError(
            "this model's layers released their checkpoint tensors for a faster backend; "
            "load it with quantkit.load(path, backend='reference') to save it again"
        )
    state = _deduplicated_state_dict(model)
    if is_fused(model):
        state = unfused_state_dict(model, state)
    state = _in_dtype(state, dtype)
    mtype = model_type(model)
    state = {to_disk_name(k, mtype): v for k, v in state.items()}  # MoE blocks under their checkpoint names
    config = model.config.to_dict()
    if not config.get("architectures"):  # a model built in memory: engines pick the model class by it
        config["architectures"] = [type(model).__name__]
    config["quantization_config"] = build_quantization_config(model, kv_cache_scheme_of(model))
    rotated = _rotated_scale_tensors(model, dtype)  # the rotated-basis scales, never under k_scale / v_scale
    config.pop(ROTATION_CONFIG_KEY, None)
    loaded_from = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    source = tokenizer_source or loaded_from
    size = sum(t.numel() * t.element_size() for t in state.values()) + tokenizer_bytes(source)
    with atomic_output_dir(out_dir, force=force, inputs=(loaded_from, tokenizer_source), expect=expect,
                           size_hint=size) as tmp:
        write_state_dict(state, tmp)
        if rotated:
            config[ROTATION_CONFIG_KEY] = write_rotated_scales(tmp, rotated)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        copy_tokenizer_files(source, tmp)
        made = provenance.of(model)
        if made is not None:
            (tmp / provenance.RECIPE_FILE).write_text(
                provenance.recipe_file_text(made, source, Path(os.path.expanduser(out_dir)).resolve()))
    return Path(os.path.expanduser(out_dir)).resolve()


def _rotated_scale_tensors(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{<attention>.k_scale / .v_scale: rotated-basis scale in `dtype`} of a model whose KV cache is rotated, else {}."""
    if kv_rotation_of(model) == "none":
        return {}
    scales, missing = read_kv_scales(model, rotated=True)
    if missing or not scales:
        raise QuantizationError(f"the model's KV cache is rotated but {len(missing)} attention layers have no "
                                f"{' / '.join(ROTATED_SCALE_NAMES)}: calibrate with rotation='hadamard' again")
    out = {}
    for i, (name, _) in attention_modules(model).items():
        for buffer_name, scale in zip(SCALE_NAMES, scales[i]):
            out[f"{name}.{buffer_name}"] = scale.clamp(min=torch.finfo(dtype).tiny).to(dtype)
    return out


def _untie_quantized_lm_head(model) -> None:
    """A quantized lm_head of a model with tied embeddings is its own tensor now (the embedding stays float
    for the lookup): the config says so, or readers that tie by the config (transformers, vLLM) look for
    an lm_head.weight that the checkpoint no longer has, or replace the quantized head by the embedding."""
    head = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and head is not None and not isinstance(head, nn.Linear):
        model.config.tie_word_embeddings = False


def _in_dtype(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors cast to `dtype`; scales kept above its smallest normal number (never 0)."""
    out = {}
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            if name.endswith("_scale"):
                tensor = tensor.clamp(min=torch.finfo(dtype).tiny)
            tensor = tensor.to(dtype)
        out[name] = tensor
    found = nonfinite_tensors(out.items())
    if found:
        raise QuantizationError(f"{describe_nonfinite(found)} after conversion to {dtype}: the values do not fit; "
                                f"save in a wider dtype (dtype=torch.float32 / --dtype float32)")
    return out


def _deduplicated_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without tied aliases (safetensors refuses shared storage)."""
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    state, seen = {}, {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen and tensor.numel():
            if name in tied or seen[key] in tied:
                continue
            tensor = tensor.clone()
        seen[key] = name
        state[name] = tensor
    return state


def load(
    path: "str | os.PathLike", *, backend: str = "auto", device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None, trust_remote_code: bool = False, strict: bool = True,
    fuse: bool | None = None, fast_generate: bool = True,
) -> nn.Module:
    """A ready model from a quantkit/compressed-tensors checkpoint (or a float model folder / hub id, or a GGUF
    file: checked first, its weights dequantized to float by transformers, quantkit.gguf.reading).

    Quantized linears run through quantkit.kernels with `backend` ("auto", "triton", "torch",
    "reference"); weights load from safetensors only. strict (float models): refuse one whose weights
    transformers would not load as stored (see loading.load_float_model); False loads it with a warning.
    fuse: run each layer's q/k/v and gate/up projections as one linear each (modules.fused_linear;
    fewer, larger kernel calls per decode step). None: where the layers run on the CPU ("torch"
    backend). `save` writes a fused model's layers back as the checkpoint has them.
    fast_generate: on the CPU, the model's `generate` runs quantkit's C++ decode loop where it can honour the
    call, else transformers' own, saying why (quantkit.runtime.fast_generate, docs/generate.md); False: transformers' own.
    """
    if backend not in BACKENDS:
        raise UsageError(f"backend {backend!r} is unknown; choose one of {', '.join(BACKENDS)}")
    if dtype is not None:
        try:
            dtype = checkpoint_dtype(dtype)
        except UsageError:
            raise UsageError(f"dtype {dtype!r} is no dtype quantkit.load runs a model in: choose torch.bfloat16, "
                             f"torch.float16 or torch.float32 (or their names), or None for the model's own") from None
    device = resolve_device(device)
    if is_gguf_file(path):
        return install_fast_generate(load_gguf_model(path, dtype=dtype, device=device), fast_generate)
    source = resolve_model_source(str(path))
    if not is_quantized_checkpoint(source):
        return install_fast_generate(load_float_model(source, dtype=dtype, device=device, strict=strict,
                                                      trust_remote_code=trust_remote_code), fast_generate)
    return install_fast_generate(_load_quantized(Path(source), backend=backend, device=device, dtype=dtype,
                                                 trust_remote_code=trust_remote_code, fuse=fuse), fast_generate)


def _load_quantized(folder: Path, *, backend: str, device, dtype, trust_remote_code: bool,
                    fuse: bool | None = None) -> nn.Module:
    model, qcfg, dtype = empty_quantized_model(folder, dtype=dtype, trust_remote_code=trust_remote_code)
    quantization_config = read_config_json(folder)["quantization_config"]
    mtype = model_type(model)
    state = {from_disk_name(k, mtype): v for k, v in read_state_dict(folder).items()}
    found = nonfinite_tensors(state.items())
    if found:
        raise CheckpointError(
            f"{folder}: {describe_nonfinite(found)}; the checkpoint is corrupt (it would evaluate to NaN or "
            f"wrong outputs): re-create it from the source model"
        )
    check_checkpoint_tensors(folder, model, folder_tensors(folder), state, kv_cache=qcfg.kv_cache is not None)
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    kv_scales = pop_kv_scales(model, state)
    model.load_state_dict(state, strict=False, assign=True)  # names checked above; tied aliases may be absent
    model.tie_weights()
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise CheckpointError(f"{folder}: no weights for {leftover[:5]}; the checkpoint is incomplete")
    model.to(device)
    prepare_model_kernels(model, backend, fuse=fuse)
    if qcfg.kv_cache is not None:
        attach_kv_scales(model, kv_scales, dtype=dtype)
        config_json = read_config_json(folder)
        if ROTATION_CONFIG_KEY in config_json:
            rotation, tensors = read_rotated_scales(folder, config_json[ROTATION_CONFIG_KEY])
            rotated = pop_kv_scales(model, tensors)
            if not rotated or tensors:
                raise CheckpointError(f"{folder}: the rotated KV scales do not match the model's attention layers "
                                      f"(unexpected: {sorted(tensors)[:3]}); re-create the checkpoint")
            attach_rotated_kv_scales(model, rotated, rotation, dtype=dtype)
        enable_fp8_kv_cache(model)
    model.config.quantization_config = quantization_config
    model.name_or_path = str(folder)
    setattr(model, SOURCE_DTYPE_ATTRIBUTE, stored_float_dtype(folder) or dtype)
    return model.eval()
