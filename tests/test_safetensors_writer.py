"""quantkit's safetensors writer streams one tensor at a time and writes the bytes safetensors' save_file
writes, for every dtype, shape and name; the files read back with safetensors' own reader."""

from __future__ import annotations

import string

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit.formats import safetensors_io
from quantkit.formats.safetensors_io import TORCH_DTYPES

DTYPES = [d for d in TORCH_DTYPES.values() if d is not torch.complex64]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype)[: torch.Size(shape).numel()].reshape(shape)
    return t.clone()


tensors = st.dictionaries(
    st.text(string.ascii_letters + string.digits + "._", min_size=1, max_size=12),
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3).map(tuple), st.integers(0, 2**31)),
    min_size=1, max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(spec=tensors)
def test_the_streamed_file_is_byte_for_byte_safetensors_save_file(tmp_path_factory, spec):
    folder = tmp_path_factory.mktemp("st")
    state = {name: _random(dtype, shape, seed) for name, (dtype, shape, seed) in spec.items()}
    save_file(state, str(folder / "theirs.safetensors"), metadata={"format": "pt"})
    safetensors_io.save_safetensors_file(state, folder / "ours.safetensors")
    assert (folder / "ours.safetensors").read_bytes() == (folder / "theirs.safetensors").read_bytes()
    with safe_open(str(folder / "ours.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(state)
        for name, t in state.items():
            back = f.get_tensor(name)
            assert back.dtype == t.dtype and back.shape == t.shape
            assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_a_memory_mapped_tensor_is_written_as_it_is(tmp_path):
    """A tensor memory-mapped from another file (a streamed model's weight) is written with its values."""
    src = torch.randn(1000, 300)
    save_file({"w": src}, str(tmp_path / "src.safetensors"))
    nbytes = (tmp_path / "src.safetensors").stat().st_size
    storage = torch.UntypedStorage.from_file(str(tmp_path / "src.safetensors"), shared=False, nbytes=nbytes)
    header = int.from_bytes((tmp_path / "src.safetensors").read_bytes()[:8], "little")
    mapped = torch.empty(0).set_(storage, (8 + header) // 4, (1000, 300))
    safetensors_io.save_safetensors_file({"w": mapped}, tmp_path / "out.safetensors")
    with safe_open(str(tmp_path / "out.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("w"), src)
