"""Bring modules of a model loaded with accelerate offloading (`device_map` with "cpu"/"disk") into memory.

A model loaded with offloading keeps some weights on the meta device, with an accelerate
`AlignDevicesHook` that loads them from a weights map (CPU tensors or files on disk) around each forward.
The calibration runner materialises one decoder block at a time with `materialize_`, quantizes it and
keeps the (4x smaller) quantized block as plain CPU tensors, so peak memory is about one float block.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch
from torch import nn


def _align_hooks(module: nn.Module) -> list:
    """accelerate AlignDevicesHooks attached to `module` itself (also inside a SequentialHook)."""
    # import time: accelerate loads only for offloaded models
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    hooks = list(hook.hooks) if isinstance(hook, SequentialHook) else [hook]
    return [h for h in hooks if isinstance(h, AlignDevicesHook)]


def is_offloaded(module: nn.Module) -> bool:
    """True when any sub-module keeps its weights outside memory behind an accelerate hook."""
    return any(h.offload for m in module.modules() for h in _align_hooks(m))


def has_accelerate_hooks(module: nn.Module) -> bool:
    return any(hasattr(m, "_hf_hook") for m in module.modules())


def materialize_(module: nn.Module, device: torch.device | str) -> None:
    """Give every parameter and buffer of `module` a real tensor on `device` and detach accelerate hooks.

    Offloaded tensors are read from their hook's weights map (copied, so later in-place edits such as
    AWQ's scale folding never write through to the offload storage). Modules without hooks are moved.
    """
    # import time: accelerate loads only for offloaded models
    from accelerate.hooks import remove_hook_from_submodules
    from accelerate.utils import set_module_tensor_to_device
    from accelerate.utils.modeling import named_module_tensors

    for sub in module.modules():
        for hook in _align_hooks(sub):
            if not hook.offload:
                continue
            for name, _ in named_module_tensors(
                sub, include_buffers=hook.offload_buffers, recurse=hook.place_submodules, remove_non_persistent=True
            ):
                value = hook.weights_map[name]
                set_module_tensor_to_device(sub, name, device, value=value.detach().to(device, copy=True))
    remove_hook_from_submodules(module)
    for sub in module.modules():
        # accelerate restores `forward` as an instance attribute bound to the module itself: a reference
        # cycle that keeps the module (and its float weights, once replaced) alive until a garbage collection.
        bound = sub.__dict__.get("forward")
        if bound is not None and getattr(bound, "__self__", None) is sub:
            del sub.__dict__["forward"]
    leftover = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if leftover:
        raise RuntimeError(
            f"{type(module).__name__}: tensors {leftover[:4]} are on the meta device with no offload hook to load "
            f"them from; load the model with real weights (or with accelerate's device_map offloading)"
        )
    module.to(device)


def home_device(module: nn.Module) -> torch.device:
    """Where a processed block goes back to: its own device, or the CPU for offloaded / meta blocks."""
    if is_offloaded(module):
        return torch.device("cpu")
    for tensor in list(module.parameters()) + list(module.buffers()):
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


def materialize_model_(model: nn.Module) -> None:
    """After calibration: turn an offloaded model into a plain CPU model (no hooks, no meta tensors)."""
    if not has_accelerate_hooks(model):
        return
    materialize_(model, "cpu")
    if hasattr(model, "hf_device_map"):
        del model.hf_device_map
    if hasattr(model, "tie_weights"):
        model.tie_weights()


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


@functools.cache
def _libc_malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 128 << 10  # glibc's default before its dynamic adjustment


def map_large_allocations() -> bool:
    """Serve every allocation of 128 KiB or more with its own mapping from now on, in this process
    (glibc's mallopt(M_MMAP_THRESHOLD), which also ends its dynamic threshold); returns whether it took.

    With glibc's dynamic threshold, blocks' float temporaries of up to 32 MiB come from the heap once a
    larger one was freed, and the small tensors allocated between them keep those pages: measured on a
    width-2048 GPTQ, the peak grew by ~90 MB a block though nothing held the freed tensors, where with this
    setting it stays flat (malloc_trim alone does not return pages that live tensors share). Each large
    tensor then costs an mmap and its page faults: that 3-layer run took 98 s with it against 87-97 s
    without, one run each on a shared machine, within the runs' spread.
    """
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def release_freed_memory() -> None:
    """Give the pages of freed tensors back to the system (glibc's malloc_trim(0)).

    glibc raises its mmap threshold after large frees (up to 32 MiB), so the float temporaries of one
    layer's quantization (a few MiB to tens of MiB) are then carved from the heap; the small quantized
    tensors kept between them pin those heap pages, and the process's anonymous memory grows with every
    layer quantized though nothing holds the freed tensors. Called after each layer or block; a no-op
    without glibc.
    """
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)
