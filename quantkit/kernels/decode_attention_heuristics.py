"""Launch parameters of the FP8 decode-attention kernel, by rule over (batch, KV heads, context).

The rule and its reasoning (UNMEASURED: derived from the H200's shape, 132 SMs, ~4.2 TB/s copy
bandwidth, and from FlashInfer / FlashAttention's split-KV decode; a GPU run of
``evals/kv_cache/gpu_bench.py --sweep`` is what confirms or replaces the constants):

- Decode attention reads each K/V byte once and does ~2 flops per byte: it is a streaming read,
  and a streaming read reaches the copy bandwidth only with enough bytes in flight on every SM
  (Little's law: ~4.2 TB/s x ~1 us of DRAM latency = ~4 MB in flight, ~32 KB per SM).
- One program holds one (sequence, KV head, split): all the query heads of the GQA group share
  each K/V tile (loaded once, ``tl.dot`` over the group), so the grid is B * Hkv * S. At batch 1
  with 8 KV heads, B * Hkv = 8 programs would use 8 of 132 SMs: the context is split into S
  pieces so that B * Hkv * S reaches ``PROGRAMS_PER_SM`` (4) programs per SM, i.e. several
  programs resident on every SM, each streaming its own tiles (FlashInfer's split-KV decode sizes
  its grid the same way: enough CTAs to fill the SMs, never fewer than the device holds).
- A split never gets fewer than ``MIN_TILES_PER_SPLIT`` (4) tiles of BLOCK_N keys: below that the
  per-program prologue (q load, partial-result stores) and the reduction (S partials per query
  head, fp32) stop being small against the K/V bytes. At 32k context and batch 1 the rule gives
  66 splits of ~8 tiles; the reduction then reads 66 x D x 4 bytes per query head, ~1.5% of
  the fp8 K/V bytes.
- BLOCK_N = 64 keys, 4 warps, 3 pipeline stages: a K tile of 64 x 128 fp8 is 8 KB; with V and
  3 stages the loop keeps ~48 KB in flight per program through cp.async (16-byte copies), which
  is above the ~32 KB per SM that the bandwidth needs once 2+ programs are resident.
- On CPU (Triton's interpreter) the count of programs costs time, not bandwidth: 8 programs.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

PROGRAMS_PER_SM = 4
MIN_TILES_PER_SPLIT = 4
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
INTERPRETER_PROGRAMS = 8


@dataclass(frozen=True)
class DecodeAttentionLaunch:
    """num_splits: pieces of the context per (sequence, KV head); block_n: keys per tile (a power
    of two >= 16); num_warps / num_stages: Triton launch options of the split kernel."""

    num_splits: int
    block_n: int = BLOCK_N
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES

    def __post_init__(self):
        if self.num_splits < 1 or self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"invalid decode-attention launch {self}: num_splits >= 1, block_n a power of two >= 16")


def choose_launch(batch: int, num_kv_heads: int, seq_len: int, num_sms: int | None, *,
                  programs_per_sm: int = PROGRAMS_PER_SM, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                  num_stages: int = NUM_STAGES) -> DecodeAttentionLaunch:
    """The launch for a cache of ``seq_len`` positions; ``num_sms`` None means Triton's interpreter.

    The keyword arguments replace the rule's constants (what a benchmark sweep varies)."""
    target_programs = INTERPRETER_PROGRAMS if num_sms is None else programs_per_sm * num_sms
    tiles = triton.cdiv(seq_len, block_n)
    max_splits = max(1, tiles // MIN_TILES_PER_SPLIT)
    num_splits = max(1, min(max_splits, triton.cdiv(target_programs, batch * num_kv_heads)))
    return DecodeAttentionLaunch(num_splits=num_splits, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
