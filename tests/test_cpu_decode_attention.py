"""torch.ops.quantkit.decode_attention_cpu (quantkit/kernels/csrc/decode_attention_cpu.cpp) against its pure-torch
reference (quantkit/kernels/decode_attention_cpu_reference.py) on fresh random caches of every stored type, over
head_dim 64 / 128 / 80, GQA ratios 1-7, batches of rows of different lengths, contexts across chunk and
block boundaries, on each code path this CPU runs.

Tolerance: the kernel reads the same stored values as the reference and differs only in fp32 arithmetic
(the reference is fp64): max |error| <= 2e-5 of max |out|. The avx512-bf16 and avx512-bf16-vbmi paths' bf16
and fp8 caches run bf16 dot products: against the reference with the query rounded as those paths round it,
each output within 2^-8 (bf16's unit roundoff, the softmax weights' rounding) of its weighted mean of |v|,
plus the fp32 tolerance. The avx512-bf16-vbmi path reads fp8 by byte permutes and must give the
avx512-bf16 path's bits.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels.cpu_extension import ISA_NAMES, cpu_kernel_isa, load_cpu_kernels
from quantkit.kernels.decode_attention_cpu_reference import decode_attention_cpu_reference

pytestmark = pytest.mark.skipif(not load_cpu_kernels().available, reason=load_cpu_kernels().reason)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8]
#: batch, query heads, kv heads, head_dim, positions of the longest row, block
SHAPES = [(1, 9, 3, 64, 300, 256), (2, 8, 2, 128, 700, 128), (3, 4, 4, 64, 37, 64), (1, 14, 2, 64, 1000, 512),
          (2, 6, 3, 80, 200, 256), (1, 8, 1, 128, 33, 32)]


def random_cache(shape, dtype, seed):
    """Fresh inputs of the op: q, key / value blocks in `dtype`, int8 token scales, fp8 head scales, lengths."""
    batch, heads, kv_heads, head_dim, longest, block = shape
    g = torch.Generator().manual_seed(seed)
    blocks = -(-longest // block)
    q = torch.randn(batch, heads, head_dim, generator=g)
    k = [torch.randn(batch, kv_heads, block // 16, head_dim, 16, generator=g) * 3 for _ in range(blocks)]
    v = [torch.randn(batch, kv_heads, block, head_dim, generator=g) for _ in range(blocks)]
    k_scales, v_scales, k_head, v_head = [], [], None, None
    if dtype == torch.int8:
        k_scales = [torch.rand(batch, kv_heads, block, generator=g) * 0.05 + 0.001 for _ in range(blocks)]
        v_scales = [torch.rand(batch, kv_heads, block, generator=g) * 0.05 + 0.001 for _ in range(blocks)]
        k = [torch.randint(-127, 128, t.shape, generator=g).to(torch.int8) for t in k]
        v = [torch.randint(-127, 128, t.shape, generator=g).to(torch.int8) for t in v]
    elif dtype == torch.float8_e4m3fn:  # every code but NaN, subnormals included (read as 0)
        k_head = torch.rand(kv_heads, generator=g) * 0.02 + 0.001
        v_head = torch.rand(kv_heads, generator=g) * 0.02 + 0.001
        k = [(t * 100).clamp(-448, 448).to(dtype) for t in k]
        v = [(t * 10 ** torch.empty(t.shape).uniform_(-3, 2.6, generator=g)).clamp(-448, 448).to(dtype) for t in v]
    else:
        k, v = [t.to(dtype) for t in k], [t.to(dtype) for t in v]
    lengths = torch.randint(max(1, longest - block), longest + 1, (batch,), generator=g)
    lengths[0] = longest
    return q, k, v, k_scales, v_scales, k_head, v_head, lengths


def code_paths():
    """The code paths this CPU runs (the kernel caps a path at the CPU's best)."""
    return ISA_NAMES[: ISA_NAMES.index(cpu_kernel_isa("auto")) + 1]


def bf16_products(isa: str, dtype: torch.dtype) -> bool:
    """Whether the path runs this cache type with bf16 dot products."""
    return isa in ("avx512-bf16", "avx512-bf16-vbmi") and dtype in (torch.bfloat16, torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_the_reference(dtype, shape):
    inputs = random_cache(shape, dtype, seed=sum(shape) + DTYPES.index(dtype))
    for isa in code_paths():
        bf16 = bf16_products(isa, dtype)
        want = decode_attention_cpu_reference(*inputs, 0.125, bf16_query=bf16)
        # what may differ: fp32 rounding, and for bf16 products the weights' rounding (2^-8 of the mean |v|)
        bound = 2e-5 * want.abs().max()
        if bf16:
            bound = bound + 2.0 ** -8 * decode_attention_cpu_reference(*inputs, 0.125, bf16_query=True,
                                                                        absolute_values=True)
        for chunk in (0, 32, 96):  # chosen by the kernel, and chunks that end inside and across blocks
            got = torch.ops.quantkit.decode_attention_cpu(*inputs, 0.125, chunk, ISA_NAMES.index(isa))
            worst = ((got - want).abs() / bound).max()
            assert worst <= 1, f"{isa}, chunk {chunk}: error {worst:.2g} times the bound"


def test_bf16_products_round_the_query_as_the_reference_does():
    """The avx512-bf16 path against the reference with and without the query's rounding: only the rounded
    reference is within the bound (the bound is not loose enough to hide the rounding). Keys 10x larger
    than the other tests': scores of tens, whose error from the query's rounding moves the weights by more
    than their own rounding."""
    if "avx512-bf16" not in code_paths():
        pytest.skip(f"this CPU has no AVX512_BF16 (best path: {cpu_kernel_isa('auto')})")
    q, k, *rest = random_cache((1, 9, 3, 64, 300, 256), torch.bfloat16, seed=5)
    inputs = (q, [t * 10 for t in k], *rest)
    got = torch.ops.quantkit.decode_attention_cpu(*inputs, 0.125, 0, ISA_NAMES.index("avx512-bf16"))
    mean_abs = decode_attention_cpu_reference(*inputs, 0.125, bf16_query=True, absolute_values=True)
    errors = [((got - decode_attention_cpu_reference(*inputs, 0.125, bf16_query=rounded)).abs()
               / (2.0 ** -8 * mean_abs)).max() for rounded in (True, False)]
    assert errors[0] <= 1 < errors[1], errors


@pytest.mark.parametrize("shape", [(1, 9, 3, 64, 300, 256), (2, 8, 2, 128, 700, 128), (1, 4, 1, 256, 67, 64),
                                   (2, 6, 3, 96, 200, 256)], ids=lambda s: "x".join(map(str, s)))
def test_fp8_byte_permutes_give_the_bf16_paths_bits(shape):
    """The avx512-bf16-vbmi path's fp8 read (byte permutes; head_dim 96 takes its keys only) against the
    avx512-bf16 path's (widening loads): the same products in the same order, so the same bits, over random
    caches of every code, odd lengths (an odd last value row) and chunks inside and across blocks."""
    if "avx512-bf16-vbmi" not in code_paths():
        pytest.skip(f"this CPU has no AVX512_BF16 with AVX512_VBMI (best path: {cpu_kernel_isa('auto')})")
    inputs = random_cache(shape, torch.float8_e4m3fn, seed=sum(shape))
    for chunk in (0, 32, 96):
        got, want = (torch.ops.quantkit.decode_attention_cpu(*inputs, 0.125, chunk, ISA_NAMES.index(isa))
                     for isa in ("avx512-bf16-vbmi", "avx512-bf16"))
        assert torch.equal(got, want), f"chunk {chunk}: max |difference| {(got - want).abs().max():.3g}"


@pytest.mark.parametrize("head_dim", [16, 64])
def test_fp8_reads_every_code_as_torch_does(head_dim):
    """One sequence of one position per e4m3 code (all but NaN, which is never stored): the output is
    the code's value times the scale, exactly as torch converts it; the 14 subnormal codes and the two
    zeros (exponent bits 0) read as 0. head_dim 64 runs the byte-permute read where the CPU has it."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # [254]
    batch = len(codes)
    v = torch.zeros(batch, 1, 32, head_dim, dtype=torch.uint8)
    v[:, 0, 0, 0] = codes
    k = torch.zeros(batch, 1, 2, head_dim, 16, dtype=torch.float8_e4m3fn)
    scale = torch.tensor([0.5])
    want = codes.view(torch.float8_e4m3fn).float() * 0.5
    want[(codes & 0x78) == 0] = 0.0
    assert (want != 0).sum() == 254 - 16
    for isa in code_paths():
        out = torch.ops.quantkit.decode_attention_cpu(torch.zeros(batch, 1, head_dim), [k], [v.view(torch.float8_e4m3fn)],
                                                      [], [], scale, scale, torch.ones(batch, dtype=torch.int64), 1.0,
                                                      0, ISA_NAMES.index(isa))
        assert torch.equal(out[:, 0, 0], want), isa


def test_refuses_bad_inputs():
    q, k, v, *_ = random_cache((1, 4, 2, 64, 40, 64), torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="length 65 outside"):
        torch.ops.quantkit.decode_attention_cpu(q, k, v, [], [], None, None, torch.tensor([65]), 0.125)
    with pytest.raises(RuntimeError, match="int8 cache needs a scale"):
        torch.ops.quantkit.decode_attention_cpu(q, [t.to(torch.int8) for t in k], [t.to(torch.int8) for t in v], [], [],
                                                None, None, torch.tensor([4]), 0.125)
