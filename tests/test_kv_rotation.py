"""The Hadamard rotation of head_dim in the FP8 KV cache: the matrix, the rotated cache against float
attention and against an independent fake-quantized reference, calibration in the rotated basis, and
the errors for bad rotations."""

import math

import pytest
import torch
from transformers.cache_utils import Cache, DynamicLayer

from quantkit.calibration.kv_scales import calibrate_kv_scales, quantize_kv_cache
from quantkit.core.errors import QuantizationError
from quantkit.modules.kv_cache import FP8KVCache, FP8KVLayer, fp8_cache_for
from quantkit.modules.kv_rotation import check_rotation, hadamard_matrix
from quantkit.modules.kv_scales import attach_kv_scales, kv_rotation_of, read_kv_scales

from .conftest import make_random_model

FP8 = torch.float8_e4m3fn
VOCAB = 512


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128])
def test_hadamard_is_symmetric_orthogonal_with_entries_of_one_magnitude(n):
    h = hadamard_matrix(n).double()
    assert h.shape == (n, n) and h.dtype == torch.float64
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-6)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h.abs(), torch.full((n, n), 1 / math.sqrt(n), dtype=torch.float64), rtol=0, atol=1e-7)


@pytest.mark.parametrize("head_dim", [0, 48, 96, 576])
def test_hadamard_of_a_head_dim_not_a_power_of_two_is_refused(head_dim):
    with pytest.raises(QuantizationError, match="power of two.*rotation: none"):
        hadamard_matrix(head_dim)


@pytest.mark.parametrize("name", ["Hadamard", "random", "", None, 1])
def test_unknown_rotation_names_the_choices(name):
    with pytest.raises(QuantizationError, match="none, hadamard"):
        check_rotation(name)


def _attention(q, k, v):
    """q [B, H, 1, D], k / v [B, H, T, D] -> fp32 [B, H, 1, D]."""
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())


def _cached(k, v, rotation):
    """k / v [B, H, T, D] through one FP8 layer with amax / 448 scales of the basis it stores."""
    h = hadamard_matrix(k.shape[-1])
    basis = (k @ h, v @ h) if rotation == "hadamard" else (k, v)
    layer = FP8KVLayer(basis[0].abs().amax() / 448, basis[1].abs().amax() / 448, rotation=rotation)
    return layer.update(k, v)


def test_rotated_cache_attention_matches_float_within_fp8_tolerance():
    b, heads, t, d = 4, 3, 96, 64
    q, k, v = (torch.randn(b, heads, n, d) for n in (1, t, t))
    k[..., 5] *= 20  # an outlier channel, as real keys after RoPE have
    v[..., 17] *= 20
    q = q * 0.2
    exact = _attention(q, k, v)
    kq, vq = _cached(k, v, "hadamard")
    assert kq.dtype == k.dtype and kq.shape == k.shape
    assert ((_attention(q, kq, vq) - exact).norm() / exact.norm()).item() < 0.12  # e4m3: 3 mantissa bits
    assert ((kq - k).norm() / k.norm()).item() < 0.05


def test_rotated_layer_stores_codes_of_x_h_over_s():
    k, v = torch.randn(1, 2, 7, 32), torch.randn(1, 2, 7, 32)
    h = hadamard_matrix(32)
    layer = FP8KVLayer(torch.tensor([0.01]), torch.tensor([0.02]), rotation="hadamard")
    keys, values = layer.update(k, v)
    assert torch.equal(layer.keys, ((k @ h) / 0.01).clamp(-448, 448).to(FP8))
    torch.testing.assert_close(values, (layer.values.float() * 0.02) @ h.T, rtol=0, atol=1e-6)


class RotatedFakeQuantLayer(DynamicLayer):
    """Reference: a DynamicLayer holding ((x H / s) -> fp8 -> * s) H^T, written independently."""

    def __init__(self, k_scale, v_scale, head_dim):
        super().__init__()
        self.scales = (k_scale.float().reshape(1, -1, 1, 1), v_scale.float().reshape(1, -1, 1, 1))
        self.h = hadamard_matrix(head_dim)  # fp32, as the cache: a float64 rotation could flip a boundary code

    def update(self, key_states, value_states, *args, **kwargs):
        def round_trip(x, s):
            codes = ((x.float() @ self.h) / s).clamp(-448, 448).to(FP8)
            return ((codes.float() * s) @ self.h.T).to(x.dtype)

        return super().update(round_trip(key_states, self.scales[0]), round_trip(value_states, self.scales[1]))


