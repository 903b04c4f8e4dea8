"""The floor every other stands on: errors, config and dtype parsing, device names, finite checks, and the
quantization vocabulary (`QuantScheme`, `QuantizedWeight`, scales / quantize / dequantize).

Imports only the standard library, torch, `quantkit.kernels` and the GGUF type records and grids (which
import nothing of quantkit above them).
"""
