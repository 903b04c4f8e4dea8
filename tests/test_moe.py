"""Mixture-of-experts models: every family's experts quantized (the fused 3-D parameters split into
per-expert linears), routers kept float, per-expert checkpoint names, load + generate against the
family's own code running the dequantized weights."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors import safe_open
from torch import nn

import quantkit
from quantkit.core.errors import QuantizationError
from quantkit.modules.quant_experts import QuantExperts
from quantkit.modules.quant_linear import QuantLinear
from quantkit.modules.moe import router_names, to_disk_name
from quantkit.quantization.weight_census import weight_census
from fixtures.moe_fixtures import MOE_FAMILIES, make_moe_model

RTN_RECIPES = ("w4a16-rtn", "w8a16-rtn", "w4a16-rtn-asym")


def dequantized_twin(family: str, quantized: nn.Module) -> nn.Module:
    """The family's own float model (transformers' fused experts and routing) holding the quantized
    model's dequantized weights."""
    twin = make_moe_model(family)
    mods = dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in twin.named_modules():
            q = mods.get(name)
            if isinstance(q, QuantLinear):
                module.weight.copy_(q.dequantized_weight())
            elif isinstance(q, QuantExperts):
                for e, ex in enumerate(q.experts()):
                    gate, up, down = (p.dequantized_weight() for p in ex.projections())
                    module.gate_up_proj[e].copy_(torch.cat([gate, up]))
                    module.down_proj[e].copy_(down)
    return twin


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("recipe", RTN_RECIPES)
def test_rtn_quantizes_every_expert_and_keeps_routers_float(family, recipe, tmp_path):
    model = make_moe_model(family)
    quantkit.quantize(model, recipe, progress=False)
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(experts) == 2 and all(m.quantized and m.num_experts == 8 for m in experts)
    assert not any(p.dim() == 3 for p in model.parameters())  # no fused expert weight left
    routers = router_names(model)
    assert len(routers) == (4 if family == "qwen2_moe" else 2)
    assert not any(isinstance(model.get_submodule(r), QuantLinear) for r in routers)
    if family == "qwen2_moe":
        assert isinstance(model.model.layers[0].mlp.shared_expert.down_proj, QuantLinear)
    census = weight_census(model)
    assert census.share(census.quantized) > 85.0
    assert set(census.float_by_kind) == {"embeddings", "lm_head", "routers", "norms and biases"}

    out = quantkit.save(model, tmp_path / "q")
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert {to_disk_name(r, family) for r in routers} | {"lm_head"} == set(qcfg["ignore"])
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    block, (g, u, d) = ("block_sparse_moe", ("w1", "w3", "w2")) if family == "mixtral" else (
        "mlp", ("gate_proj", "up_proj", "down_proj"))
    for layer in range(2):
        for e in range(8):
            for proj in (g, u, d):
                for t in ("weight_packed", "weight_scale", "weight_shape"):
                    assert f"model.layers.{layer}.{block}.experts.{e}.{proj}.{t}" in names
        assert f"model.layers.{layer}.{block}.gate.weight" in names
    assert any(".weight_zero_point" in n for n in names) == recipe.endswith("asym")

    ids = torch.randint(3, 512, (2, 10), generator=torch.Generator().manual_seed(1))
    loaded = quantkit.load(out, backend="reference")
    twin = dequantized_twin(family, loaded)
    with torch.no_grad():
        got, want = loaded(ids).logits, twin(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model(ids).logits, got, rtol=0, atol=0)  # in memory == loaded
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded.generate(ids[:1], **gen), twin.generate(ids[:1], **gen))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_fast_backend_generates_as_reference(family, tmp_path):
    """The CPU int4 kernels through the grouped MoE op: logits within bf16 error of the reference backend."""
    model = make_moe_model(family)
    quantkit.quantize(model, "w4a16-rtn", progress=False)
    out = quantkit.save(model, tmp_path / "q")
    ref = quantkit.load(out, backend="reference")
    fast = quantkit.load(out, backend="auto")
    assert all(m._moe_prepared is not None for m in fast.modules() if isinstance(m, QuantExperts))
    ids = torch.randint(3, 512, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = ref(ids).logits, fast(ids).logits
    assert (a - b).abs().mean() / a.abs().mean() < 2 ** -6  # (random logits are flat: argmax flips mean nothing)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 256, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(7)])
    w = torch.rand(7, 2, generator=g)
    r, f = ref.model.layers[1].mlp.experts(x, idx, w), fast.model.layers[1].mlp.experts(x, idx, w)
    # the CPU kernels round activations to int8 per block of 32 (quantkit/kernels/README.md: 2e-3..8e-3 per
    # linear), here twice in a row (gate/up, then down)
    assert (r - f).abs().mean() / r.abs().mean() < 2 ** -6


class _OddExperts(nn.Module):
    """Fused experts in a layout quantkit does not know (transposed)."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(4, 64, 128))


def test_unreachable_matrices_are_an_error_unless_ignored(random_model_folder):
    from tests.conftest import make_random_model

    model = make_random_model("llama")
    model.model.layers[0].mlp.odd = _OddExperts()
    with pytest.raises(QuantizationError, match=r"model\.layers\.0\.mlp\.odd\.w_in \[4, 64, 128\].*ignore"):
        quantkit.quantize(model, "w4a16-rtn", progress=False)
    quantkit.quantize(model, {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                          "group_size": 128},
                              "ignore": ["lm_head", "re:.*mlp\\.odd$"]}, progress=False)
    census = weight_census(model)
    assert "model.layers.0.mlp.odd" in census.float_names["other"]
    model2 = make_random_model("llama")
    model2.model.layers[1].odd = _OddExperts()
    quantkit.quantize(model2, "w4a16-rtn", progress=False, leave_float=True)
    assert "left float" in weight_census(model2).lines()[1]


def test_dense_census_has_no_routers():
    from tests.conftest import make_random_model

    model = make_random_model("llama", tied=False)
    quantkit.quantize(model, "w4a16-rtn", progress=False)
    census = weight_census(model)
    assert "routers" not in census.float_by_kind and census.float_by_kind["lm_head"] == 512 * 128
    assert census.total == sum(p.numel() for p in make_random_model("llama", tied=False).parameters())


def test_cli_prints_share_and_float_kinds(tmp_path, capsys):
    from quantkit.commands.cli import main
    from fixtures.moe_fixtures import save_moe_model

    src = save_moe_model("qwen3_moe", tmp_path / "src")
    assert main(["quantize", str(src), "--recipe", "w4a16-rtn", "--out", str(tmp_path / "q")]) == 0
    text = capsys.readouterr().out
    assert "% of 2.23M weights quantized" in text and "routers 0.2%" in text
    assert "gate_proj, up_proj, down_proj" in text


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("recipe", ["w4a16-rtn", "w8a16-rtn", pytest.param("w8a16-rtn-asym", marks=pytest.mark.xfail(
    strict=True, reason="transformers 5.24's CompressedTensorsDequantize conversion of merged experts does not "
                        "collect the experts' weight_zero_point: 'Asymmetric quant requires zero-point values'"))])
def test_transformers_with_compressed_tensors_reads_the_experts(family, recipe, tmp_path):
    """transformers + compressed-tensors load quantkit's per-expert tensors (decompressed into the fused
    float experts): the same weights as quantkit's reference dequantization, the same logits."""
    import transformers

    model = make_moe_model(family)
    name = recipe if recipe != "w8a16-rtn-asym" else {"weights": {"num_bits": 8, "type": "int", "symmetric": False,
                                                                  "strategy": "channel"}}
    quantkit.quantize(model, name, progress=False)
    out = quantkit.save(model, tmp_path / "q")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # asymmetric checkpoints load only with dequantize=True (transformers 5.24 + compressed-tensors 0.20,
        # dense models too: tests/test_interop.py)
        kwargs = {"quantization_config": transformers.CompressedTensorsConfig(dequantize=True)} if (
            recipe.endswith("asym")) else {}
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out, **kwargs).eval()
    ours = quantkit.load(out, backend="reference")
    fused = theirs.model.layers[1].mlp.experts
    for e, ex in enumerate(ours.model.layers[1].mlp.experts.experts()):
        gate, up, down = (p.dequantized_weight() for p in ex.projections())
        torch.testing.assert_close(fused.gate_up_proj[e].detach(), torch.cat([gate, up]), rtol=0, atol=0)
        torch.testing.assert_close(fused.down_proj[e].detach(), down, rtol=0, atol=0)
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-4)


