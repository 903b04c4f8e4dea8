import pytest
import torch

from quantkit.core.dtypes import dtype_bytes, parse_dtype


def test_names_map_to_dtypes_and_sizes():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("float16") is torch.float16
    assert [dtype_bytes(x) for x in ("bfloat16", "torch.float16", "float32", torch.bfloat16, torch.float32)] == [2, 2, 4, 2, 4]


def test_unknown_names_are_named():
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'; choose one of \['bf16', 'bfloat16'"):
        parse_dtype("int8")
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):
        dtype_bytes("float64")
