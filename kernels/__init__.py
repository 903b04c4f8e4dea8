"""quantkit.kernels: weight-only quantized linear kernels and their pure-torch references.

Depends on torch and triton only; knows nothing of models, recipes or files.

Contract used by quantkit.modules.QuantLinear:

- ``prepare_wna16(weight_packed, weight_scale, weight_zero_point, bits=, in_features=, backend=)``
  turns the on-disk compressed-tensors tensors into the tensors a backend reads (a dict of
  name -> tensor, repacked once at load time);
- ``wna16_linear(x, prepared, bits=, in_features=, out_features=, backend=, bias=)`` runs it.
- ``resolve_backend(backend, device, dtype)`` turns "auto" into a concrete backend.
"""

from .decode_attention import decode_attention_fp8, decode_attention_triton
from .decode_attention_reference import decode_attention_reference
from .packing import pack_int32, unpack_int32
from .reference import dequantize_wna16, wna16_linear_reference
from .wna16 import BACKENDS, prepare_wna16, resolve_backend, wna16_linear

__all__ = [
    "BACKENDS",
    "decode_attention_fp8",
    "decode_attention_reference",
    "decode_attention_triton",
    "dequantize_wna16",
    "pack_int32",
    "prepare_wna16",
    "resolve_backend",
    "unpack_int32",
    "wna16_linear",
    "wna16_linear_reference",
]
