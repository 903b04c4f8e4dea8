"""A GGUF grid's fields refined by coordinate descent (algorithms/refine.refine_fields, gptq's refine_fields):
the objective never rising and reported exactly, the first group's integer fields against a brute-force search
over every integer and the first block's float against the exact minimiser, levels untouched and fields kept
in their ranges and dtypes, integer grids (no GGUF fields) left as they are, GPTQ with the option, its errors."""

from __future__ import annotations

import pytest
import torch

from quantkit.algorithms.gptq import GPTQOptions, gptq_quantize
from quantkit.algorithms.refine import refine_fields, refine_levels
from quantkit.core.scheme import QuantScheme, grid_scheme
from quantkit.gguf import grids

from .test_refine import _objective, _problem

WITH_FIELDS = tuple(grids.GRID_WEIGHTS)


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
    for name in start.FIELDS:
        field = getattr(refined, name)
        assert field.dtype == getattr(start, name).dtype and field.shape == getattr(start, name).shape
    for name, _, _, lo, hi in type(start).integer_fields():
        assert int(getattr(refined, name).min()) >= lo and int(getattr(refined, name).max()) <= hi
    for name, _, _ in type(start).float_fields():
        assert getattr(refined, name).dtype == torch.float16
        assert bool(torch.isfinite(getattr(refined, name).float()).all())
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


@pytest.mark.parametrize("grid,name", [("q4_0", "d"), ("q8_0", "d"), ("q4_1", "d"), ("iq4_nl", "d")])
def test_the_first_blocks_float_goes_to_its_best_fp16_value(grid, name):
    """On the grids of blocks of 32 the first block is visited first (these have no integer fields): its float
    moves to the exact minimiser of the row's objective along it (a parabola, found here in fp64 from three
    exact evaluations), rounded to fp16, within one fp16 step."""
    w, h = _problem(6, 256, seed=4)
    start = refine_levels(_gptq(grid, w, h), w, h).weight
    refined = refine_fields(start, w, h).weight

    def row_error(r: int, value: float) -> float:
        field = getattr(start, name).clone()
        field[r, 0] = value
        trial = type(start)(start.u, *[field if f == name else getattr(start, f) for f in start.FIELDS],
                            scheme=start.scheme)
        return _row_objective(trial, w, h, r)

    for r in range(w.shape[0]):
        x0 = float(getattr(start, name)[r, 0])
        step = max(abs(x0), 1e-3) * 0.01
        f_minus, f0, f_plus = (row_error(r, x0 + d * step) for d in (-1, 0, 1))
        vertex = x0 - step * (f_plus - f_minus) / (2 * (f_plus - 2 * f0 + f_minus))
        want = torch.tensor(vertex).to(torch.float16)
        got = getattr(refined, name)[r, 0]
        ulp = abs(float(torch.nextafter(want, torch.tensor(float("inf"), dtype=torch.float16))) - float(want))
        assert abs(float(got) - float(want)) <= ulp * 1.01


def test_integer_grids_are_left_as_they_are():
    w, h = _problem(8, 256, seed=4)
    start = gptq_quantize(w, h, QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32), GPTQOptions())
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


def test_the_field_tables_name_real_fields():
    """Every field of every grid is moved, each by one rule; the integers' factors are float fields."""
    for cls in grids.GRID_WEIGHTS.values():
        integers = {name: (factor, role) for name, factor, role, lo, hi in cls.integer_fields() if lo < hi}
        floats = {name: (role, integer) for name, role, integer in cls.float_fields()}
        assert sorted([*integers, *floats]) == sorted(cls.FIELDS), cls.__name__
        assert all(factor in floats and role in ("scale", "minimum") for factor, role in integers.values())
        assert all(role in ("scale", "minimum", "offset") and (integer is None or integer in integers)
                   for role, integer in floats.values())
