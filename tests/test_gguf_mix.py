"""llama.cpp's other block types as weight grids (Q2_K, Q3_K, Q5_K, Q6_K, Q5_1, Q4_0, Q5_0, Q8_0, the non-uniform
IQ4_NL, IQ4_XS: quantkit.gguf.grids) and the mixes built on them (quantkit.gguf.mix: Q4_K_M, Q4_K_S, Q3_K_L, Q3_K_M,
Q3_K_S, Q2_K, IQ4_XS, IQ4_NL): each grid
dequantizes as the gguf package's own code reads its blocks, RTN with llama.cpp's search writes llama.cpp's
bytes, GPTQ onto each grid beats RTN, and a mix recipe writes llama-quantize's type tensor by tensor, read
back bit for bit."""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import quantkit  # noqa: E402
from quantkit.gguf import reference_quants as ref  # noqa: E402
from quantkit.algorithms.gptq import GPTQOptions, gptq_quantize, hessian_of  # noqa: E402
from quantkit.algorithms.rtn import RTNOptions, rtn_quantize  # noqa: E402
from quantkit.commands.cli import main  # noqa: E402
from quantkit.core.config_utils import ConfigError  # noqa: E402
from quantkit.gguf.mix import MIX_GRIDS, MixModel, mix_grid, use_more_bits  # noqa: E402
from quantkit.gguf.linear import GgufLinear  # noqa: E402
from quantkit.refmodels import resolve_model_name  # noqa: E402
from quantkit.gguf.types import GRID_TYPES  # noqa: E402
from quantkit.core.scheme import QuantScheme, grid_scheme  # noqa: E402

from .conftest import make_random_model  # noqa: E402
from .test_kquant import read_back  # noqa: E402

T = gguf.GGMLQuantizationType
NEW_GRIDS = ("q2_k", "q3_k", "q5_k", "q6_k", "q5_1", "q4_0", "q5_0", "q8_0")
#: bounds on the relative squared error of RTN with min-max fields on _weight (measured: Q3_K 0.033-0.040, Q2_K
#: 0.145-0.163)
BELOW_4_BITS = {"q3_k": 0.05, "q2_k": 0.2}


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.1) * 0.05
    w[torch.rand(n, k, generator=g) < 0.01] *= 8
    return w


@pytest.mark.parametrize("grid", NEW_GRIDS)
@pytest.mark.parametrize("n,k,seed", [(8, 256, 0), (5, 768, 1)])
def test_each_grid_dequantizes_as_the_gguf_package_reads_its_blocks(grid, n, k, seed):
    w = _weight(n, k, seed)
    w[1, :256] = 0  # a zero (super-)block stays zero
    spec = GRID_TYPES[grid]
    scheme = grid_scheme(grid)
    levels = (1 << spec.num_bits) - 1
    for observer in ("minmax", "mse"):
        kw = rtn_quantize(w, scheme, RTNOptions(observer=observer))
        assert int(kw.u.max()) <= levels
        blocks = GgufLinear.from_weight(kw).weight_blocks
        assert blocks.shape == (n, k // spec.block * gguf.GGML_QUANT_SIZES[getattr(T, spec.name)][1])
        theirs = gguf.quants.dequantize(blocks.numpy(), getattr(T, spec.name))  # llama.cpp's own Python
        assert np.array_equal(theirs, kw.dequantize().numpy()), observer
        assert torch.equal(kw.dequantize()[1, :256], torch.zeros(256))
        # every weight within half a step of its value, where the clamp does not bind
        step, minimum = kw.steps(*kw.fields())
        s, m = step.repeat_interleave(spec.group_size, 1), minimum.repeat_interleave(spec.group_size, 1)
        level = torch.where(s != 0, (w + m) / torch.where(s != 0, s, torch.ones_like(s)), torch.zeros_like(s))
        inside = (level > 0.5) & (level < levels - 0.5)
        assert ((kw.u.float() - level).abs()[inside] <= 0.5 + 1e-3).all()
    rel = {g: ((rtn_quantize(w, grid_scheme(g)).dequantize() - w).pow(2).sum() / w.pow(2).sum()).item()
           for g in ("q4_k", "q4_1", "q3_k", grid)}
    if spec.num_bits > 4:  # more bits, less error: each beats both 4-bit grids with a float minimum
        assert rel[grid] < 0.7 * min(rel["q4_k"], rel["q4_1"])
    elif spec.num_bits < 4:  # fewer bits, more error, within what these grids reach
        assert rel["q4_k"] < rel[grid] < BELOW_4_BITS[grid]
        if grid == "q2_k":
            assert rel["q3_k"] < rel[grid]
    else:  # Q4_0's signed scales: no worse than the uniform grid's best rule for positive scales
        uniform = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32)
        signed = rtn_quantize(w, uniform, RTNOptions(symmetric_scale="signed")).dequantize()
        assert rel[grid] < ((signed - w).pow(2).sum() / w.pow(2).sum()).item()


