"""Real readers: compressed-tensors dequantizes our checkpoints exactly; transformers loads them."""

import pytest
import torch

import quantkit
from quantkit.modules import QuantLinear

from .conftest import make_random_model

pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module", params=["w8a16-rtn", "w4a16-rtn", "w4a16-rtn-asym"])
def checkpoint(request, tmp_path_factory):
    model = quantkit.quantize(make_random_model("llama", seed=1), request.param, progress=False)
    return quantkit.save(model, tmp_path_factory.mktemp(request.param) / "ckpt"), request.param


def _hf_load(path, dequantize: bool):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    kwargs = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def test_compressed_tensors_dequantizes_to_our_weights(checkpoint):
    path, _ = checkpoint
    theirs = _hf_load(path, dequantize=True)  # compressed-tensors' own decompression
    ours = quantkit.load(path, backend="reference")
    checked = 0
    for name, module in ours.named_modules():
        if isinstance(module, QuantLinear):
            assert torch.equal(theirs.get_submodule(name).weight, module.dequantized_weight()), name
            checked += 1
    assert checked == 14


def test_transformers_logits_match(checkpoint):
    path, recipe = checkpoint
    ids = torch.randint(0, 512, (2, 32))
    ours = quantkit.load(path)
    # transformers 5.24 + compressed-tensors 0.20 loads asymmetric checkpoints only with dequantize=True.
    theirs = _hf_load(path, dequantize=recipe.endswith("asym"))
    with torch.no_grad():
        a, b = ours(ids).logits, theirs(ids).logits
    assert ((a - b).norm() / b.norm()).item() < 0.02


def test_transformers_reads_separate_config_groups(tmp_path):
    """A width the group does not divide (576) under the default rule: group 64 there, 128 on down_proj (1536),
    as two config groups naming their layers; transformers + compressed-tensors applies each to its layers."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=512,
                                      tie_word_embeddings=True)
    with pytest.warns(UserWarning, match="get int4 g64 sym"):
        model = quantkit.quantize(transformers.LlamaForCausalLM(config).eval(), "w4a16-rtn", progress=False)
    path = quantkit.save(model, tmp_path / "ckpt")
    ids = torch.randint(0, 512, (2, 32))
    theirs = _hf_load(path, dequantize=False)  # 5.24's dequantize=True path applies one group to every layer
    with torch.no_grad():
        a, b = quantkit.load(path)(ids).logits, theirs(ids).logits
    assert ((a - b).norm() / b.norm()).item() < 0.02


def test_a_quantized_lm_head_of_a_tied_model_is_untied(tmp_path):
    """ignore: [] quantizes lm_head too; with tied embeddings the embedding stays float for the lookup, and the
    config must stop saying "tied" or transformers looks for an lm_head.weight the checkpoint does not have."""
    from transformers import AutoModelForCausalLM

    from quantkit.quantization.recipe import Recipe
    from quantkit.core.scheme import QuantScheme

    model = make_random_model("llama", tied=True)
    recipe = Recipe(weights=QuantScheme(num_bits=8, strategy="channel"), ignore=())
    quantkit.quantize(model, recipe, progress=False)
    assert isinstance(model.lm_head, QuantLinear) and model.config.tie_word_embeddings is False
    quantkit.save(model, tmp_path / "q")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    ours = quantkit.load(tmp_path / "q", dtype=torch.float32, backend="reference")
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)
    float_model = make_random_model("llama", tied=True)  # the embedding itself is unchanged
    assert torch.equal(ours.model.embed_tokens.weight, float_model.model.embed_tokens.weight)
