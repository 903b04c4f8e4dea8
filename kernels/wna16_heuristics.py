"""Launch configurations of the Triton WNA16 kernels, chosen by rule rather than by autotuning.

Why rules and not ``triton.autotune``: multi-config autotuning needs a driver (it fails under
``TRITON_INTERPRET=1``), runs benchmarks on first use (a stall in the middle of serving), and breaks
CUDA-graph capture when a new shape shows up during capture. A rule is deterministic, free at run
time, and every configuration it can return is compile-checked for Hopper in the tests
(``all_configs``). ``evals/kernels/bench_wna16.py --sweep`` times the alternatives on a real GPU, so
the table below can be refitted from measurements.

The rules (M = rows of x, N = out features, K = in features, PW = 32 / bits values per int32 word):

=================  ==========  ==================  ==========  ========  ===========  =====================
M                  algorithm   BLOCK_M             BLOCK_N     BLOCK_KW  warps/stages split-K
=================  ==========  ==================  ==========  ========  ===========  =====================
1 .. 4             gemv        next pow2 of M      128 / 64    16        4 / 3        to fill ~4 waves
5 .. 64            dot         16 / 32 / 64        64          16        4 / 3        to fill ~4 waves
65 .. 1023         dot         64 (<=128) / 128    128         16        4 or 8 / 3   1
>= 1024            dequant     --                  64          16        4            -- (dense matmul)
=================  ==========  ==================  ==========  ========  ===========  =====================

BLOCK_KW is in int32 words along K (BLOCK_K = BLOCK_KW * PW values: 128 for int4, 64 for int8); 16
word rows keep each ``tl.dot`` at K = 16, the smallest tile Hopper MMA takes. Split-K divides the K
loop among programs when the (M, N) tiles alone would leave most SMs idle (decode shapes); partial
sums go to an fp32 workspace and a second small kernel adds them (deterministic, no atomics, works
for bf16).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

ALGORITHMS = ("gemv", "dot", "dequant")
DEFAULT_NUM_SMS = 132  # H100 SXM / H200
WAVES = 4  # programs per SM the split-K rule aims for in memory-bound shapes
MAX_SPLIT_K = 32
GEMV_MAX_M = 4
SPLITK_MAX_M = 64
DEQUANT_MIN_M = 1024
BLOCK_KW = 16


@dataclass(frozen=True)
class WNA16Config:
    """One launch configuration of quantkit.kernels.wna16_triton."""

    algo: str  # "gemv" | "dot" | "dequant"
    block_m: int
    block_n: int
    block_kw: int  # int32 words along K per tile
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHMS:
            raise ValueError(f"algo must be one of {ALGORITHMS}, got {self.algo!r}")
        for name in ("block_m", "block_n", "block_kw"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.algo == "dot" and (self.block_m < 16 or self.block_n < 16 or self.block_kw < 16):
            raise ValueError("tl.dot needs block_m, block_n and block_kw of at least 16")
        if self.split_k < 1 or (self.algo == "dequant" and self.split_k != 1):
            raise ValueError(f"split_k must be >= 1 (1 for dequant), got {self.split_k}")

    def as_dict(self) -> dict:
        return asdict(self)


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _prev_pow2(v: int) -> int:
    return 1 << max(0, v.bit_length() - 1)


def split_k_for(tiles: int, k_tiles: int, num_sms: int) -> int:
    """Largest power of two that brings tiles * split to about WAVES * num_sms, each split >= 2 K tiles."""
    want = max(1, (WAVES * num_sms) // max(tiles, 1))
    split = min(_prev_pow2(want), MAX_SPLIT_K, _prev_pow2(max(1, k_tiles // 2)))
    return max(1, split)


def choose_config(m: int, n: int, k: int, bits: int, num_sms: int = DEFAULT_NUM_SMS) -> WNA16Config:
    """The configuration used for x [m, k] @ W[n, k].T at `bits` bits (see the module table)."""
    if m < 1 or n < 1 or k < 1:
        raise ValueError(f"M, N, K must be positive, got {(m, n, k)}")
    per_word = 32 // bits
    block_k = BLOCK_KW * per_word
    k_tiles = -(-k // block_k)
    if m >= DEQUANT_MIN_M:
        return WNA16Config("dequant", block_m=1, block_n=64, block_kw=BLOCK_KW, num_warps=4, num_stages=1)
    if m <= GEMV_MAX_M:
        block_m = _next_pow2(m)
        block_n = 128 if block_m == 1 else 64
        split = split_k_for(-(-n // block_n), k_tiles, num_sms)
        return WNA16Config("gemv", block_m, block_n, BLOCK_KW, split, num_warps=4, num_stages=3)
    if m <= SPLITK_MAX_M:
        block_m = max(16, _next_pow2(m))
        block_n = 64
        split = split_k_for(-(-m // block_m) * -(-n // block_n), k_tiles, num_sms)
        return WNA16Config("dot", block_m, block_n, BLOCK_KW, split, num_warps=4, num_stages=3)
    block_m = 64 if m <= 128 else 128
    return WNA16Config("dot", block_m, 128, BLOCK_KW, 1, num_warps=4 if block_m == 64 else 8, num_stages=3)


def all_configs(bits: int, num_sms: int = DEFAULT_NUM_SMS) -> list[WNA16Config]:
    """Every distinct configuration choose_config can return at `bits`. The split-K value itself is a
    run-time argument; whether it is 1 or not changes the compiled kernel, so both are listed."""
    seen: dict[tuple, WNA16Config] = {}
    for m in list(range(1, SPLITK_MAX_M + 1)) + [65, 128, 129, 512, 1023, DEQUANT_MIN_M]:
        cfg = choose_config(m, 4096, 4096, bits, num_sms)
        splits = (1, 2) if cfg.algo != "dequant" and m <= SPLITK_MAX_M else (cfg.split_k,)
        for split in splits:
            c = WNA16Config(cfg.algo, cfg.block_m, cfg.block_n, cfg.block_kw, split, cfg.num_warps, cfg.num_stages)
            seen.setdefault((c.algo, c.block_m, c.block_n, c.block_kw, c.split_k, c.num_warps, c.num_stages), c)
    return list(seen.values())
