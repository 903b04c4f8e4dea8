"""Other weight-only int4 kernels, timed by bench_wna16.py on the same quantized values as quantkit.

Each ``make_*`` takes the on-disk compressed-tensors tensors of one layer (W [N, K]: packed int32
[N, K/8], scales [N, G], packed zero points or None) and returns ``call(x) -> y`` for x [M, K], or
raises ``PeerUnavailable`` with the reason (scheme not supported, package not installed, ...).

- tinygemm: ``torch.ops.aten._weight_int4pack_mm`` (CUDA, bf16 activations): weights packed by
  ``aten._convert_weight_to_int4pack`` from uint8 [N, K/2] (even k in the high nibble, stored
  unsigned u = q + 8), ``scales_and_zeros`` bf16 [K/g, N, 2] with w = (u - 8) * scale + zero, so
  zero = -zp * scale. Groups of 32/64/128/256; per channel runs as groups of 128..32 with the
  scale repeated (exact).
- gemlite (``pip install gemlite``; pure Python on Triton): ``GemLiteLinearTriton.pack(W_q uint8
  [N, K], scales [N, G], zeros [N, G])`` with w = (W_q - zeros) * scales; its tuned configurations
  are loaded from ``GEMLITE_CONFIG`` (default: the package's ``configs/h100.json`` if present) so
  that it does not autotune for minutes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from quantkit.kernels.packing import unpack_int32
from quantkit.kernels.packing import unpack_zero_point

TINYGEMM_GROUPS = (256, 128, 64, 32)


class PeerUnavailable(Exception):
    """This peer cannot run this scheme here (the message says why)."""


def _signed_values(packed, scale, zero, bits, k):
    """-> q int32 [N, K] signed, s fp32 [N, G], zp fp32 [N, G] (zeros when symmetric)."""
    n = packed.shape[0]
    q = unpack_int32(packed, bits, k).to(torch.int32)
    s = scale.to(torch.float32)
    zp = unpack_zero_point(zero, bits, n).to(torch.float32) if zero is not None else torch.zeros_like(s)
    return q, s, zp


def make_tinygemm(packed, scale, zero, bits: int, k: int, dtype: torch.dtype):
    if bits != 4:
        raise PeerUnavailable("tinygemm runs int4 only")
    if dtype != torch.bfloat16:
        raise PeerUnavailable("tinygemm on CUDA takes bf16 activations only")
    if packed.device.type != "cuda":
        raise PeerUnavailable("aten._weight_int4pack_mm is timed on CUDA only")
    q, s, zp = _signed_values(packed, scale, zero, bits, k)
    n, groups = s.shape
    group = k // groups
    gc = next((g for g in TINYGEMM_GROUPS if group % g == 0), None)
    if gc is None or k % 128 or n % 8:
        raise PeerUnavailable(f"tinygemm needs K % 128 == 0, N % 8 == 0 and groups of 32..256 (group {group})")
    u = (q + 8).to(torch.int32)  # [N, K] in [0, 15]
    u8 = (u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8).contiguous()  # [N, K/2]
    weight = torch.ops.aten._convert_weight_to_int4pack(u8, 8)
    repeat = group // gc
    sz = torch.stack([s, -zp * s], dim=-1).repeat_interleave(repeat, dim=1)  # [N, K/gc, 2]
    scales_and_zeros = sz.transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/gc, N, 2]

    def call(x):
        return torch.ops.aten._weight_int4pack_mm(x, weight, gc, scales_and_zeros)

    return call


_GEMLITE_CONFIG_LOADED = False


def make_gemlite(packed, scale, zero, bits: int, k: int, dtype: torch.dtype):
    global _GEMLITE_CONFIG_LOADED
    try:
        import gemlite  # noqa: F401
        from gemlite.core import DType, GemLiteLinearTriton
    except Exception as exc:  # noqa: BLE001  (any import failure: not installed, incompatible triton)
        raise PeerUnavailable(f"gemlite not importable ({type(exc).__name__}: {exc})"[:200]) from None
    if packed.device.type != "cuda":
        raise PeerUnavailable("gemlite runs on CUDA only")
    if dtype not in (torch.float16, torch.bfloat16):
        raise PeerUnavailable("gemlite takes fp16/bf16 activations")
    if not _GEMLITE_CONFIG_LOADED:
        config = os.environ.get("GEMLITE_CONFIG") or str(Path(gemlite.__file__).resolve().parent / "configs" / "h100.json")
        if Path(config).exists():
            GemLiteLinearTriton.load_config(config)
        _GEMLITE_CONFIG_LOADED = True
    q, s, zp = _signed_values(packed, scale, zero, bits, k)
    n, groups = s.shape
    offset = 1 << (bits - 1)
    tdtype = DType.BF16 if dtype == torch.bfloat16 else DType.FP16
    layer = GemLiteLinearTriton(W_nbits=bits, group_size=k // groups, in_features=k, out_features=n,
                                input_dtype=tdtype, output_dtype=tdtype)
    layer.pack((q + offset).to(torch.uint8), s.to(dtype), (zp + offset).to(dtype), bias=None)
    return layer


PEERS = {"tinygemm": make_tinygemm, "gemlite": make_gemlite}
