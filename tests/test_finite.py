"""core.finite: the NaN/Inf count of a tensor, whatever its dtype, size and where the bad values sit."""

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit.core import finite
from quantkit.core.finite import count_nonfinite, nonfinite_tensors

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]
BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), size=st.integers(1, 700), chunk=st.sampled_from([1, 7, 64, 1 << 22]),
       bad=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(sorted(BAD))), max_size=6),
       seed=st.integers(0, 2**16))
def test_the_count_is_the_number_of_nan_and_inf_values(dtype, size, chunk, bad, seed):
    """Random finite values (never zeros) with NaN/Inf put at random places: the count is exact, across
    chunk boundaries too (CHUNK made small), and a tensor of finite values counts 0. The oracle reads
    every value in fp64."""
    generator = torch.Generator().manual_seed(seed)
    values = (torch.randn(size, generator=generator) * 3 + 0.5).to(dtype)
    expected = set()
    for position, kind in bad:
        values[position % size] = BAD[kind]
        expected.add(position % size)
    stored = int((~torch.isfinite(values.double())).sum())  # the oracle: every value in fp64, no chunks
    if dtype != torch.float8_e4m3fn:  # e4m3fn has no infinity: it stores ±inf as its largest value
        assert stored == len(expected)
    with mock.patch.object(finite, "CHUNK", chunk):
        assert count_nonfinite(values) == stored
        assert count_nonfinite(values.reshape(1, size, 1)) == stored


def test_extreme_finite_values_are_not_counted():
    """The largest finite values of each dtype, both signs, in one chunk: no false count."""
    for dtype in DTYPES:
        info = torch.finfo(dtype)
        values = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, 1.0], dtype=torch.float64).to(dtype)
        assert count_nonfinite(values) == 0, dtype


def test_nonfinite_tensors_names_the_floating_tensors_that_have_any():
    named = [("a", torch.tensor([1.0, float("nan"), float("inf")])), ("b", torch.ones(3, dtype=torch.bfloat16)),
             ("codes", torch.tensor([1, 2], dtype=torch.int32)), ("meta", torch.empty(4, device="meta")),
             ("none", None), ("c", torch.tensor([float("-inf")], dtype=torch.float16))]
    assert nonfinite_tensors(named) == [("a", 2), ("c", 1)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_empty_tensor_has_none(dtype):
    assert count_nonfinite(torch.empty(0, 3, dtype=dtype)) == 0
