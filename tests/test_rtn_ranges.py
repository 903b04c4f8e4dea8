"""RTN's range rules: the "signed" symmetric scale (llama.cpp's Q4_0 rule within positive scales) and the
MSE observer, against a direct computation on fresh random weights."""

from __future__ import annotations

import pytest
import torch

from quantkit.algorithms.rtn import RTNOptions, rtn_quantize
from quantkit.core.primitives import compute_qparams, dequantize
from quantkit.quantization.recipe import load_recipe
from quantkit.core.scheme import QuantScheme


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(5, 32), (16, 128), (3, 96)])
def test_signed_rule_puts_the_extreme_on_its_end_level(bits, shape):
    scheme = QuantScheme(num_bits=bits, symmetric=True, strategy="group", group_size=32)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0] * bits))
    qw = rtn_quantize(w, scheme, RTNOptions(symmetric_scale="signed"))
    groups = w.reshape(shape[0], -1, 32)
    q = qw.q.reshape(shape[0], -1, 32).long()
    idx = groups.abs().argmax(-1, keepdim=True)  # the extreme of each group
    extreme = groups.gather(-1, idx).squeeze(-1)
    level = q.gather(-1, idx).squeeze(-1)
    expect = torch.where(extreme < 0, torch.full_like(level, scheme.qmin), torch.full_like(level, scheme.qmax))
    assert torch.equal(level, expect)
    divisor = torch.where(extreme < 0, float(-scheme.qmin), float(scheme.qmax))
    assert torch.allclose(qw.scale, extreme.abs() / divisor, rtol=1e-6, atol=0)
    err = (qw.dequantize() - w).abs().reshape(shape[0], -1, 32)
    assert (err <= qw.scale.unsqueeze(-1) * (1 + 1e-5)).all()  # a value near +|extreme| loses at most one step
    # the negative extreme is now exact: quantkit's absmax / qmax rule left the level qmin unused
    old = rtn_quantize(w, scheme)
    assert int(old.q.min()) > scheme.qmin and int(qw.q.min()) == scheme.qmin


def test_mse_observer_never_rounds_worse_than_min_max():
    g = torch.Generator().manual_seed(3)
    for scheme in (QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32),
                   QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=32)):
        for rule in ("qmax", "signed"):
            w = torch.randn(24, 128, generator=g) * torch.rand(24, 1, generator=g)
            plain = rtn_quantize(w, scheme, RTNOptions(symmetric_scale=rule))
            searched = rtn_quantize(w, scheme, RTNOptions(symmetric_scale=rule, observer="mse"))
            e_plain = (plain.dequantize() - w).pow(2).reshape(24, -1, 32).sum(-1)
            e_mse = (searched.dequantize() - w).pow(2).reshape(24, -1, 32).sum(-1)
            assert (e_mse <= e_plain * (1 + 1e-6) + 1e-12).all()
            assert e_mse.sum() < e_plain.sum()


def test_scales_are_rounded_to_the_stored_dtype_before_the_weights():
    scheme = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32)
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    qw = rtn_quantize(w, scheme, RTNOptions(symmetric_scale="signed"), scale_dtype=torch.float16)
    assert torch.equal(qw.scale, qw.scale.half().float())
    scale, _ = compute_qparams(w, scheme, symmetric_scale="signed", scale_dtype=torch.float16)
    assert torch.equal(qw.scale, scale)
    assert torch.equal(qw.dequantize(), dequantize(qw.q, scale, None, scheme))


def test_recipe_options():
    recipe = load_recipe({"version": 1, "weights": {"num_bits": 4, "strategy": "group", "group_size": 32},
                          "targets": ["Linear"], "algorithm": {"name": "rtn", "symmetric_scale": "signed",
                                                               "observer": "mse"}})
    assert recipe.algorithm.options == RTNOptions(symmetric_scale="signed", observer="mse")
    assert load_recipe("w4a16-rtn-g32").algorithm.options.symmetric_scale == "signed"
    assert load_recipe("w4a16-gptq-g32").algorithm.options.symmetric_scale == "signed"
    for bad in ({"symmetric_scale": "absmax"}, {"observer": "percentile"}):
        with pytest.raises(ValueError):
            load_recipe({"version": 1, "weights": {"num_bits": 4, "strategy": "group", "group_size": 32},
                         "targets": ["Linear"], "algorithm": {"name": "rtn", **bad}})