def test_kv_only_recipe_on_moe_saves_float_experts_one_by_one(tmp_path):
    model = make_moe_model("qwen2_moe")
    ids = torch.randint(3, 512, (4, 64), generator=torch.Generator().manual_seed(5))
    quantkit.quantize(model, "kv-fp8", ids, progress=False)
    out = quantkit.save(model, tmp_path / "q")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names and "model.layers.0.self_attn.k_scale" in names
    loaded = quantkit.load(out)
    experts = loaded.model.layers[0].mlp.experts
    assert isinstance(experts, QuantExperts) and not experts.quantized
    torch.testing.assert_close(experts.experts()[3].up_proj.weight, model.model.layers[0].mlp.experts.experts()[3].up_proj.weight)


def test_unfusing_holds_one_layer_of_experts_twice_at_most(monkeypatch):
    """Each fused parameter is freed once its layer is split: when layer i is copied, the fused weights of
    the layers before it are gone (no second full copy of the experts)."""
    import gc
    import weakref

    from quantkit.modules import moe

    model = make_moe_model("olmoe", layers=4)
    refs = [weakref.ref(layer.mlp.experts.gate_up_proj) for layer in model.model.layers]
    alive_at_call = []
    real = QuantExperts.from_fused.__func__

    def spy(cls, fused, names):
        gc.collect()
        alive_at_call.append(sum(r() is not None for r in refs))
        return real(cls, fused, names)

    monkeypatch.setattr(QuantExperts, "from_fused", classmethod(spy))
    assert len(moe.unfuse_experts(model)) == 4
    assert alive_at_call == [4, 3, 2, 1]
    gc.collect()
    assert all(r() is None for r in refs)


def test_rtn_on_deepseek_v3_layout():
    """A family without a calibration adapter: RTN reaches its routed and shared experts, its router stays
    float, and the model computes with the dequantized weights as transformers' own code does."""
    model = make_moe_model("deepseek_v3")
    quantkit.quantize(model, "w4a16-rtn", progress=False)
    assert [n for n, m in model.named_modules() if isinstance(m, QuantExperts)] == ["model.layers.1.mlp.experts"]
    assert isinstance(model.model.layers[1].mlp.shared_experts.down_proj, QuantLinear)
    assert router_names(model) == ["model.layers.1.mlp.gate"]
    twin = dequantized_twin("deepseek_v3", model)
    ids = torch.randint(3, 512, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=1e-4, atol=1e-4)
