"""AWQ: scale search, clipping search and folding, on single layers and on a block's sub-layers."""

import pytest
import torch
from torch import nn

from quantkit.algorithms.awq import (
    awq_quantize, channel_scales, mean_abs_update, scaled_effective_weight, search_clip, search_scales,
    weight_channel_mean,
)
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.calibration.awq_processor import can_fold, fold_scales
from quantkit.core.primitives import fake_quantize
from quantkit.core.scheme import QuantScheme

W4_G128 = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=128)
W4_G128_ASYM = QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=128)
W4_G64 = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=64)


def outlier_inputs(m: int, k: int, seed: int) -> torch.Tensor:
    """[m, k] activations where a few channels are 10-50x larger than the rest (as in LLMs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    big = torch.randperm(k, generator=g)[: k // 32]
    x[:, big] *= 10 + 40 * torch.rand(big.numel(), generator=g)
    return x


def awq_layer(w: torch.Tensor, x: torch.Tensor, scheme: QuantScheme, clip: bool = True) -> torch.Tensor:
    """AWQ on one linear fed by a foldable producer: the effective fp32 weight [N, K] it applies to x."""
    x_mean, _ = mean_abs_update(None, 0, x)
    w_mean = weight_channel_mean([w], scheme.group_size)
    reference = x @ w.T

    def loss(s):
        return ((x @ scaled_effective_weight(w, s, scheme).T - reference) ** 2).mean().item()

    s, _, _ = search_scales(x_mean, loss, grid=20, w_mean=w_mean)
    ws, xs = w * s, x / s  # folding: columns * s, producer's output / s
    ratio = search_clip(ws, xs, scheme) if clip else None
    return awq_quantize(ws, scheme, ratio).dequantize() / s


@pytest.mark.parametrize("scheme", [W4_G128, W4_G128_ASYM, W4_G64])
def test_lower_output_error_than_rtn(scheme):
    k, n = 256, 128
    seed = scheme.group_size + scheme.symmetric
    x = outlier_inputs(1024, k, seed)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    err = lambda wq: ((x @ w.T - x @ wq.T) ** 2).mean().item()  # noqa: E731
    err_rtn = err(rtn_quantize(w, scheme).dequantize())
    err_scaled = err(awq_layer(w, x, scheme, clip=False))
    err_awq = err(awq_layer(w, x, scheme, clip=True))
    assert err_scaled < 0.8 * err_rtn, (err_scaled, err_rtn)
    assert err_awq <= err_scaled * 1.02, (err_awq, err_scaled)


def test_scale_candidates_include_rtn_and_the_least_loss_wins():
    x_mean = torch.rand(64) + 0.1
    torch.testing.assert_close(channel_scales(x_mean, 0.0), torch.ones(64))
    s = channel_scales(x_mean, 0.5)
    torch.testing.assert_close((s.max() * s.min()).sqrt(), torch.tensor(1.0))
    torch.testing.assert_close(s / s[0], (x_mean / x_mean[0]).sqrt())
    w_mean = torch.rand(64) + 0.1
    duo = channel_scales(x_mean, 0.25, w_mean)
    expected = x_mean**0.25 / (w_mean**0.75 + 1e-4)
    torch.testing.assert_close(duo / duo[0], expected / expected[0])

    target = channel_scales(x_mean, 0.35, w_mean)
    best, ratio, losses = search_scales(x_mean, lambda c: (c - target).abs().sum().item(), grid=20, w_mean=w_mean)
    assert ratio == pytest.approx(0.35) and len(losses) == 21 and min(losses) == losses[1 + 7]
    torch.testing.assert_close(best, target)
    # when no scaling helps, s = 1 (plain RTN) is kept
    best, ratio, losses = search_scales(x_mean, lambda c: (c - 1).abs().sum().item(), grid=20, w_mean=w_mean)
    assert ratio is None and torch.equal(best, torch.ones(64))


def test_weight_channel_mean_is_relative_to_the_group_max():
    w = torch.tensor([[1.0, -2.0, 4.0, 0.0], [3.0, 3.0, -1.0, 1.0]])
    expected = torch.tensor([(0.5 + 1.0) / 2, (1.0 + 1.0) / 2, (1.0 + 1.0) / 2, (0.0 + 1.0) / 2])
    torch.testing.assert_close(weight_channel_mean([w[:1], w[1:]], 2), expected, atol=1e-5, rtol=1e-5)


def test_mean_abs_is_a_running_mean():
    x = torch.randn(100, 32)
    mean, n = None, 0
    for part in x.split([30, 70]):
        mean, n = mean_abs_update(mean, n, part)
    torch.testing.assert_close(mean, x.abs().mean(0))


def test_clip_search_shrinks_outlier_groups_and_never_does_worse():
    k, n = 128, 32
    g = torch.Generator().manual_seed(4)
    w = torch.randn(n, k, generator=g) * 0.02
    w[torch.arange(n), torch.randint(0, k, (n,), generator=g)] = 0.5  # one large weight per row
    x = torch.randn(512, k, generator=g)
    ratio = search_clip(w, x, W4_G128)
    assert ratio.shape == (n, 1) and (ratio <= 1).all() and (ratio >= 0.5).all() and (ratio < 1).any()
    err = lambda wq: ((x @ w.T - x @ wq.T) ** 2).mean(0)  # noqa: E731  per output row
    clipped = err(awq_quantize(w, W4_G128, ratio).dequantize())
    plain = err(fake_quantize(w, W4_G128))
    assert (clipped <= plain * (1 + 1e-5)).all() and clipped.sum() < plain.sum()


class _RMSNorm(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(k) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def test_folding_keeps_the_float_function():
    torch.manual_seed(0)
    k = 128
    norm, q, v = _RMSNorm(k), nn.Linear(k, 64, bias=True), nn.Linear(k, k, bias=True)
    o = nn.Linear(k, 96)
    x = torch.randn(10, k)
    s = torch.rand(k) + 0.5
    with torch.no_grad():
        before = (q(norm(x)), o(v(norm(x))))
        assert can_fold(norm, [q, v]) and can_fold(v, [o]) and not can_fold(q, [o])
        fold_scales(norm, [q, v], s)
        fold_scales(v, [o], torch.rand(k) + 0.5)
        after = (q(norm(x)), o(v(norm(x))))
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