def rotated_model(per_head=False):
    model = make_random_model("llama", seed=0, vocab=VOCAB)
    quantize_kv_cache(model, [torch.randint(0, VOCAB, (2, 48))], per_head=per_head, rotation="hadamard")
    return model


@pytest.mark.parametrize("per_head", [False, True])
def test_model_logits_with_rotated_cache_match_the_reference(per_head):
    model = rotated_model(per_head)
    assert kv_rotation_of(model) == "hadamard"
    rotated, missing = read_kv_scales(model, rotated=True)
    assert not missing
    head_dim = model.model.layers[0].self_attn.head_dim
    ids = torch.randint(1, VOCAB, (2, 30))
    cache = fp8_cache_for(model)
    assert isinstance(cache, FP8KVCache) and cache.rotation == "hadamard"
    reference = Cache(layers=[RotatedFakeQuantLayer(*rotated[i], head_dim) for i in sorted(rotated)])
    with torch.no_grad():
        got = model(ids, use_cache=True, past_key_values=cache).logits
        expected = model(ids, use_cache=True, past_key_values=reference).logits
        plain = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert not torch.equal(got, plain)  # the cache quantizes


def test_calibration_measures_both_bases_and_keeps_standard_scales_unrotated():
    model = make_random_model("llama", seed=1, vocab=VOCAB)
    batch = [torch.randint(0, VOCAB, (2, 40))]
    plain_only = calibrate_kv_scales(model, batch)
    plain, rotated = calibrate_kv_scales(model, batch, rotation="hadamard")
    for i in plain_only:
        assert torch.equal(plain[i][0], plain_only[i][0]) and torch.equal(plain[i][1], plain_only[i][1])
        assert not torch.equal(rotated[i][0], plain[i][0])
    quantize_kv_cache(model, batch, rotation="hadamard")
    standard, _ = read_kv_scales(model)
    for i in plain_only:
        torch.testing.assert_close(standard[i][0], plain_only[i][0], rtol=0, atol=0)
    names = set(model.state_dict())
    assert not any(n.endswith("_rotated") for n in names)  # never in the checkpoint's state dict
    assert any(n.endswith("self_attn.k_scale") for n in names)


def test_rotated_scales_are_amax_of_rotated_keys_over_448():
    model = make_random_model("llama", seed=2, vocab=VOCAB)
    seen = {}

    class Capture(DynamicLayer):
        def update(self, k, v, *args, **kwargs):
            seen.setdefault(len(seen), (k.detach().clone(), v.detach().clone()))
            return k, v

    ids = torch.randint(0, VOCAB, (1, 33))
    with torch.no_grad():
        model(ids, use_cache=True, past_key_values=Cache(layers=[Capture() for _ in model.model.layers]))
    _, rotated = calibrate_kv_scales(model, [ids], rotation="hadamard")
    h = hadamard_matrix(seen[0][0].shape[-1])
    for i, (k, v) in seen.items():
        torch.testing.assert_close(rotated[i][0], ((k @ h).abs().amax() / 448).reshape(1), rtol=1e-6, atol=0)
        torch.testing.assert_close(rotated[i][1], ((v @ h).abs().amax() / 448).reshape(1), rtol=1e-6, atol=0)


def test_rotated_cache_without_rotated_scales_is_refused():
    model = make_random_model("llama", seed=0, vocab=VOCAB)
    attach_kv_scales(model, {i: (torch.ones(1), torch.ones(1)) for i in range(len(model.model.layers))})
    with pytest.raises(QuantizationError, match="rotated keys and values.*rotation='hadamard'"):
        fp8_cache_for(model, rotation="hadamard")


def test_kernel_attention_with_rotation_is_refused():
    with pytest.raises(QuantizationError, match="attention='dequantize'"):
        FP8KVLayer(1.0, 1.0, return_fp8_on_decode=True, rotation="hadamard")


def test_calibration_rotation_name_is_checked():
    model = make_random_model("llama", seed=0, vocab=VOCAB)
    with pytest.raises(QuantizationError, match="none, hadamard"):
        calibrate_kv_scales(model, [torch.randint(0, VOCAB, (1, 8))], rotation="hadamrd")
