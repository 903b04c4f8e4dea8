"""A GGUF grid's fields refined by coordinate descent (algorithms/refine.refine_fields, gptq's refine_fields):
the objective never rising and reported exactly, the first group's fields against a brute-force search over
every integer, levels untouched and fields kept in their ranges and dtypes, grids without integer fields left
as they are, GPTQ with the option, its errors."""

from __future__ import annotations

import pytest
import torch

from quantkit.algorithms.gptq import GPTQOptions, gptq_quantize
from quantkit.algorithms.refine import refine_fields, refine_levels
from quantkit.core.scheme import QuantScheme, grid_scheme
from quantkit.gguf import grids

from .test_refine import _objective, _problem

WITH_FIELDS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")


def _gptq(grid: str, w, h, **options):
    return gptq_quantize(w, h, grid_scheme(grid), GPTQOptions(observer="mse", **options))


@pytest.mark.parametrize("grid", WITH_FIELDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_sweep_lowers_the_objective_and_moves_only_fields(grid, seed):
    w, h = _problem(16, 512, seed)
    start = refine_levels(_gptq(grid, w, h), w, h).weight
    result = refine_fields(start, w, h)
    refined = result.weight
    assert type(refined) is type(start) and refined.scheme == start.scheme
    assert torch.equal(refined.u, start.u)  # the levels stay
    assert result.moved > 0
    assert result.error_before == pytest.approx(_objective(start, w, h), rel=1e-4)
    assert result.error_after == pytest.approx(_objective(refined, w, h), rel=1e-4)
    assert result.error_after < result.error_before
    for name, factor, _, lo, hi in type(start).integer_fields():
        field = getattr(refined, name)
        assert field.dtype == getattr(start, name).dtype and field.shape == getattr(start, name).shape
        assert int(field.min()) >= lo and int(field.max()) <= hi
        assert getattr(refined, factor).dtype == torch.float16
        assert bool(torch.isfinite(getattr(refined, factor).float()).all())
    # the blocks round-trip: what GGUF holds is what was scored
    again = type(refined).from_blocks(refined.blocks())
    torch.testing.assert_close(again.dequantize(), refined.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("grid", ["q2_k", "q3_k"])
def test_the_first_groups_fields_go_to_their_best_integers(grid):
    """Group 0 is visited first: its step field moves to the integer (in its range) with the least objective,
    everything else as it was; then its minimum field (Q2_K) likewise, given the moved step. Later moves touch
    other groups' integers and the super-blocks' floats only."""
    w, h = _problem(6, 256, seed=3)
    start = refine_levels(_gptq(grid, w, h), w, h).weight
    refined = refine_fields(start, w, h).weight
    specs = type(start).integer_fields()
    current = start
    for name, _, _, lo, hi in specs:
        best = []
        for r in range(w.shape[0]):
            errors = {}
            for v in range(lo, hi + 1):
                field = getattr(current, name).clone()
                field[r, 0] = v
                trial = type(current)(current.u, *[field if f == name else getattr(current, f)
                                                   for f in current.FIELDS], scheme=current.scheme)
                errors[v] = _row_objective(trial, w, h, r)
            best.append(min(errors, key=errors.get))
        assert getattr(refined, name)[:, 0].tolist() == best
        field = getattr(current, name).clone()
        field[:, 0] = torch.tensor(best, dtype=field.dtype)
        current = type(current)(current.u, *[field if f == name else getattr(current, f) for f in current.FIELDS],
                                scheme=current.scheme)


def _row_objective(qweight, w, h, r: int) -> float:
    e = (qweight.dequantize()[r] - w[r]).double()
    return float(e @ h.double() @ e)


@pytest.mark.parametrize("grid", ["q4_0", "q8_0", "q4_1", "iq4_nl"])
def test_grids_without_integer_fields_are_left_as_they_are(grid):
    w, h = _problem(8, 256, seed=4)
    start = _gptq(grid, w, h)
    result = refine_fields(start, w, h)
    assert result.weight is start and result.moved == 0 and result.error_after == result.error_before


def test_gptq_with_refine_fields():
    """On Q2_K the option lowers GPTQ's refined objective; on an integer grid (no fields to move) the result is
    the levels' refinement alone, bit for bit."""
    w, h = _problem(32, 512, seed=5)
    levels_only = _gptq("q2_k", w, h, refine_sweeps=2)
    with_fields = _gptq("q2_k", w, h, refine_sweeps=2, refine_fields=True)
    assert _objective(with_fields, w, h) < _objective(levels_only, w, h)
    assert not torch.equal(with_fields.sc, levels_only.sc)
    scheme = QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=64)
    a = gptq_quantize(w, h, scheme, GPTQOptions(refine_sweeps=2))
    b = gptq_quantize(w, h, scheme, GPTQOptions(refine_sweeps=2, refine_fields=True))
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)


def test_refine_fields_needs_refine_sweeps():
    with pytest.raises(ValueError, match="set refine_sweeps >= 1"):
        GPTQOptions(refine_fields=True)


@pytest.mark.parametrize("value", [1, "true", None])
def test_bad_refine_fields_are_clear_errors(value):
    with pytest.raises(ValueError, match="refine_fields must be true or false"):
        GPTQOptions(refine_sweeps=1, refine_fields=value)


def test_a_mismatched_hessian_is_refused():
    w, h = _problem(8, 256, seed=6)
    start = _gptq("q2_k", w, h)
    with pytest.raises(ValueError, match="do not match"):
        refine_fields(start, w, h[:128, :128])


def test_integer_fields_name_real_fields():
    for cls in grids.GRID_WEIGHTS.values():
        for name, factor, role, lo, hi in cls.integer_fields():
            assert name in cls.FIELDS and factor in cls.FIELDS and role in ("scale", "minimum") and lo < hi