@pytest.mark.parametrize("grid,port", [("q2_k", ref.quantize_q2_k), ("q3_k", ref.quantize_q3_k),
                                       ("q4_k", ref.quantize_q4_k), ("q5_k", ref.quantize_q5_k),
                                       ("q6_k", ref.quantize_q6_k)])
def test_rtn_with_llama_cpps_search_writes_llama_cpps_bytes(grid, port):
    """The K-quant recipes' RTN (observer mse) is llama.cpp's own quantizer: the same bytes as the port of
    ggml's quantize_row_*_ref (itself checked against ggml in test_gguf_reference_quants.py)."""
    w = _weight(12, 512, 2)
    assert torch.equal(rtn_quantize(w, grid_scheme(grid), RTNOptions(observer="mse")).blocks(), port(w))


@pytest.mark.parametrize("grid", ["iq4_nl", "iq4_xs"])
@pytest.mark.parametrize("n,k,seed", [(8, 256, 0), (5, 768, 1)])
def test_the_iq4_grids_round_to_the_nearest_value_and_read_as_the_gguf_package(grid, n, k, seed):
    """IQ4_NL / IQ4_XS: every weight on the value (of ggml's 16) nearest it for the stored fields, a zero
    (super-)block stays zero, the gguf package reads the blocks as the grid dequantizes them; with llama.cpp's
    search (observer mse) the fields are its port's (reference_quants.iq4_*_fields) and the levels its own
    but where the fp16 rounding of the scale moves a weight across a midpoint."""
    w = _weight(n, k, seed)
    w[1, :256] = 0
    spec = GRID_TYPES[grid]
    values = torch.tensor(spec.values, dtype=torch.float32)
    for observer in ("minmax", "mse"):
        q = rtn_quantize(w, grid_scheme(grid), RTNOptions(observer=observer))
        theirs = gguf.quants.dequantize(q.blocks().numpy(), getattr(T, spec.name))
        y = q.dequantize()
        assert np.array_equal(theirs, y.numpy()), observer
        assert torch.equal(y[1, :256], torch.zeros(256))
        step = q.steps(*q.fields())[0].repeat_interleave(32, 1)  # [N, K]
        nearest = (w.unsqueeze(-1) - step.unsqueeze(-1) * values).abs().amin(-1)
        assert ((y - w).abs() <= nearest * (1 + 1e-6) + 1e-12).all(), observer
    port = getattr(ref, f"{grid}_fields")(w)
    assert all(torch.equal(a, b) for a, b in zip(q.fields(), port[1:]))
    assert (q.u == port[0]).float().mean() > 0.98
    if grid == "iq4_nl":  # the minmax fields put each block's extreme on the lowest value, -127
        minmax = rtn_quantize(w, grid_scheme(grid), RTNOptions())
        top = w.reshape(n, -1, 32).abs().argmax(-1, keepdim=True)
        assert (minmax.u.reshape(n, -1, 32).gather(-1, top)[w.reshape(n, -1, 32).abs().amax(-1) > 0] == 0).all()
    rel = {g: ((rtn_quantize(w, grid_scheme(g), RTNOptions(observer="mse")).dequantize() - w).pow(2).sum()
               / w.pow(2).sum()).item() for g in ("q4_0", grid)}
    assert rel[grid] < rel["q4_0"]  # the values denser near 0 fit a bell-shaped weight better than Q4_0's grid


