"""quantkit.kernels: weight-only quantized linear kernels and their pure-torch references.

Depends on torch and triton only; knows nothing of models, recipes or files.

Contract used by quantkit.modules.QuantLinear:

- ``prepare_wna16(weight_packed, weight_scale, weight_zero_point, bits=, in_features=, backend=, group_size=)``
  turns the on-disk compressed-tensors tensors into the tensors a backend reads (a dict of
  name -> tensor, repacked once at load time); ``group_size`` (optional) says how a weight whose
  group size does not divide K is grouped (ceil(K / group_size) scales, the last group shorter);
- ``wna16_linear(x, prepared, bits=, in_features=, out_features=, backend=, bias=)`` runs it.
- ``resolve_backend(backend, device, dtype)`` turns "auto" into a concrete backend.

Ops (``torch.ops.quantkit.*``, usable without the rest of quantkit, with fake implementations for
torch.compile): ``wna16_gemm`` (Triton), ``wna16_cpu_q8dot`` (C++, int8-rounded activations and integer
dot products; built on first use: ``cpu_extension``), ``wna16_int4_cpu`` and ``wna16_int8_cpu`` (PyTorch's CPU
weight-only kernels), ``decode_attention_fp8`` (FP8/bf16 KV-cache decode attention, Triton),
``fp8_kv_cache_write`` (quantize-on-write into a static FP8 KV cache, Triton), ``wna16_moe_ref`` (the
mixture-of-experts reference over stacked experts; the runtime MoE path is ``wna16_moe``). Backends,
layouts and numerics: README.md here, ``wna16``, ``wna16_layout``, ``wna16_triton``.

The three Triton ops are registered on first use (``triton_ops``): importing this package imports neither
triton nor torch._inductor, and the functions above register them before they call them. Code that calls
``torch.ops.quantkit.wna16_gemm`` / ``decode_attention_fp8`` / ``fp8_kv_cache_write`` itself calls
``register_ops()`` once first. Set TRITON_INTERPRET=1 before that (or before the first Triton call) to run
the Triton kernels on CPU tensors; ``kernels_interpreted()`` tells.
"""

from .decode_attention import decode_attention_fp8
from .decode_attention_reference import decode_attention_reference
from .fusion import concat_wna16_weights
from .kv_cache_write import fp8_kv_cache_write, fp8_kv_cache_write_reference
from .packing import pack_int32, unpack_int32
from .reference import dequantize_wna16, wna16_gemm_torch, wna16_linear_reference
from .triton_ops import kernels_interpreted, register_ops
from .backend_choice import BACKENDS, resolve_backend
from .wna16 import planned_layout, prepare_wna16, prepared_layout, wna16_linear
from .wna16_heuristics import WNA16Config, choose_config
from .wna16_moe import MoEExpertWeights, PreparedProjection, wna16_moe
from .wna16_moe_reference import StackedWNA16, wna16_moe_reference

__all__ = [
    "BACKENDS",
    "MoEExpertWeights",
    "PreparedProjection",
    "StackedWNA16",
    "WNA16Config",
    "choose_config",
    "concat_wna16_weights",
    "decode_attention_fp8",
    "decode_attention_reference",
    "decode_attention_triton",
    "dequantize_wna16",
    "fp8_kv_cache_write",
    "fp8_kv_cache_write_reference",
    "kernels_interpreted",
    "pack_int32",
    "planned_layout",
    "prepare_wna16",
    "prepared_layout",
    "register_ops",
    "resolve_backend",
    "unpack_int32",
    "wna16_gemm_torch",
    "wna16_gemm_triton",
    "wna16_linear",
    "wna16_linear_reference",
    "wna16_moe",
    "wna16_moe_reference",
]


def __getattr__(name: str):
    """The Triton launchers ``decode_attention_triton`` and ``wna16_gemm_triton``, imported on first use."""
    if name == "decode_attention_triton":
        register_ops()
        from .decode_attention_kernels import decode_attention_triton  # triton: only when asked for

        return decode_attention_triton
    if name == "wna16_gemm_triton":
        register_ops()
        from .wna16_triton import wna16_gemm_triton  # triton: only when asked for

        return wna16_gemm_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
