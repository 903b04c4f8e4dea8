"""GPTQ's levels refined by coordinate descent (algorithms/refine.py, gptq's refine_sweeps): the blocked sweep
against a plain one-weight-at-a-time reference, the objective never rising, a coordinate-wise minimum after
enough sweeps, the grid's fields untouched, GPTQ and the pipeline with the option, its errors."""

from __future__ import annotations

import copy

import pytest
import torch

import quantkit
from quantkit.algorithms.gptq import GPTQOptions, factor_hessian, gptq_quantize
from quantkit.algorithms.refine import refine_levels
from quantkit.calibration import CalibrationConfig
from quantkit.core.scheme import QuantScheme, grid_scheme
from quantkit.modules.quant_linear import QuantLinear
from quantkit.quantization.recipe import load_recipe

SCHEMES = {
    "int4-sym-g32": QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32),
    "int4-asym-g64": QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=64),
    "int8-channel": QuantScheme(num_bits=8, symmetric=True, strategy="channel"),
    "q2_k": grid_scheme("q2_k"),
    "q3_k": grid_scheme("q3_k"),
    "q4_k": grid_scheme("q4_k"),
    "q6_k": grid_scheme("q6_k"),
    "q4_0": grid_scheme("q4_0"),
    "iq4_nl": grid_scheme("iq4_nl"),
    "iq4_xs": grid_scheme("iq4_xs"),
}


