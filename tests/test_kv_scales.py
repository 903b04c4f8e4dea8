"""FP8 KV scale calibration: absmax / 448 of the cached (post-RoPE) keys and of the values."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from quantkit.calibration.kv_scales import calibrate_kv_scales, quantize_kv_cache
from quantkit.modules.kv_scales import attach_kv_scales, attention_modules, read_kv_scales
from quantkit.core.errors import QuantizationError

from .conftest import FAMILIES, make_random_model


def make_qwen3(seed: int = 0):
    """Qwen3: per-head RMSNorm on the keys before RoPE, which calibration must see too."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                                      max_position_embeddings=256)
    return transformers.Qwen3ForCausalLM(config).eval()


def direct_absmax(model, batches, per_head=False):
    """Absmax of post-RoPE keys and of values computed from each attention's inputs by forward hooks.

    Returns {layer: (k_absmax, v_absmax, k_absmax_before_rope)}.
    """
    found = {}

    def hook(module, args, kwargs, _output):
        hidden = kwargs.get("hidden_states", args[0] if args else None)  # [B, T, hidden]
        cos, sin = kwargs["position_embeddings"]
        shape = (*hidden.shape[:-1], -1, module.head_dim)
        k = module.k_proj(hidden).view(shape)  # [B, T, Hkv, D]
        if hasattr(module, "k_norm"):
            k = module.k_norm(k)
        k = k.transpose(1, 2)  # [B, Hkv, T, D]
        v = module.v_proj(hidden).view(shape).transpose(1, 2)
        _, k_rope = apply_rotary_pos_emb(k, k, cos, sin)
        dims = (0, 2, 3) if per_head else (0, 1, 2, 3)
        new = [t.abs().amax(dim=dims).float().reshape(-1) for t in (k_rope, v, k)]
        old = found.get(module.layer_idx)
        found[module.layer_idx] = new if old is None else [torch.maximum(a, b) for a, b in zip(old, new)]

    handles = [m.register_forward_hook(hook, with_kwargs=True) for _, m in attention_modules(model).values()]
    try:
        with torch.no_grad():
            for batch in batches:
                model(input_ids=batch, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return found


def random_batches(vocab=512, n=3, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    return [torch.randint(0, vocab, (2, 24 + 8 * i), generator=g) for i in range(n)]


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3"])
@pytest.mark.parametrize("per_head", [False, True])
def test_scales_are_absmax_over_448_of_post_rope_keys(family, per_head):
    model = make_qwen3() if family == "qwen3" else make_random_model(family)
    batches = random_batches()
    scales = calibrate_kv_scales(model, batches, per_head=per_head)
    expected = direct_absmax(model, batches, per_head=per_head)
    num_kv_heads = model.config.num_key_value_heads
    assert sorted(scales) == sorted(expected) == list(range(model.config.num_hidden_layers))
    for i, (k_scale, v_scale) in scales.items():
        k_absmax, v_absmax, _ = expected[i]
        assert k_scale.shape == v_scale.shape == ((num_kv_heads,) if per_head else (1,))
        assert k_scale.dtype == torch.float32
        torch.testing.assert_close(k_scale, k_absmax / 448, rtol=1e-5, atol=0)
        torch.testing.assert_close(v_scale, v_absmax / 448, rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_scales_taken_before_rope_would_differ(family):
    """The check above can tell post-RoPE from pre-RoPE keys: on these (fixed) batches their absmax differ.

    Fixed seeds: with random data the absmax can sit at position 0, where RoPE is the identity.
    """
    model = make_qwen3(seed=2) if family == "qwen3" else make_random_model(family, seed=2)
    batches = random_batches(seed=5)
    scales = calibrate_kv_scales(model, batches, per_head=True)
    for i, (_, _, k_before_rope) in direct_absmax(model, batches, per_head=True).items():
        assert not torch.allclose(k_before_rope / 448, scales[i][0], rtol=1e-3), i


def test_per_head_scales_reduce_to_per_tensor():
    model = make_random_model("llama")
    batches = random_batches()
    per_tensor = calibrate_kv_scales(model, batches)
    per_head = calibrate_kv_scales(model, batches, per_head=True)
    for i in per_tensor:
        for a, b in zip(per_tensor[i], per_head[i]):
            torch.testing.assert_close(a, b.max().reshape(1))


@pytest.mark.parametrize("proj,what", [("k_proj", "keys"), ("v_proj", "values")])
def test_nan_in_activations_names_the_layer(proj, what):
    model = make_random_model("llama")
    with torch.no_grad():
        getattr(model.model.layers[1].self_attn, proj).weight[3, 5] = float("nan")
    with pytest.raises(QuantizationError, match=rf"model\.layers\.1\.self_attn: .* NaN/Inf .* {what}"):
        calibrate_kv_scales(model, random_batches(n=1))


def test_bad_calibration_data_is_rejected():
    model = make_random_model("llama")
    with pytest.raises(QuantizationError, match="no calibration batches"):
        calibrate_kv_scales(model, [])
    ids = torch.randint(0, 512, (2, 16))
    with pytest.raises(QuantizationError, match="padded"):
        calibrate_kv_scales(model, [{"input_ids": ids, "attention_mask": torch.zeros_like(ids)}])
    with pytest.raises(QuantizationError, match="token ids"):
        calibrate_kv_scales(model, [torch.randn(2, 16)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_head", [False, True])
def test_attach_registers_persistent_buffers(dtype, per_head):
    model = make_random_model("qwen2").to(dtype)
    scales = quantize_kv_cache(model, random_batches(), per_head=per_head)
    state = model.state_dict()
    shape = (model.config.num_key_value_heads,) if per_head else (1,)
    for i, (k_scale, v_scale) in scales.items():
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            stored = state[f"model.layers.{i}.self_attn.{name}"]
            assert stored.dtype == dtype and stored.shape == shape
            torch.testing.assert_close(stored, scale.to(dtype), rtol=0, atol=0)
    read, missing = read_kv_scales(model)
    assert not missing and sorted(read) == sorted(scales)


def test_attach_rejects_scales_of_another_model():
    model = make_random_model("llama")
    with pytest.raises(QuantizationError, match=r"missing layers \[1\]"):
        attach_kv_scales(model, {0: (torch.ones(1), torch.ones(1))})
    with pytest.raises(QuantizationError, match="finite and > 0"):
        attach_kv_scales(model, {0: (torch.ones(1), torch.zeros(1)), 1: (torch.ones(1), torch.ones(1))})
