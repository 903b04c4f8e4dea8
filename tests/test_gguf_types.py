"""The one record per ggml type (quantkit/gguf/types.py) against the `gguf` package's own tables, and every
other table reading it: the grids QuantScheme accepts, the grid classes, the fallbacks."""

from __future__ import annotations

import subprocess
import sys

import pytest

gguf = pytest.importorskip("gguf")

from quantkit.gguf.grids import GRID_WEIGHTS  # noqa: E402
from quantkit.gguf.types import GGML_TYPES, GRID_TYPES, for_width  # noqa: E402
from quantkit.core.scheme import GRIDS, grid_scheme  # noqa: E402

T = gguf.GGMLQuantizationType


@pytest.mark.parametrize("name", sorted(GGML_TYPES))
def test_each_record_is_ggmls_type(name):
    t = GGML_TYPES[name]
    assert T[name] == t.type_id and gguf.GGML_QUANT_SIZES[T(t.type_id)] == (t.block, t.block_bytes)
    assert GRID_TYPES[t.grid] is t and grid_scheme(t.grid).bits_per_weight == t.block_bytes * 8 / t.block
    cls = GRID_WEIGHTS[t.grid]
    assert cls.TYPE is t and (cls.GGUF_TYPE, cls.BLOCK, cls.GROUP) == (name, t.block, t.group_size)
    assert cls.LEVELS == (1 << t.num_bits) - 1 and (cls.OFFSET is None) == (not t.symmetric or t.values is not None)
    if t.values is None:
        assert cls.VALUES is None
    else:  # the non-uniform grids: the gguf package's own table (ggml's kvalues_iq4nl)
        assert tuple(cls.VALUES.tolist()) == t.values == gguf.quants.IQ4_NL.kvalues and len(t.values) == cls.LEVELS + 1
    for fallback in (t.fallback, t.llama_cpp_fallback):
        assert fallback is None or (t.block == 256 and GRID_TYPES[fallback].block == 32)


def test_the_grids_are_the_records():
    assert GRIDS == ("uniform", *GRID_TYPES) and set(GRID_WEIGHTS) == set(GRID_TYPES)


def test_for_width_follows_the_fallbacks():
    assert for_width("q4_k", 512) == (GRID_TYPES["q4_k"], True)
    assert for_width("q4_k", 320) == (GRID_TYPES["q4_1"], True)
    assert for_width("q4_k", 320, llama_cpp=True) == (GRID_TYPES["q5_0"], True)
    assert for_width("q2_k", 48, llama_cpp=True) == (GRID_TYPES["q4_0"], False)
    assert for_width("q8_0", 40) == (GRID_TYPES["q8_0"], False)
    assert for_width("iq4_xs", 320) == for_width("iq4_xs", 320, llama_cpp=True) == (GRID_TYPES["iq4_nl"], True)
    assert for_width("iq4_xs", 48) == (GRID_TYPES["iq4_nl"], False)


def test_the_records_load_no_torch():
    """core/scheme.py reads the records, and the CLI's parser reads the schemes without torch."""
    code = "import sys, quantkit.core.scheme; print('torch' in sys.modules or 'numpy' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