@pytest.mark.parametrize("grid", NEW_GRIDS + ("iq4_nl", "iq4_xs"))
def test_gptq_onto_each_grid_beats_round_to_nearest(grid):
    g = torch.Generator().manual_seed(4)
    k = 512
    w = _weight(32, k, 5)
    mix = torch.randn(k, k, generator=g) / k**0.5
    x = (torch.randn(4096, k, generator=g) @ mix) * torch.rand(k, generator=g).mul(3).add(0.1)
    h = hessian_of(x)
    scheme = grid_scheme(grid)

    def out_err(wq):
        return (x @ (wq - w).T).pow(2).mean().item()

    rtn = rtn_quantize(w, scheme, RTNOptions(observer="mse"))
    for options in (GPTQOptions(), GPTQOptions(observer="mse")):
        q = gptq_quantize(w, h, scheme, options)
        assert type(q) is type(rtn) and q.scheme == scheme
        assert out_err(q.dequantize()) < 0.9 * out_err(rtn.dequantize()), options


def test_grid_schemes_fallbacks_and_mix_validation():
    with pytest.raises(ValueError, match="Q6_K: it needs num_bits: 6, symmetric: true, strategy: group, group_size: 16"):
        QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32, grid="q6_k")
    for grid, spec in GRID_TYPES.items():
        scheme = grid_scheme(grid)
        assert scheme.divides(spec.block) and not scheme.divides(spec.block + 16)
        assert scheme.bits_per_weight == gguf.GGML_QUANT_SIZES[getattr(T, spec.name)][1] * 8 / spec.block
    # llama-quantize's fallbacks for a width that is no multiple of 256, and quantkit's own for q4_k recipes
    llama_cpp = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0",
                 "iq4_xs": "iq4_nl"}  # tensor_type_fallback
    assert {grid: spec.llama_cpp_fallback for grid, spec in GRID_TYPES.items() if spec.llama_cpp_fallback} == llama_cpp
    for grid, fallback in llama_cpp.items():
        assert grid_scheme(grid).fitted(320, "smaller-group", llama_cpp=True) == grid_scheme(fallback)
    assert grid_scheme("q4_k").fitted(320, "smaller-group") == grid_scheme("q4_1")
    assert grid_scheme("q5_0").fitted(48, "smaller-group").grid == "uniform"  # no block of 32 at all
    with pytest.raises(ValueError, match="whole blocks of 256"):
        grid_scheme("q6_k").fitted(320, "error", llama_cpp=True)
    base = {"weights": {"num_bits": 4, "symmetric": False, "strategy": "group", "group_size": 32, "grid": "q4_k"}}
    with pytest.raises(ConfigError, match="mix must be one of q6_k, q5_k_m, q5_k_s, q4_k_m, q4_k_s, q3_k_l, q3_k_m, "
                                          "q3_k_s, q2_k, iq4_xs, iq4_nl"):
        quantkit.load_recipe({**base, "mix": "iq3_xxs"})
    with pytest.raises(ConfigError, match="needs weights on grid iq4_xs"):
        quantkit.load_recipe({**base, "mix": "iq4_xs"})
    with pytest.raises(ConfigError, match="needs weights on grid q4_k"):
        quantkit.load_recipe({"weights": {"num_bits": 4, "strategy": "group", "group_size": 32}, "mix": "q4_k_m"})
    with pytest.raises(ConfigError, match=r"around Q3_K: it needs weights on grid q3_k \(\{num_bits: 3, "
                                          r"symmetric: true, strategy: group, group_size: 16, grid: q3_k\}\)"):
        quantkit.load_recipe({**base, "mix": "q3_k_m"})
    for name, mix in (("w3a16-rtn-q3ks", "q3_k_s"), ("w3a16-gptq-q3km", "q3_k_m"), ("w3a16-rtn-q3kl", "q3_k_l"),
                      ("w2a16-gptq-q2k", "q2_k"), ("w5a16-rtn-q5km", "q5_k_m"), ("w5a16-gptq-q5ks", "q5_k_s"),
                      ("w6a16-gptq-q6k", "q6_k"), ("w4a16-rtn-iq4nl", "iq4_nl"), ("w4a16-gptq-iq4xs", "iq4_xs")):
        r = quantkit.load_recipe(name)
        assert r.mix == mix and r.weights == grid_scheme(MIX_GRIDS[mix])
    recipe = quantkit.load_recipe("w4a16-gptq-q4km")
    assert recipe.mix == "q4_k_m" and recipe.to_dict()["mix"] == "q4_k_m"
    with pytest.raises(ValueError, match="by its name and layer"):
        recipe.weights_for(256)


