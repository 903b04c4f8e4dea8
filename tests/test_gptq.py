"""GPTQ math: against the unblocked textbook recursion, against RTN, and on degenerate Hessians."""

import warnings

import pytest
import torch

from quantkit.algorithms.gptq import CholeskyWarning, GPTQOptions, HessianSum, gptq_quantize, hessian_of
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.core.primitives import compute_qparams, dequantize, mse_clip_ratio, quantize
from quantkit.core.scheme import QuantScheme

W4_G32 = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32)
W4_G32_ASYM = QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=32)
W4_CHANNEL = QuantScheme(num_bits=4, symmetric=True, strategy="channel")
W8_CHANNEL = QuantScheme(num_bits=8, symmetric=True, strategy="channel")
W4_G128 = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=128)
W4_G128_ASYM = QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=128)


def correlated_inputs(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """[m, k] inputs with correlated channels of very different magnitudes (as in LLM activations)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g, dtype=torch.float64) / k**0.5
    x = torch.randn(m, k, generator=g, dtype=torch.float64) @ (torch.eye(k, dtype=torch.float64) + 0.7 * mix)
    x = x * torch.exp(torch.randn(k, generator=g, dtype=torch.float64))  # per-channel magnitudes
    return x.to(dtype)


def textbook_gptq(w, h, scheme: QuantScheme, damp_percent: float, act_order: bool):
    """Unblocked OBQ/GPTQ recursion with an explicit inverse Hessian, downdated after every column (fp64).

    Quantize column i; spread its error over the remaining columns with the row of H^-1; remove i from
    H^-1 (H^-1 <- H^-1 - H^-1[:, i] H^-1[i, :] / H^-1[i, i]). Returns int q [N, K] in the original order.
    """
    w, h = w.double().clone(), h.double().clone()
    n, k = w.shape
    gs = k // scheme.groups_for(k)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    one = QuantScheme(num_bits=scheme.num_bits, symmetric=scheme.symmetric, strategy="channel")

    def params(cols):
        s, z = compute_qparams(cols, one)
        return s[:, 0].double(), (None if z is None else z[:, 0].double())

    static = {}
    if act_order or scheme.strategy == "channel":
        for g in range(k // gs):
            static[g] = params(w[:, g * gs:(g + 1) * gs])
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    hinv = torch.linalg.inv(h + damp_percent * torch.mean(torch.diag(h)) * torch.eye(k, dtype=torch.float64))
    q = torch.zeros(n, k, dtype=torch.float64)
    current = None
    for i in range(k):
        g = int(perm[i]) // gs
        if static:
            s, z = static[g]
        else:
            if i % gs == 0:
                current = params(w[:, i:i + gs])
            s, z = current
        qi = torch.round(w[:, i] / s) + (0 if z is None else z)
        qi = qi.clamp(scheme.qmin, scheme.qmax)
        deq = (qi - (0 if z is None else z)) * s
        q[:, i] = qi
        err = (w[:, i] - deq) / hinv[i, i]
        w[:, i:] -= err.unsqueeze(1) * hinv[i, i:].unsqueeze(0)
        hinv = hinv - hinv[:, i:i + 1] @ hinv[i:i + 1, :] / hinv[i, i]
    return q[:, torch.argsort(perm)].to(torch.int8)


@pytest.mark.parametrize("scheme, shape, block_size", [
    (W4_CHANNEL, (16, 32), 8),
    (W8_CHANNEL, (16, 32), 8),
    (W4_G32, (16, 64), 32),
    (W4_G32_ASYM, (16, 64), 32),
])
@pytest.mark.parametrize("act_order", [False, True])
def test_matches_unblocked_textbook_recursion(scheme, shape, block_size, act_order):
    n, k = shape
    seed = 1000 * k + 10 * block_size + act_order
    x = correlated_inputs(4 * k, k, seed, torch.float64)
    h = hessian_of(x)
    h = h.double()  # the Hessian is fp32; compare both algorithms on the same H
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    options = GPTQOptions(damp_percent=0.01, block_size=block_size, act_order=act_order)
    ours = gptq_quantize(w, h, scheme, options)
    expected = textbook_gptq(w, h, scheme, 0.01, act_order)
    assert torch.equal(ours.q, expected)
    if act_order or scheme.strategy == "channel":
        # static groups: scales come from the original column groups, so no g_idx is needed
        scale, zero = compute_qparams(w, scheme)
        torch.testing.assert_close(ours.scale, scale)


@pytest.mark.parametrize("act_order", [False, True])
def test_half_range_scale_rule_is_an_option(act_order):
    """symmetric_scale="half_range" gives absmax / ((qmax - qmin) / 2) scales (llm-compressor's convention)."""
    k = 64
    x = correlated_inputs(4 * k, k, 7, torch.float64)
    h = hessian_of(x)
    w = torch.randn(16, k, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    default = gptq_quantize(w, h.double(), W4_G32, GPTQOptions(act_order=act_order))
    half = gptq_quantize(w, h.double(), W4_G32, GPTQOptions(act_order=act_order, symmetric_scale="half_range"))
    if act_order:  # static groups: scales of the original weight's groups
        scale, _ = compute_qparams(w, W4_G32, symmetric_scale="half_range")
        torch.testing.assert_close(half.scale, scale)
    torch.testing.assert_close(half.scale[:, 0], default.scale[:, 0] * 7 / 7.5)  # the first group sees the same columns
    with pytest.raises(ValueError, match="symmetric_scale must be one of"):
        GPTQOptions(symmetric_scale="absmax/7.5")


def test_hessian_is_the_mean_of_xtx_whatever_the_batching_of_the_windows():
    """2 XᵀX / n, and bit for bit the same fp32 matrix for any batching or order of the same windows (what
    makes processes that share the windows agree with one process), symmetric."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 40, 1100, generator=g) * torch.rand(1100, generator=g)  # 12 windows of 40 tokens; K > PANEL
    whole = hessian_of(x)
    assert whole.dtype == torch.float32 and torch.equal(whole, whole.T)
    flat = x.double().reshape(-1, 1100)
    torch.testing.assert_close(whole.double(), 2 * flat.T @ flat / 480, rtol=1e-5, atol=1e-6)
    acc = HessianSum()
    for part in (x[7:], x[:2], x[2:3], x[3:7]):
        acc.add(part)
    assert acc.count == 480 and torch.equal(acc.hessian(), whole)
    # rows without windows are one unit: any [M, K] input works, with its own rounding
    torch.testing.assert_close(hessian_of(flat.float()), whole, rtol=1e-5, atol=1e-6)


def output_error(x, w, wq):
    return ((x @ w.T - x @ wq.T) ** 2).mean().item()


@pytest.mark.parametrize("scheme", [W4_G128, W4_G128_ASYM, W4_CHANNEL, W8_CHANNEL])
@pytest.mark.parametrize("act_order", [False, True])
def test_lower_output_error_than_rtn(scheme, act_order):
    k, n = 256, 192
    seed = 7 + scheme.num_bits + 2 * act_order + 4 * scheme.symmetric
    x = correlated_inputs(1024, k, seed)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    h = hessian_of(x)
    gptq = gptq_quantize(w, h, scheme, GPTQOptions(act_order=act_order)).dequantize()
    rtn = rtn_quantize(w, scheme).dequantize()
    err_gptq, err_rtn = output_error(x, w, gptq), output_error(x, w, rtn)
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)


def test_dead_inputs_are_zeroed_and_harmless():
    k, n = 128, 64
    x = correlated_inputs(512, k, 3)
    x[:, [5, 77]] = 0.0  # two inputs never active during calibration
    h = hessian_of(x)
    w = torch.randn(n, k)
    q = gptq_quantize(w, h, W4_G128, GPTQOptions(act_order=True))
    deq = q.dequantize()
    assert torch.isfinite(deq).all()
    assert (deq[:, [5, 77]] == 0).all()
    assert output_error(x, w, deq) < output_error(x, w, rtn_quantize(w, W4_G128).dequantize())


def test_damping_is_raised_until_cholesky_succeeds():
    k, n = 64, 32
    x = correlated_inputs(16, k, 5)  # 16 tokens for 64 inputs: H has rank 16
    h = hessian_of(x)
    h_bad = h - 0.05 * torch.diag(h).mean() * torch.eye(k)  # slightly indefinite (as rounding errors make it)
    w = torch.randn(n, k)
    with pytest.warns(CholeskyWarning, match="damp_percent=0.01; retrying with 0.1"):
        q = gptq_quantize(w, h_bad, W4_G32, GPTQOptions(damp_percent=0.01, act_order=False))
    assert torch.isfinite(q.dequantize()).all()
    # merely singular (rank-deficient PSD) needs no retry: the default damping makes it definite
    with warnings.catch_warnings():
        warnings.simplefilter("error", CholeskyWarning)
        q2 = gptq_quantize(w, h, W4_G32, GPTQOptions(damp_percent=0.01))
    assert output_error(x, w, q2.dequantize()) < output_error(x, w, rtn_quantize(w, W4_G32).dequantize())


def test_bad_hessians_give_clear_errors():
    w = torch.randn(8, 32)
    h = torch.eye(32)
    h[3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        gptq_quantize(w, h, W4_G32, name="layers.0.q_proj")
    with pytest.raises(ValueError, match="does not match in_features 32"):
        gptq_quantize(w, torch.eye(16), W4_G32)
    with pytest.raises(RuntimeError, match="stays singular"), pytest.warns(CholeskyWarning):
        gptq_quantize(w, -torch.eye(32) * 1e9 + torch.ones(32, 32), W4_G32)


def test_scales_are_rounded_to_the_storage_dtype():
    x = correlated_inputs(256, 128, 11)
    h = hessian_of(x)
    w = torch.randn(64, 128)
    q = gptq_quantize(w, h, W4_G128, scale_dtype=torch.bfloat16)
    assert torch.equal(q.scale, q.scale.to(torch.bfloat16).float())


@pytest.mark.parametrize("scheme", [W4_G32, W4_G32_ASYM, W4_CHANNEL])
def test_mse_clip_ratio_is_the_least_weighted_error_on_its_grid(scheme):
    """mse_clip_ratio picks, per (row, group), the grid factor whose diag-weighted error is least, and
    never does worse than min-max (factor 1 is on the grid)."""
    g = torch.Generator().manual_seed(21 + scheme.symmetric)
    w = torch.randn(24, 64, generator=g) ** 3  # heavy-tailed rows
    energy = torch.rand(64, generator=g) * 4
    ratio = mse_clip_ratio(w, scheme, importance=energy, grid=10, max_shrink=0.5)
    assert ratio.shape == (24, scheme.groups_for(64)) and ratio.le(1).all() and ratio.ge(0.5 - 1e-6).all()

    def errors(r):
        scale, zero = compute_qparams(w, scheme, clip_ratio=r)
        wq = dequantize(quantize(w, scale, zero, scheme), scale, zero, scheme)
        size = 64 // scheme.groups_for(64)
        return ((wq - w).pow(2) * energy).reshape(24, -1, size).sum(-1)  # [N, G]

    chosen = errors(ratio)
    for i in range(6):
        assert chosen.le(errors(1 - i / 10) + 1e-6).all()
    assert chosen.sum() < errors(1.0).sum()  # heavy-tailed rows: shrinking some ranges pays
    assert ratio.lt(1).any()


@pytest.mark.parametrize("act_order", [False, True])
def test_mse_observer_lowers_output_error(act_order):
    k, n = 256, 128
    x = correlated_inputs(1024, k, 31 + act_order)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(32)) * 0.05
    h = hessian_of(x)
    minmax = gptq_quantize(w, h, W4_G32, GPTQOptions(act_order=act_order)).dequantize()
    mse = gptq_quantize(w, h, W4_G32, GPTQOptions(act_order=act_order, observer="mse")).dequantize()
    assert output_error(x, w, mse) < 0.95 * output_error(x, w, minmax)
    with pytest.raises(ValueError, match="observer must be one of"):
        GPTQOptions(observer="percentile")
    with pytest.raises(ValueError, match="mse_max_shrink"):
        GPTQOptions(observer="mse", mse_max_shrink=1.0)


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("shape", [(24, 64), (40, 96)])
def test_one_factor_serves_every_linear_of_an_input(act_order, shape):
    """The runner factors a step's Hessian once for its linears (q/k/v, gate/up): each linear quantizes
    exactly as it does from the Hessian itself, and factoring leaves the Hessian as it was."""
    from quantkit.algorithms.gptq import factor_hessian

    n, k = shape
    g = torch.Generator().manual_seed(k + act_order)
    x = torch.randn(256, k, generator=g)
    x[:, 3] = 0.0  # a dead input
    h = hessian_of(x)
    kept = h.clone()
    options = GPTQOptions(act_order=act_order)
    scheme = QuantScheme(num_bits=4, group_size=32, symmetric=False, strategy="group")
    factor = factor_hessian(h, options)
    assert torch.equal(h, kept)
    for seed in range(2):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
        a, b = gptq_quantize(w, h, scheme, options), gptq_quantize(w, factor, scheme, options)
        assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)
        assert a.scheme == b.scheme
    handed = factor_hessian(h, options, overwrite=True)
    assert torch.equal(handed.u, factor.u) and torch.equal(h, kept)  # handed over: freed early, never modified


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("k", [80, 600])  # one block of lower_triangular_inverse, and three (the last ragged)
def test_factor_is_the_upper_cholesky_factor_of_the_damped_inverse(act_order, k):
    """U (visit order) is upper triangular with UᵀU = (H + damp mean(diag H) I)^-1, dead inputs' diagonal set to 1."""
    from quantkit.algorithms.gptq import factor_hessian

    x = correlated_inputs(4 * k, k, 21, torch.float64)
    x[:, 5] = 0.0
    h = hessian_of(x).double()
    factor = factor_hessian(h, GPTQOptions(act_order=act_order, damp_percent=0.05), dtype=torch.float64)
    assert torch.equal(factor.u, factor.u.triu()) and bool(factor.dead[5]) and int(factor.dead.sum()) == 1
    expected = h.clone()
    expected[5, 5] = 1.0
    order = factor.perm if act_order else torch.arange(k)
    expected = expected[order][:, order]
    expected += 0.05 * expected.diagonal().mean() * torch.eye(k, dtype=torch.float64)
    torch.testing.assert_close(factor.u.T @ factor.u, torch.linalg.inv(expected), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("k, block", [(1, 4), (7, 4), (64, 16), (100, 32), (257, 64), (300, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lower_triangular_inverse_matches_a_triangular_solve(k, block, dtype):
    """The blocked inverse of a random lower triangular L equals the fp64 solve against the identity; the upper
    triangle of L is never read (garbage there changes nothing) and the result's upper triangle is zero."""
    from quantkit.algorithms.gptq import lower_triangular_inverse

    generator = torch.Generator().manual_seed(k * 31 + block)
    lower = torch.randn(k, k, generator=generator, dtype=torch.float64).tril() / k ** 0.5
    lower.diagonal().copy_(1.0 + torch.rand(k, generator=generator, dtype=torch.float64))  # well conditioned
    expected = torch.linalg.solve_triangular(lower, torch.eye(k, dtype=torch.float64), upper=False)
    given = lower.to(dtype) + torch.randn(k, k, generator=generator, dtype=dtype).triu(1) * 100
    inverse = lower_triangular_inverse(given.mT.contiguous().mT, block)  # column-major, as the factorisation writes
    assert inverse.dtype == dtype and torch.equal(inverse, inverse.tril())
    tolerance = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(inverse.double(), expected, rtol=tolerance, atol=tolerance)
