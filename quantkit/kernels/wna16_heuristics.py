"""Launch configurations of the Triton WNA16 kernels, chosen by rule rather than by autotuning.

Why rules and not ``triton.autotune``: multi-config autotuning needs a driver (it fails under
``TRITON_INTERPRET=1``), runs benchmarks on first use (a stall in the middle of serving), and breaks
CUDA-graph capture when a new shape shows up during capture. A rule is deterministic, free at run
time, and every configuration it can return is compile-checked for Hopper in the tests
(``all_configs``).

**Status: derived from a roofline argument and the generated PTX, not yet timed on a GPU.**
``python evals/kernels/bench_wna16.py --sweep`` (or ``bash evals/kernels/gpu_run.sh`` on an H200)
times the alternatives of ``sweep_configs`` next to the rule's pick for every shape and M and
prints the best; refit the constants below from that table and commit it with the measurements.

The rules (M = rows of x, N = out features, K = in features; a K block is the layout's interleave
block of 8 int32 word rows = 64 values at int4, 32 at int8, 128 at int2):

=============  =========  =======  ================  =====  =====================================
M              algorithm  BLOCK_M  BLOCK_N           warps  split-K
=============  =========  =======  ================  =====  =====================================
1              gemv       1        512 (2 x 4 cols)  2      K blocks / program so that ~4 programs
2              gemv       2        256               2      per SM run (at most 64, dividing K)
3 .. 16        dot        16       128               4      same aim
17 .. 64       dot        32 / 64  128               4      same aim
65 .. 2047     dot        64/128   128               4/8    1
>= 2048        dequant    --       64                4      -- (dequantize once, dense matmul)
=============  =========  =======  ================  =====  =====================================

Reasoning:

- Decode (M <= 2) is bound by the bytes of packed weights; the GEMV kernel streams them with 16-byte
  loads (``wna16_gemv``). Its cost per weight is ~5 instructions at M = 1 and grows by ~1.5 per extra
  row of x (one FMA plus the conversion of x): at M >= 3 the FP32 pipes, not memory, would bound
  it, so from M = 3 the tensor cores take over (``tl.dot`` with BLOCK_M = 16: the dequantization
  cost per weight no longer grows with M, and 16 rows cost the MMA units next to nothing).
- Split-K: the (M, N) tiles alone leave most of the 132 SMs idle at decode shapes (N = 4096 with
  BLOCK_N = 512 is 8 programs), so K is divided until about WAVES * SMs programs exist; partial
  sums are added by a second small kernel in a fixed order (deterministic).
- Prefill switch (dequantize once + cuBLAS vs fused ``tl.dot``): dequantizing costs
  K*N*(bits/8 + 2) bytes of traffic (read packed, write bf16) plus the matmul's own 2*K*N read,
  i.e. ~4.5*K*N bytes at int4: 4.5*K*N / 4.2 TB/s. The bf16 matmul itself takes 2*M*K*N / ~700
  TFLOP/s. Dequantize-once therefore reaches matmul / (matmul + dequant) = 1 / (1 + 375 / M) of
  cuBLAS speed: 0.58x at M = 512, 0.85x at 2048, 0.92x at 4096. The fused kernel reads the packed
  weight once per BLOCK_M rows and never writes it; it wins wherever its own efficiency e against
  cuBLAS exceeds that fraction, i.e. up to M = 375 e / (1 - e): ~1500 for e = 0.8. The switch is
  set to the next power of two, 2048, until ``--sweep`` measures e.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .wna16_layout import TRITON_WORD_BLOCK as K_BLOCK_WORDS

ALGORITHMS = ("gemv", "dot", "dequant")
REDUCTIONS = ("pass", "last")  # split-K sums: a second kernel, or the last program of a tile (gemv only)
DEFAULT_NUM_SMS = 132  # H100 SXM / H200
WAVES = 4  # programs per SM the split-K rule aims for in memory-bound shapes
MAX_SPLIT_K = 64
GEMV_MAX_M = 2  # the rule's choice; the kernel itself runs up to GEMV_MAX_BLOCK_M rows
GEMV_MAX_BLOCK_M = 4
GEMV_COLUMNS_PER_THREAD = 4  # one 16-byte load of int32 words
SPLITK_MAX_M = 64
DEQUANT_MIN_M = 2048


@dataclass(frozen=True)
class WNA16Config:
    """One launch configuration of quantkit.kernels.wna16_triton."""

    algo: str  # "gemv" | "dot" | "dequant"
    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    reduce: str = "pass"  # REDUCTIONS

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS or (self.reduce == "last" and self.algo != "gemv"):
            raise ValueError(f"reduce must be one of {REDUCTIONS} ('last' for gemv only), got {self.reduce!r}")
        if self.algo not in ALGORITHMS:
            raise ValueError(f"algo must be one of {ALGORITHMS}, got {self.algo!r}")
        for name in ("block_m", "block_n", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.algo == "gemv":
            lanes = GEMV_COLUMNS_PER_THREAD * 32 * self.num_warps
            if self.block_m > GEMV_MAX_BLOCK_M or self.block_n % lanes:
                raise ValueError(
                    f"gemv needs block_m <= {GEMV_MAX_BLOCK_M} and block_n a multiple of {lanes} "
                    f"(4 columns x 32 threads x {self.num_warps} warps), got {self.block_m}, {self.block_n}"
                )
        if self.algo == "dot" and (self.block_m < 16 or self.block_n < 16):
            raise ValueError("tl.dot needs block_m and block_n of at least 16")
        if self.split_k < 1 or (self.algo == "dequant" and self.split_k != 1):
            raise ValueError(f"split_k must be >= 1 (1 for dequant), got {self.split_k}")

    def as_dict(self) -> dict:
        return asdict(self)


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _prev_pow2(v: int) -> int:
    return 1 << max(0, v.bit_length() - 1)


def k_blocks(k: int, bits: int) -> int:
    """Interleave blocks along K (of K_BLOCK_WORDS int32 words each)."""
    return -(-(-(-k * bits // 32)) // K_BLOCK_WORDS)


def split_k_for(tiles: int, blocks: int, num_sms: int) -> int:
    """Power of two that brings tiles * split to about WAVES * num_sms (at most MAX_SPLIT_K and blocks)."""
    want = max(1, (WAVES * num_sms) // max(tiles, 1))
    return max(1, min(_prev_pow2(want), MAX_SPLIT_K, _prev_pow2(max(1, blocks))))


def choose_config(m: int, n: int, k: int, bits: int, num_sms: int = DEFAULT_NUM_SMS) -> WNA16Config:
    """The configuration used for x [m, k] @ W[n, k].T at `bits` bits (see the module table)."""
    if m < 1 or n < 1 or k < 1:
        raise ValueError(f"M, N, K must be positive, got {(m, n, k)}")
    blocks = k_blocks(k, bits)
    if m >= DEQUANT_MIN_M:
        return WNA16Config("dequant", block_m=1, block_n=64, num_warps=4, num_stages=1)
    if m <= GEMV_MAX_M:
        block_m = _next_pow2(m)
        block_n = 512 if block_m == 1 else 256
        split = split_k_for(-(-n // block_n), blocks, num_sms)
        return WNA16Config("gemv", block_m, block_n, split, num_warps=2, num_stages=1)
    if m <= SPLITK_MAX_M:
        block_m = 16 if m <= 16 else max(32, _next_pow2(m))
        block_n = 128
        split = split_k_for(-(-m // block_m) * -(-n // block_n), blocks, num_sms)
        return WNA16Config("dot", block_m, block_n, split, num_warps=4, num_stages=3)
    block_m = 64 if m <= 128 else 128
    return WNA16Config("dot", block_m, 128, 1, num_warps=4 if block_m == 64 else 8, num_stages=3)


def all_configs(bits: int, num_sms: int = DEFAULT_NUM_SMS) -> list[WNA16Config]:
    """Every distinct configuration choose_config can return at `bits`. The split-K value itself is a
    run-time argument; whether it is 1 or not changes the compiled kernel, so both are listed."""
    seen: dict[tuple, WNA16Config] = {}
    for m in list(range(1, SPLITK_MAX_M + 1)) + [65, 128, 129, 512, DEQUANT_MIN_M - 1, DEQUANT_MIN_M]:
        cfg = choose_config(m, 4096, 4096, bits, num_sms)
        splits = (1, 2) if cfg.algo != "dequant" and m <= SPLITK_MAX_M else (cfg.split_k,)
        for split in splits:
            c = WNA16Config(cfg.algo, cfg.block_m, cfg.block_n, split, cfg.num_warps, cfg.num_stages)
            seen.setdefault(tuple(c.as_dict().values()), c)
    return list(seen.values())
