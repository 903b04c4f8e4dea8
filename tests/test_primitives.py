import pytest
import torch

from quantkit.core.primitives import (
    compute_qparams, dequantize, dequantize_fp8, fake_quantize, fp8_scale, quantize, quantize_fp8,
)
from quantkit.core.scheme import QuantScheme

SCHEMES = [
    QuantScheme(num_bits=8, strategy="channel"),
    QuantScheme(num_bits=8, strategy="group", group_size=64),
    QuantScheme(num_bits=4, strategy="group", group_size=32),
    QuantScheme(num_bits=4, strategy="group", group_size=128),
    QuantScheme(num_bits=4, strategy="channel"),
    QuantScheme(num_bits=4, strategy="group", group_size=128, symmetric=False),
    QuantScheme(num_bits=8, strategy="channel", symmetric=False),
]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe())
def test_round_trip_error_within_half_step(scheme):
    w = torch.randn(96, 256) * torch.rand(96, 1) * 3  # rows with different ranges
    scale, zp = compute_qparams(w, scheme)
    g = scheme.groups_for(256)
    assert scale.shape == (96, g) and (zp is None) == scheme.symmetric
    q = quantize(w, scale, zp, scheme)
    assert q.dtype == torch.int8 and int(q.min()) >= scheme.qmin and int(q.max()) <= scheme.qmax
    err = (dequantize(q, scale, zp, scheme) - w).abs()
    step = scale.repeat_interleave(256 // g, dim=1)
    assert bool((err <= step / 2 + 1e-6).all()), "min-max quantization must round to the nearest level"


def test_asymmetric_beats_symmetric_on_shifted_weights():
    w = torch.rand(64, 128) + 0.5  # all positive: asymmetric uses the whole range
    sym = QuantScheme(num_bits=4, strategy="group", group_size=128)
    asym = QuantScheme(num_bits=4, strategy="group", group_size=128, symmetric=False)
    assert (fake_quantize(w, asym) - w).pow(2).mean() < 0.5 * (fake_quantize(w, sym) - w).pow(2).mean()


def test_bits_matter():
    w = torch.randn(64, 128)
    e8 = (fake_quantize(w, QuantScheme(num_bits=8, strategy="channel")) - w).pow(2).mean()
    e4 = (fake_quantize(w, QuantScheme(num_bits=4, strategy="channel")) - w).pow(2).mean()
    assert e8 * 100 < e4


def test_fp8_saturates_instead_of_nan():
    scale = fp8_scale(torch.tensor(2.0))
    x = torch.tensor([0.5, -1.0, 2.0, 1e6, -1e6, 3.0])
    q = quantize_fp8(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    back = dequantize_fp8(q, scale)
    assert torch.isfinite(back).all()
    assert back[3] == pytest.approx(2.0) and back[4] == pytest.approx(-2.0)  # saturated to +-448 * scale
    assert torch.allclose(back[:3], x[:3], rtol=0.07)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_bits=3), "num_bits"),
    (dict(strategy="block"), "strategy"),
    (dict(strategy="group", group_size=100), "group_size"),
    (dict(strategy="channel", group_size=128), "only used with strategy 'group'"),
    (dict(type="float", num_bits=4), "float num_bits"),
])
def test_scheme_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantScheme(**kwargs)


def test_a_group_that_does_not_divide_in_features_leaves_a_ragged_last_group():
    scheme = QuantScheme(num_bits=4, strategy="group", group_size=64)
    assert scheme.groups_for(96) == 2 and not scheme.divides(96)
    w = torch.randn(3, 96)
    scale, _ = compute_qparams(w, scheme)  # the last group: inputs 64..95
    torch.testing.assert_close(scale[:, 1], w[:, 64:].abs().amax(dim=1) / 7)
    with pytest.raises(ValueError, match="does not divide in_features 96"):
        scheme.fitted(96, "error")


@pytest.mark.parametrize("bits", [4, 8])
def test_half_range_symmetric_scale_divides_absmax_by_half_the_signed_range(bits):
    scheme = QuantScheme(num_bits=bits, strategy="group", group_size=32)
    w = torch.randn(8, 64) * torch.rand(8, 1) * 3
    qmax_scale, _ = compute_qparams(w, scheme)
    half_scale, zp = compute_qparams(w, scheme, symmetric_scale="half_range")
    absmax = w.abs().reshape(8, 2, 32).amax(-1)
    torch.testing.assert_close(qmax_scale, absmax / scheme.qmax)
    torch.testing.assert_close(half_scale, absmax / ((scheme.qmax - scheme.qmin) / 2))
    assert zp is None
    q = quantize(w, half_scale, None, scheme)
    assert int(q.max()) <= scheme.qmax and int(q.min()) >= scheme.qmin
    with pytest.raises(ValueError, match="symmetric_scale must be one of"):
        compute_qparams(w, scheme, symmetric_scale="absmax")


def test_scale_dtype_rounds_scales_to_their_storage_and_keeps_zero_points():
    scheme = QuantScheme(num_bits=4, strategy="group", group_size=32, symmetric=False)
    w = torch.randn(8, 64) * 3
    scale, zp = compute_qparams(w, scheme)
    stored, stored_zp = compute_qparams(w, scheme, scale_dtype=torch.bfloat16)
    assert stored.dtype == torch.float32 and torch.equal(stored, scale.to(torch.bfloat16).float())
    assert torch.equal(stored_zp, zp) and not torch.equal(stored, scale)
