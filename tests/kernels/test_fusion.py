"""concat_wna16_weights: one linear over weights concatenated along N equals the parts side by side."""

from __future__ import annotations

import pytest
import torch

import quantkit.kernels as qk

from .wna16_cases import Scheme, random_weight, rel_mean_error, tolerance

K = 256


@pytest.mark.parametrize("bits,group", [(4, 128), (8, None)], ids=("int4-g128", "int8-ch"))
def test_fused_linear_equals_the_parts(bits, group):
    gen = torch.Generator()
    gen.seed()
    sizes = (64, 32, 48)  # N of int4 parts not a multiple of 8 values per zero-point word: repacked
    parts = [random_weight(Scheme(bits, group, symmetric=i == 1), n, K, torch.bfloat16, gen)
             for i, n in enumerate(sizes)]
    packed, scale, zero = qk.concat_wna16_weights(
        [(w.weight_packed, w.weight_scale, w.weight_zero_point) for w in parts], bits=bits, in_features=K)
    assert packed.shape[0] == scale.shape[0] == sum(sizes) and zero is not None
    fused_w = qk.dequantize_wna16(packed, scale.float(), zero, bits, K)
    torch.testing.assert_close(fused_w, torch.cat([w.dequantized for w in parts]), rtol=0, atol=0)
    x = torch.randn(3, K, generator=gen).to(torch.bfloat16)
    n = sum(sizes)
    for backend in ("torch", "reference"):
        prep = qk.prepare_wna16(packed, scale, zero, bits=bits, in_features=K, backend=backend)
        fused = qk.wna16_linear(x, prep, bits=bits, in_features=K, out_features=n, backend=backend)
        separate = []
        for w in parts:
            p = qk.prepare_wna16(w.weight_packed, w.weight_scale, w.weight_zero_point, bits=bits, in_features=K,
                                 backend=backend)
            separate.append(qk.wna16_linear(x, p, bits=bits, in_features=K, out_features=w.out_features,
                                            backend=backend))
        assert rel_mean_error(fused, torch.cat(separate, dim=-1).double()) <= tolerance(torch.bfloat16)


def test_all_symmetric_parts_stay_symmetric_and_mismatches_raise():
    gen = torch.Generator().manual_seed(0)
    a = random_weight(Scheme(4, 64, True), 32, K, torch.float16, gen)
    b = random_weight(Scheme(4, 64, True), 16, K, torch.float16, gen)
    _, _, zero = qk.concat_wna16_weights([(a.weight_packed, a.weight_scale, None),
                                          (b.weight_packed, b.weight_scale, None)], bits=4, in_features=K)
    assert zero is None
    c = random_weight(Scheme(4, 128, True), 16, K, torch.float16, gen)
    with pytest.raises(ValueError, match="share the group size"):
        qk.concat_wna16_weights([(a.weight_packed, a.weight_scale, None), (c.weight_packed, c.weight_scale, None)],
                                bits=4, in_features=K)
    with pytest.raises(ValueError, match="at least one part"):
        qk.concat_wna16_weights([], bits=4, in_features=K)