def test_the_mix_rules_are_llama_cpps():
    # use_more_bits(i, 30) by llama.cpp's formula, written out: i < 3, i >= 26, (i - 3) % 3 == 2
    assert [i for i in range(30) if use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    model = MixModel(30)
    v = [mix_grid("q4_k_m", f"model.layers.{i}.self_attn.v_proj", model) for i in range(30)]
    down = [mix_grid("q4_k_m", f"model.layers.{i}.mlp.down_proj", model) for i in range(30)]
    assert v == down and v.count("q6_k") == 14 and v[3] == "q4_k"
    assert {mix_grid("q4_k_m", f"model.layers.0.{n}", model) for n in
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")} == {"q4_k"}
    s_v = [mix_grid("q4_k_s", f"model.layers.{i}.self_attn.v_proj", model) for i in range(30)]
    s_down = [mix_grid("q4_k_s", f"model.layers.{i}.mlp.down_proj", model) for i in range(30)]
    assert s_v == ["q5_k"] * 4 + ["q4_k"] * 26 and s_down == ["q5_k"] * 3 + ["q4_k"] * 27
    seventy = MixModel(80, llama_70b=True)  # llama.cpp's 70B type: attn_v at least Q5_K
    assert mix_grid("q4_k_m", "model.layers.40.self_attn.v_proj", seventy) == "q5_k"
    assert mix_grid("q4_k_m", "model.layers.0.self_attn.v_proj", seventy) == "q6_k"
    assert {mix_grid(m, "model.layers.40.self_attn.v_proj", seventy) for m in ("q3_k_s", "q3_k_m", "q2_k")} == {"q5_k"}


def _types(mix: str, model: MixModel) -> dict[str, list[str]]:
    """The grid of each role, layer by layer, under the mix."""
    roles = {"v": "self_attn.v_proj", "down": "mlp.down_proj", "o": "self_attn.o_proj", "q": "self_attn.q_proj",
             "k": "self_attn.k_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj"}
    return {r: [mix_grid(mix, f"model.layers.{i}.{p}", model) for i in range(model.n_layers)] for r, p in roles.items()}


def test_the_q6_k_to_q2_k_mix_rules_are_llama_cpps():
    """llama_tensor_get_type_impl for a dense Llama of 32 layers (not Falcon, no experts), rule by rule."""
    n = 32
    plain = ("q", "k", "gate", "up")
    t = _types("q3_k_s", MixModel(n))
    assert all(t[r] == ["q3_k"] * n for r in t)
    t = _types("q3_k_m", MixModel(n))
    assert t["v"] == ["q5_k"] * 2 + ["q4_k"] * (n - 2)  # i_attention_wv < 2
    assert t["down"] == ["q5_k"] * (n // 16) + ["q4_k"] * (n - n // 16)  # i < n/16, else Q4_K (not Falcon)
    assert t["o"] == ["q4_k"] * n and all(t[r] == ["q3_k"] * n for r in plain)
    t = _types("q3_k_l", MixModel(n))
    assert t["v"] == t["down"] == t["o"] == ["q5_k"] * n and all(t[r] == ["q3_k"] * n for r in plain)
    t = _types("q2_k", MixModel(n, n_gqa=2))
    assert t["v"] == t["down"] == t["o"] == ["q3_k"] * n and all(t[r] == ["q2_k"] * n for r in plain)
    assert _types("q2_k", MixModel(n, n_gqa=4))["v"] == ["q4_k"] * n  # n_gqa() >= 4
    assert _types("q4_k_m", MixModel(n))["o"] == ["q4_k"] * n  # the Q4 mixes leave attn_output alone
    t = _types("q5_k_m", MixModel(n))  # Q4_K_M's rule on Q5_K
    more = ["q6_k" if use_more_bits(i, n) else "q5_k" for i in range(n)]
    assert t["v"] == t["down"] == more and t["o"] == ["q5_k"] * n and all(t[r] == ["q5_k"] * n for r in plain)
    for mix, grid in (("q5_k_s", "q5_k"), ("q6_k", "q6_k")):  # no per-tensor rule
        assert all(col == [grid] * n for col in _types(mix, MixModel(n)).values())
    for mix in ("q3_k_m", "q2_k", "iq4_nl", "iq4_xs"):
        assert mix_grid(mix, "lm_head", MixModel(n)) == "q6_k"
    for mix in ("iq4_nl", "iq4_xs"):  # Q5_K on attn_v with n_gqa() >= 4, on ffn_down in the first eighth (no imatrix)
        t = _types(mix, MixModel(n, n_gqa=2))
        assert t["v"] == t["o"] == [mix] * n and all(t[r] == [mix] * n for r in plain)
        assert t["down"] == ["q5_k"] * (n // 8) + [mix] * (n - n // 8)
        assert _types(mix, MixModel(n, n_gqa=4))["v"] == ["q5_k"] * n
        assert _types(mix, MixModel(80, llama_70b=True, n_gqa=8))["v"] == ["q5_k"] * 80
    assert MixModel.of(quantkit.load("ref:small").config) == MixModel(4, False, 2)  # 8 heads, 4 KV heads


def _source(tmp_path, hidden, intermediate, tied=False, family="llama"):
    tiny = resolve_model_name("ref:tiny")
    model = make_random_model(family, seed=7, vocab=4160, tied=tied, layers=8, hidden=hidden,
                              intermediate=intermediate).to(torch.bfloat16)
    src = tmp_path / f"{family}-{hidden}"
    model.save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny}/{name}", src / name)
    return src


def _expected_type(mix: str, name: str, k: int) -> str:
    grid = mix_grid(mix, name, MixModel(8, n_gqa=2))
    if k % GRID_TYPES[grid].block:
        grid = GRID_TYPES[grid].llama_cpp_fallback
    return GRID_TYPES[grid].name


RTN_MIX_RECIPES = {"q6_k": "w6a16-rtn-q6k", "q5_k_m": "w5a16-rtn-q5km", "q5_k_s": "w5a16-rtn-q5ks",
                   "q4_k_m": "w4a16-rtn-q4km", "q4_k_s": "w4a16-rtn-q4ks", "q3_k_m": "w3a16-rtn-q3km",
                   "q3_k_l": "w3a16-rtn-q3kl", "q2_k": "w2a16-rtn-q2k", "iq4_nl": "w4a16-rtn-iq4nl",
                   "iq4_xs": "w4a16-rtn-iq4xs"}


@pytest.mark.parametrize("hidden,intermediate,mix", [(256, 512, "q4_k_m"), (320, 768, "q4_k_m"), (320, 768, "q4_k_s"),
                                                     (256, 512, "q3_k_m"), (320, 768, "q3_k_l"), (256, 768, "q2_k"),
                                                     (320, 512, "q2_k"), (256, 512, "q5_k_m"), (320, 768, "q5_k_s"),
                                                     (256, 512, "q6_k"), (256, 512, "iq4_xs"), (320, 768, "iq4_xs"),
                                                     (320, 768, "iq4_nl")])
def test_a_mix_recipe_writes_llama_quantizes_types_read_back_bit_for_bit(tmp_path, capsys, hidden, intermediate, mix):
    """8 layers: Q4_K_M puts Q6_K on v_proj / down_proj of layers 0, 3, 6, 7 (use_more_bits(i, 8): i < 1, i >= 7, (i - 1) % 3 == 2); 320-wide
    inputs fall back as llama-quantize does (Q2_K, Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0); the
    output head is Q6_K (Q8_0 at 320) and the untied embedding the mix's default type (its fallback at 320),
    llama-quantize's defaults."""
    src = _source(tmp_path, hidden, intermediate)
    recipe = RTN_MIX_RECIPES[mix]
    out = tmp_path / "mix.gguf"
    assert main(["quantize", str(src), "--recipe", recipe, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"file type {mix.upper()}" in printed
    reader = gguf.GGUFReader(str(out))
    assert int(reader.fields["general.file_type"].parts[-1][0]) == getattr(gguf.LlamaFileType, "MOSTLY_" + mix.upper())
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 8)
    model = quantkit.load(src, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallbacks are announced
        quantkit.quantize(model, recipe, progress=False)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, GgufLinear)}
    assert len(layers) == 7 * 8
    for name, layer in layers.items():
        t = tensors[names.get_name(name + ".weight", try_suffixes=(".weight",))]
        assert t.tensor_type.name == layer.gguf_type == _expected_type(mix, name, layer.in_features), name
        assert torch.equal(read_back(t, name, layer.out_features), layer.dequantized_weight()), name
    if mix == "q4_k_m":
        six = {n for n, m in layers.items() if m.gguf_type == ("Q6_K" if hidden == 256 else "Q8_0")}
        assert six == {f"model.layers.{i}.{p}" for i in (0, 3, 6, 7) for p in ("self_attn.v_proj", "mlp.down_proj")
                       if hidden == 256 or p == "self_attn.v_proj"}
    assert tensors["output.weight"].tensor_type.name == ("Q6_K" if hidden == 256 else "Q8_0")
    embd = MIX_GRIDS[mix] if hidden % GRID_TYPES[MIX_GRIDS[mix]].block == 0 else \
        GRID_TYPES[MIX_GRIDS[mix]].llama_cpp_fallback
    assert tensors["token_embd.weight"].tensor_type.name == embd.upper()
    if embd in ("q3_k", "q2_k", "iq4_xs", "iq4_nl"):  # llama.cpp's own rounding of the float embedding
        weight = quantkit.load(src, dtype=torch.float32).get_input_embeddings().weight.detach()
        port = getattr(ref, f"quantize_{embd}")(weight)
        assert np.array_equal(np.asarray(tensors["token_embd.weight"].data).reshape(-1), port.numpy().reshape(-1))


def test_calibrated_mix_recipes_quantize_each_linear_onto_its_grid(tmp_path, capsys):
    src = _source(tmp_path, 256, 512, tied=True, family="qwen3")
    for recipe in ("w4a16-gptq-q4km", "w4a16-awq-q4ks"):
        out = tmp_path / f"{recipe}.gguf"
        assert main(["quantize", str(src), "--recipe", recipe, "--out", str(out), "--calib", "ref",
                     "--calib-samples", "4", "--calib-seq-len", "64"]) == 0
        reader = gguf.GGUFReader(str(out))
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        mix = quantkit.load_recipe(recipe).mix
        for name, kind in types.items():
            if name.startswith("blk.") and name.endswith(".weight") and "norm" not in name:
                i, role = int(name.split(".")[1]), name.split(".")[2]
                hf = {"attn_v": "self_attn.v_proj", "ffn_down": "mlp.down_proj",
                      "attn_output": "self_attn.o_proj"}.get(role, "self_attn.q_proj")
                assert kind == _expected_type(mix, f"model.layers.{i}.{hf}", 256), name
        assert types["token_embd.weight"] == "Q6_K"  # tied: the output's type, as llama-quantize writes it
    assert "file type Q4_K_S" in capsys.readouterr().out


@pytest.mark.parametrize("grid", ["q4_1", "q5_1"])
def test_q1_grids_search_their_fields_with_an_importance(grid):
    """Q4_1 / Q5_1 with an importance (GPTQ's diag(H) under observer mse): llama.cpp's imatrix search of each
    block's step and minimum, which lowers the importance-weighted error of rounding to nearest and GPTQ's
    output error against the min-max fields; without one, the min-max fields (llama.cpp's _ref)."""
    g = torch.Generator().manual_seed(11)
    k = 512
    w = _weight(48, k, 12)
    x = (torch.randn(4096, k, generator=g) @ (torch.randn(k, k, generator=g) / k**0.5)) \
        * torch.rand(k, generator=g).mul(3).add(0.1)
    h = hessian_of(x)
    importance = torch.diag(h)
    scheme = grid_scheme(grid)
    cls = type(rtn_quantize(w, scheme, RTNOptions()))
    assert torch.equal(torch.stack(cls.choose_fields(w, search=True)), torch.stack(cls.choose_fields(w)))

    def weighted(q):
        return ((q.dequantize() - w).pow(2) * importance).sum().item()

    def out_err(q):
        return (x @ (q.dequantize() - w).T).pow(2).mean().item()

    minmax = cls.round(w, cls.choose_fields(w), scheme)
    searched = cls.round(w, cls.choose_fields(w, search=True, importance=importance), scheme)
    assert weighted(searched) < 0.9 * weighted(minmax)
    plain, mse = (gptq_quantize(w, h, scheme, GPTQOptions(observer=o)) for o in ("minmax", "mse"))
    assert out_err(mse) < 0.97 * out_err(plain)
    theirs = gguf.quants.dequantize(mse.blocks().numpy(), getattr(T, cls.GGUF_TYPE))  # llama.cpp's own Python
    assert np.array_equal(theirs, mse.dequantize().numpy())
