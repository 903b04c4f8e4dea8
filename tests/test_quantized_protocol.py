"""The quantized-weight and quantized-layer protocols, and the registry's quantizer for linears no calibration
reaches: what quantkit.quantize and the calibration runner ask instead of switching on types."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantkit.algorithms.registry import ALGORITHMS, Algorithm
from quantkit.algorithms.rtn import RTNOptions, rtn_quantize
from quantkit.core.scheme import QuantScheme, grid_scheme
from quantkit.gguf.linear import GgufLinear
from quantkit.modules.quant_linear import QuantLinear
from quantkit.modules.quantized_layer import (
    COMPRESSED_TENSORS, GGUF, holds_format, is_quantized_layer, to_layer,
)

INT4 = QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=32)


def _weight(n=64, k=256, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("scheme, layer_class, format", [
    (INT4, QuantLinear, COMPRESSED_TENSORS),
    (grid_scheme("q4_k"), GgufLinear, GGUF),
])
def test_each_weight_becomes_its_layer(scheme, layer_class, format):
    w = _weight()
    qweight = rtn_quantize(w, scheme)
    assert qweight.shape == tuple(w.shape)
    bias = torch.randn(w.shape[0])
    layer = to_layer(qweight, bias, dtype=torch.bfloat16)
    assert type(layer) is layer_class and is_quantized_layer(layer)
    assert holds_format(layer, format) and not holds_format(layer, ({COMPRESSED_TENSORS, GGUF} - {format}).pop())
    assert torch.equal(layer.bias, bias.to(torch.bfloat16))
    x = torch.randn(3, w.shape[1])
    want = x @ qweight.fields_rounded_to(torch.bfloat16).dequantize().T + bias.to(torch.bfloat16).float()
    torch.testing.assert_close(layer.to(torch.float32)(x), want, rtol=1e-4, atol=1e-4)
    assert not is_quantized_layer(nn.Linear(4, 4))


def test_fields_rounded_to_a_dtype():
    """An integer weight's scales take the layer's dtype; a GGUF grid's fields stay as its blocks hold them."""
    w = _weight(seed=1)
    qweight = rtn_quantize(w, INT4)
    rounded = qweight.fields_rounded_to(torch.bfloat16)
    assert torch.equal(rounded.scale, qweight.scale.to(torch.bfloat16).float())
    assert rounded.q is qweight.q and rounded.zero_point is qweight.zero_point
    grid = rtn_quantize(w, grid_scheme("q4_k"))
    assert grid.fields_rounded_to(torch.bfloat16) is grid


def test_the_registry_quantizes_linears_no_calibration_reaches():
    """RTN with the recipe's options; a calibrated algorithm's leftovers with RTN's defaults."""
    w = _weight(seed=2)
    scheme = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32)
    options = RTNOptions(observer="mse")
    got = ALGORITHMS["rtn"].linear_quantizer(options)(w, scheme, torch.bfloat16)
    want = rtn_quantize(w, scheme, options, scale_dtype=torch.bfloat16)
    assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)
    plain = rtn_quantize(w, scheme, RTNOptions(), scale_dtype=torch.bfloat16)
    assert not torch.equal(plain.scale, want.scale)  # the options matter here
    for name, algorithm in ALGORITHMS.items():
        if algorithm.needs_calibration:
            got = algorithm.linear_quantizer(algorithm.options())(w, scheme, torch.bfloat16)
            assert algorithm.leftovers == "rtn", name
            assert torch.equal(got.q, plain.q) and torch.equal(got.scale, plain.scale), name


def test_an_algorithm_says_how_it_runs_exactly_once():
    with pytest.raises(ValueError, match="exactly when it needs calibration"):
        Algorithm("x", RTNOptions, needs_calibration=True, processor="m:C")  # no leftovers
    with pytest.raises(ValueError, match="exactly when it needs calibration"):
        Algorithm("x", RTNOptions, needs_calibration=False)  # no quantize_linear


@pytest.mark.parametrize("scheme", [INT4, QuantScheme(num_bits=8, symmetric=True, strategy="channel"),
                                    grid_scheme("q4_k"), grid_scheme("q6_k"), grid_scheme("q4_0")],
                         ids=lambda s: s.grid if s.grid != "uniform" else f"int{s.num_bits}-{s.strategy}")
def test_level_grid_gives_the_weight_and_other_levels_make_another(scheme):
    """level_grid() dequantizes to the weight; with_levels puts other levels on the same fields."""
    w = _weight(seed=2)
    qweight = rtn_quantize(w, scheme)
    grid = qweight.level_grid()
    torch.testing.assert_close(grid.dequantize(grid.levels), qweight.dequantize(), rtol=1e-6, atol=1e-7)
    assert torch.equal(qweight.with_levels(grid.levels).dequantize(), qweight.dequantize())
    g = torch.Generator().manual_seed(3)
    other = torch.randint(int(grid.lowest), int(grid.highest) + 1, tuple(grid.levels.shape), generator=g).float()
    moved = qweight.with_levels(other)
    assert type(moved) is type(qweight) and torch.equal(moved.level_grid().levels, other)
    torch.testing.assert_close(moved.dequantize(), grid.dequantize(other), rtol=1e-6, atol=1e-7)
