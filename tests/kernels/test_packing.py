import pytest
import torch

from quantkit.kernels.packing import pack_int32, pack_zero_point, packed_words, unpack_int32, unpack_zero_point


def _u32(words: torch.Tensor) -> list[int]:
    return [w & 0xFFFFFFFF for w in words.tolist()]


def test_golden_int4():
    values = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1])
    assert _u32(pack_int32(values, 4)) == [0xFEDCBA98, 0x76543210]


def test_golden_int8():
    assert _u32(pack_int32(torch.tensor([-128, -1, 0, 127]), 8)) == [0xFF807F00]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", [(1, 8), (3, 32), (5, 37), (64, 128), (2, 3, 24)])
def test_round_trip_exact(bits, shape):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    values = torch.randint(lo, hi, shape)
    packed = pack_int32(values, bits)
    assert packed.dtype == torch.int32
    assert packed.shape[-1] == -(-shape[-1] * bits // 32) == packed_words(shape[-1], bits)
    assert torch.equal(unpack_int32(packed, bits, shape[-1]).long(), values)


@pytest.mark.parametrize("bits", [4, 8])
def test_weight_and_zero_point_layouts(bits):
    n, k, g = 72, 256, 2
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n, k))
    zp = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n, g))
    pw, pz = pack_int32(q, bits), pack_zero_point(zp, bits)
    assert pw.shape == (n, k * bits // 32)
    assert pz.shape == (-(-n * bits // 32), g)  # packed along the output dim
    assert torch.equal(unpack_int32(pw, bits, k).long(), q)
    unpacked = unpack_zero_point(pz, bits, n)
    assert unpacked.dtype == torch.int32 and torch.equal(unpacked.long(), zp)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="out of the signed 4-bit range"):
        pack_int32(torch.tensor([8]), 4)
    with pytest.raises(TypeError, match="integer"):
        pack_int32(torch.tensor([0.5]), 4)
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_int32(torch.tensor([1]), 3)
