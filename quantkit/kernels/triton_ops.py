"""The Triton ops, registered on first use: ``register_ops()``.

``torch.ops.quantkit.wna16_gemm``, ``decode_attention_fp8`` and ``fp8_kv_cache_write`` are
``torch.library.triton_op``s (torch.compile sees through them to the kernels). Defining one imports
triton, and ``triton_op`` itself imports torch._inductor and torch._dynamo: measured on a 2-core AMD EPYC
(torch 2.13, triton 3.9), 77 MB of anonymous memory and 1.5-2 s, which a process would pay without ever
running a Triton kernel (``evals/calibration/import_memory.py``). So the modules that hold the kernels and
define the ops (``wna16_triton``, ``decode_attention_kernels``, ``kv_cache_write_kernels``) are imported
here only, and nothing else in quantkit imports them:

- ``register_ops()`` imports them (and so registers the three ops); it is idempotent and cheap once done.
  The Python entry points call it before they reach an op: ``prepare_wna16`` and ``wna16_linear`` on the
  Triton layout, ``decode_attention_fp8`` and ``fp8_kv_cache_write`` where ``triton_can_run_on`` their
  device (CUDA, or CPU under Triton's interpreter; elsewhere they run their pure-torch references, as
  the ops do there). The vLLM plugin calls it on CUDA platforms. Code that calls
  ``torch.ops.quantkit.<one of the three>`` directly calls ``quantkit.kernels.register_ops()`` once first.
- ``kernels_interpreted()``: whether the kernels run under Triton's interpreter (TRITON_INTERPRET=1).
  Triton decides it when it decorates the kernels, i.e. when ``register_ops`` first runs: until then the
  answer is what it would decide now.

The C++ ops (``cpu_extension``) and the CPU ops on PyTorch's kernels (``wna16_cpu``) are not Triton ops
and are registered as before. Depends on torch only (triton when registering).
"""

from __future__ import annotations

from .triton_interpret import kernels_interpreted, triton_can_run_on  # noqa: F401  (this module's contract)

_registered = False


def register_ops() -> None:
    """Define ``torch.ops.quantkit.wna16_gemm``, ``decode_attention_fp8`` and ``fp8_kv_cache_write``.

    Imports triton (and, through ``torch.library.triton_op``, torch._inductor). Set TRITON_INTERPRET=1
    before the first call to run the kernels on CPU tensors. Idempotent."""
    global _registered
    if _registered:
        return
    # triton and torch._inductor are imported here, on first use only (see the module's docstring)
    from . import decode_attention_kernels, kv_cache_write_kernels, wna16_triton  # noqa: F401
    _registered = True