def _problem(n: int, k: int, seed: int):
    """A weight [N, K] and the Hessian of correlated inputs of uneven energy, one input never active."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    mix = torch.eye(k) + 0.3 * torch.randn(k, k, generator=g) / k ** 0.5
    x = torch.randn(4 * k, k, generator=g) @ mix * (0.2 + 2 * torch.rand(k, generator=g))
    x[:, 3] = 0.0
    return w, 2 * x.T @ x / x.shape[0]


def _objective(qweight, w, h) -> float:
    e = (qweight.dequantize() - w).double()
    return float(((e @ h.double()) * e).sum())


def _reference_sweeps(qweight, w, h, sweeps):
    """One weight at a time, the half-gradient recomputed in fp64 after every move: levels fp64 [N, K]. On a
    non-uniform grid (IQ4) each weight goes to the level whose value is nearest its best real value."""
    grid = qweight.level_grid()
    levels, w64, h64 = grid.levels.double().clone(), w.double(), h.double()
    step = grid.scale.double()[:, grid.column_group]
    minimum = grid.minimum.double()[:, grid.column_group]
    table = None if grid.values is None else grid.values.double()

    def value(lv):
        return lv if table is None else table[lv.long()]

    for _ in range(sweeps):
        for c in range(w.shape[1]):
            if h64[c, c] <= 0:
                continue
            g = (value(levels) * step - minimum - w64) @ h64[:, c]  # [N]
            s = step[:, c]
            safe = torch.where(s != 0, s, torch.ones_like(s))
            change = -g / (h64[c, c] * safe)
            if table is None:
                moved = (levels[:, c] + torch.round(change)).clamp(grid.lowest, grid.highest)
            else:
                moved = ((value(levels[:, c]) + change).unsqueeze(-1) - table).abs().argmin(-1).double()
            levels[:, c] = torch.where(s != 0, moved, levels[:, c])
    return levels


@pytest.mark.parametrize("name", SCHEMES)
def test_blocked_sweeps_match_the_one_at_a_time_reference(name):
    scheme = SCHEMES[name]
    w, h = _problem(24, 256, seed=1)
    gptq = gptq_quantize(w, h, scheme, GPTQOptions(observer="mse"))
    refined = refine_levels(gptq, w, h, sweeps=2, block_size=48)
    want = _reference_sweeps(gptq, w, h, 2)
    got = refined.weight.level_grid().levels.double()
    assert (got == want).float().mean() >= 0.999  # a move at a rounding tie may go either way in fp32
    assert refined.moved == int((got != gptq.level_grid().levels.double()).sum()) > 0
    assert refined.error_after < refined.error_before
    assert refined.error_before == pytest.approx(_objective(gptq, w, h), rel=1e-4)
    assert refined.error_after == pytest.approx(_objective(refined.weight, w, h), rel=1e-4)


@pytest.mark.parametrize("name", ["int4-asym-g64", "q3_k", "q4_k", "iq4_xs"])
def test_only_levels_move_and_they_stay_on_the_grid(name):
    scheme = SCHEMES[name]
    w, h = _problem(16, 256, seed=2)
    gptq = gptq_quantize(w, h, scheme, GPTQOptions())
    refined = refine_levels(gptq, w, h, sweeps=1).weight
    before, after = gptq.level_grid(), refined.level_grid()
    assert type(refined) is type(gptq) and refined.scheme == gptq.scheme
    for field in ("scale", "minimum", "column_group"):
        assert torch.equal(getattr(after, field), getattr(before, field))
    assert (after.values is None) == (before.values is None) == (name != "iq4_xs")
    assert after.levels.min() >= before.lowest and after.levels.max() <= before.highest
    torch.testing.assert_close(refined.dequantize(), after.dequantize(after.levels), rtol=1e-6, atol=1e-7)
    # an input never active keeps GPTQ's level
    assert torch.equal(after.levels[:, 3], before.levels[:, 3])


def test_enough_sweeps_reach_a_coordinate_wise_minimum():
    """After convergence no single weight moved one level up or down lowers the objective."""
    scheme = SCHEMES["int4-sym-g32"]
    w, h = _problem(8, 64, seed=3)
    gptq = gptq_quantize(w, h, scheme, GPTQOptions())
    refined = refine_levels(gptq, w, h, sweeps=40).weight
    grid = refined.level_grid()
    e = (refined.dequantize() - w).double()
    g = e @ h.double()
    step = grid.scale.double()[:, grid.column_group]
    diag = h.double().diagonal()
    for delta in (1.0, -1.0):
        inside = (grid.levels + delta >= grid.lowest) & (grid.levels + delta <= grid.highest)
        d = delta * step
        change = 2 * d * g + d * d * diag
        assert float(change[inside].min()) >= -1e-9 * _objective(refined, w, h)
    # and the sweeps never rose: each of 1, 2, 4 sweeps is at least as good as the one before
    errors = [refine_levels(gptq, w, h, sweeps=s).error_after for s in (1, 2, 4)]
    assert errors[0] >= errors[1] >= errors[2]


def test_gptq_with_refine_sweeps_lowers_its_objective():
    scheme = SCHEMES["q2_k"]
    w, h = _problem(32, 256, seed=4)
    plain = gptq_quantize(w, h, scheme, GPTQOptions(observer="mse"))
    refined = gptq_quantize(w, h, scheme, GPTQOptions(observer="mse", refine_sweeps=2))
    assert _objective(refined, w, h) < _objective(plain, w, h)
    # the same through a shared factor, which keeps H for the refinement
    factor = factor_hessian(h, GPTQOptions(refine_sweeps=2))
    assert factor.hessian is not None and factor_hessian(h, GPTQOptions()).hessian is None
    shared = gptq_quantize(w, factor, scheme, GPTQOptions(observer="mse", refine_sweeps=2))
    assert torch.equal(shared.u, refined.u)


def test_a_factor_without_the_hessian_is_refused():
    w, h = _problem(8, 64, seed=5)
    factor = factor_hessian(h, GPTQOptions())
    with pytest.raises(ValueError, match="refine_sweeps needs the Hessian"):
        gptq_quantize(w, factor, SCHEMES["int4-sym-g32"], GPTQOptions(refine_sweeps=1))


@pytest.mark.parametrize("value", [-1, True, 1.5, "2"])
def test_bad_refine_sweeps_are_clear_errors(value):
    with pytest.raises(ValueError, match="refine_sweeps must be a whole number"):
        GPTQOptions(refine_sweeps=value)


def test_refined_recipe_quantizes_saves_and_loads(tmp_path):
    """The built-in refined recipe on ref:tiny: levels differ from GPTQ's on the same calibration; the first
    block's q/k/v, whose inputs no refined linear changed, keep GPTQ's scales (the shrinkage leaves diag(H),
    which the range search weighs by, as it is); the checkpoint loads back to the same logits."""
    float_model = quantkit.load("ref:tiny")
    calibration = CalibrationConfig(num_samples=8, seq_len=64, seed=0)
    plain = quantkit.quantize(copy.deepcopy(float_model), "w4a16-gptq", calibration_data=calibration, progress=False)
    refined = quantkit.quantize(copy.deepcopy(float_model), "w4a16-gptq-refined", calibration_data=calibration,
                                progress=False)
    options = load_recipe("w4a16-gptq-refined").algorithm.options
    assert (options.refine_sweeps, options.shrinkage) == (2, 0.25)
    pairs = [(a, b) for a, b in zip(plain.modules(), refined.modules()) if isinstance(a, QuantLinear)]
    assert len(pairs) == 14
    assert all(torch.equal(a.weight_scale, b.weight_scale) for a, b in pairs[:3])
    assert all(not torch.equal(a.weight_packed, b.weight_packed) for a, b in pairs[:3])
    path = quantkit.save(refined, tmp_path / "q")
    loaded = quantkit.load(path, backend="reference")
    ids = torch.randint(0, float_model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, refined(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("overwrite", [False, True])
def test_shrinkage_shrinks_the_off_diagonal_and_leaves_the_callers_matrix(overwrite):
    _w, h = _problem(4, 64, seed=6)
    given = h.clone()
    factor = factor_hessian(given, GPTQOptions(shrinkage=0.25, refine_sweeps=1), overwrite=overwrite)
    torch.testing.assert_close(factor.hessian, 0.75 * h + 0.25 * torch.diag(h.diagonal()))
    if not overwrite:
        assert torch.equal(given, h)
    # GPTQ on the shrunk Hessian is GPTQ on (1 - rho) H + rho diag(H) as measured
    w = _w
    scheme = SCHEMES["int4-sym-g32"]
    shrunk = gptq_quantize(w, h, scheme, GPTQOptions(shrinkage=0.25))
    by_hand = gptq_quantize(w, 0.75 * h + 0.25 * torch.diag(h.diagonal()), scheme, GPTQOptions())
    assert torch.equal(shrunk.q, by_hand.q) and torch.equal(shrunk.scale, by_hand.scale)
    assert not torch.equal(shrunk.q, gptq_quantize(w, h, scheme, GPTQOptions()).q)


@pytest.mark.parametrize("value", [-0.1, 1.0, True, "0.2"])
def test_bad_shrinkage_is_a_clear_error(value):
    with pytest.raises(ValueError, match=r"shrinkage must be in \[0, 1\)"):
        GPTQOptions(shrinkage=value)


@pytest.mark.parametrize("shrinkage", [0.0, 0.25])
def test_refine_shrinkage_shrinks_the_refinements_hessian_only(shrinkage):
    """GPTQ's factor stays that of (1 - shrinkage) H + shrinkage diag(H); the Hessian kept for the refinement is
    (1 - r) H + r diag(H); the caller's matrix is left as it was; the refined weight is GPTQ's refined by hand on
    that Hessian."""
    w, h = _problem(8, 64, seed=7)
    given = h.clone()
    options = GPTQOptions(shrinkage=shrinkage, refine_sweeps=1, refine_shrinkage=0.75)
    factor = factor_hessian(given, options)
    assert torch.equal(given, h)
    torch.testing.assert_close(factor.hessian, 0.25 * h + 0.75 * torch.diag(h.diagonal()))
    same_walk = factor_hessian(h, GPTQOptions(shrinkage=shrinkage))
    assert torch.equal(factor.u, same_walk.u)
    scheme = SCHEMES["int4-sym-g32"]
    refined = gptq_quantize(w, h, scheme, options)
    by_hand = refine_levels(gptq_quantize(w, h, scheme, GPTQOptions(shrinkage=shrinkage)), w,
                            0.25 * h + 0.75 * torch.diag(h.diagonal()), 1).weight
    assert torch.equal(refined.q, by_hand.q)
    assert not torch.equal(refined.q, gptq_quantize(w, h, scheme, GPTQOptions(shrinkage=shrinkage, refine_sweeps=1)).q)


@pytest.mark.parametrize("value, match", [(0.1, r"refine_shrinkage must be in \[shrinkage, 1\)"),
                                          (1.0, r"refine_shrinkage must be in"), (True, r"refine_shrinkage must be in"),
                                          ("0.5", r"refine_shrinkage must be in")])
def test_bad_refine_shrinkage_is_a_clear_error(value, match):
    with pytest.raises(ValueError, match=match):
        GPTQOptions(shrinkage=0.25, refine_sweeps=1, refine_shrinkage=value)
    with pytest.raises(ValueError, match="set refine_sweeps >= 1 too"):
        GPTQOptions(refine_shrinkage=0.5)
