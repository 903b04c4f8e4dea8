"""Weights on llama.cpp's Q4_K grid (quantkit.gguf.grids): RTN, GPTQ and AWQ quantize onto it, the GGUF file
holds exactly those weights (read back with the gguf package's own dequantization), and what cannot be
written that way is refused or falls back with a line saying so."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import quantkit  # noqa: E402
from quantkit.gguf import grids  # noqa: E402
from quantkit.algorithms.gptq import GPTQOptions, gptq_quantize, hessian_of  # noqa: E402
from quantkit.algorithms.rtn import RTNOptions, rtn_quantize  # noqa: E402
from quantkit.commands.cli import main  # noqa: E402
from quantkit.core.errors import QuantizationError  # noqa: E402
from quantkit.gguf.writing import rope_permutation  # noqa: E402
from quantkit.gguf.linear import GgufLinear  # noqa: E402
from quantkit.modules.quant_linear import QuantLinear  # noqa: E402
from quantkit.refmodels import resolve_model_name  # noqa: E402
from quantkit.core.scheme import QuantScheme  # noqa: E402

from .conftest import make_random_model  # noqa: E402

Q4K = QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=32, grid="q4_k")
UNIFORM = QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=32)
Q41 = QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=32, grid="q4_1")
T = gguf.GGMLQuantizationType


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    # rows of different magnitudes and a few outliers, as trained weights have
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.1) * 0.05
    w[torch.rand(n, k, generator=g) < 0.01] *= 8
    return w


@pytest.mark.parametrize("scheme", [Q4K, Q41], ids=["q4_k", "q4_1"])
@pytest.mark.parametrize("n,k,seed", [(8, 256, 0), (24, 768, 1), (3, 1024, 2)])
def test_fields_lie_on_the_grid_and_dequantize_as_ggml(n, k, seed, scheme):
    w = _weight(n, k, seed)
    kw = rtn_quantize(w, scheme, RTNOptions(observer="minmax"))
    assert int(kw.u.max()) <= 15
    if scheme is Q4K:
        assert int(kw.sc.max()) <= 63 and int(kw.mn.max()) <= 63 and (kw.dmin >= 0).all()
    blocks = GgufLinear.from_weight(kw).weight_blocks
    theirs = gguf.quants.dequantize(blocks.numpy(), T.Q4_K if scheme is Q4K else T.Q4_1)  # llama.cpp's own Python
    assert np.array_equal(theirs, kw.dequantize().numpy())
    # round to nearest: every weight on its group's nearest level (within the clamp to 0..15)
    step, minimum = kw.steps(*kw.fields())
    s, m = step.repeat_interleave(32, 1), minimum.repeat_interleave(32, 1)
    exact = (w + m) / s
    inside = (exact > 0.5) & (exact < 14.5)
    assert ((kw.u.float() - exact).abs()[inside] <= 0.5 + 1e-4).all()
    rel = ((kw.dequantize() - w).pow(2).sum() / w.pow(2).sum()).item()
    assert rel < 1.05 * ((rtn_quantize(w, UNIFORM).dequantize() - w).pow(2).sum() / w.pow(2).sum()).item()
    if scheme is Q4K:  # the recipes' observer, llama.cpp's search, is no worse than min-max (Q4_1 has no search)
        searched = rtn_quantize(w, scheme)
        assert (searched.dequantize() - w).pow(2).sum() <= (kw.dequantize() - w).pow(2).sum()


def test_a_zero_super_block_stays_zero():
    w = _weight(4, 512, 3)
    w[1, 256:] = 0
    for scheme in (Q4K, Q41):
        assert torch.equal(rtn_quantize(w, scheme).dequantize()[1, 256:], torch.zeros(256))


def test_gptq_onto_the_grid_beats_round_to_nearest():
    g = torch.Generator().manual_seed(4)
    k = 512
    w = _weight(32, k, 5)
    mix = torch.randn(k, k, generator=g) / k**0.5
    x = (torch.randn(4096, k, generator=g) @ mix) * torch.rand(k, generator=g).mul(3).add(0.1)  # correlated inputs
    h = hessian_of(x)

    def out_err(wq):
        return (x @ (wq - w).T).pow(2).mean().item()

    rtn = rtn_quantize(w, Q4K)
    for options in (GPTQOptions(), GPTQOptions(observer="mse"), GPTQOptions(act_order=False)):
        q = gptq_quantize(w, h, Q4K, options)
        assert isinstance(q, grids.KQuantWeight)
        assert out_err(q.dequantize()) < 0.9 * out_err(rtn.dequantize()), options
    mse = rtn_quantize(w, Q4K, RTNOptions(observer="mse"))
    assert (mse.dequantize() - w).pow(2).sum() < (rtn.dequantize() - w).pow(2).sum()


def test_scheme_and_recipe_validation():
    with pytest.raises(ValueError, match="q4_k"):
        QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32, grid="q4_k")
    with pytest.raises(ValueError, match="grid must be one of"):
        QuantScheme(strategy="channel", grid="q5_x")
    with pytest.raises(ValueError, match="compressed-tensors"):
        Q4K.to_dict()
    assert Q4K.fitted(768) is Q4K
    assert Q4K.fitted(384, "smaller-group") == Q41  # as llama.cpp falls back from K-quants
    assert Q4K.fitted(48, "smaller-group") == UNIFORM.fitted(48, "smaller-group")  # no block of 32: per channel
    with pytest.raises(ValueError, match="whole blocks of 256"):
        Q4K.fitted(384, "error")
    assert quantkit.load_recipe("w4a16-gptq-q4k").weights == Q4K


def read_back(tensor, name: str, rows: int, n_head: int = 4, n_kv: int = 2) -> torch.Tensor:
    """A GGUF tensor dequantized by the gguf package, q/k rows put back in the model's order (the test
    models' 4 heads and 2 KV heads)."""
    theirs = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
    if ".q_proj" in name:
        return theirs[torch.argsort(rope_permutation(rows, n_head))]
    if ".k_proj" in name:
        return theirs[torch.argsort(rope_permutation(rows, n_kv))]
    return theirs


def _source(tmp_path, family="llama", tied=True):
    tiny = resolve_model_name("ref:tiny")
    model = make_random_model(family, seed=7, vocab=4160, tied=tied, layers=1, hidden=256,
                              intermediate=512).to(torch.bfloat16)
    src = tmp_path / f"{family}-src"
    model.save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny}/{name}", src / name)
    return src


@pytest.mark.parametrize("family,recipe", [("llama", "w4a16-rtn-q4k"), ("qwen3", "w4a16-gptq-q4k"),
                                           ("qwen2", "w4a16-awq-q4k")])
def test_quantize_to_gguf_reads_back_bit_for_bit(tmp_path, capsys, family, recipe):
    src = _source(tmp_path, family)
    out = tmp_path / "model.gguf"
    calib = [] if recipe.endswith("rtn-q4k") else ["--calib", "ref", "--calib-samples", "4", "--calib-seq-len", "64"]
    assert main(["quantize", str(src), "--recipe", recipe, "--out", str(out), *calib]) == 0
    printed = capsys.readouterr().out
    assert "file type Q4_K_S" in printed and "7 Q4_K" in printed and "on the Q4_K grid: 7 linears" in printed
    # the same quantization in this process (RTN is deterministic; calibrated recipes: compare the file
    # with what quantkit computes from it, below)
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    arch = {"llama": "LLAMA", "qwen3": "QWEN3", "qwen2": "QWEN2"}[family]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), 1)
    model = quantkit.load(src, dtype=torch.bfloat16)
    if recipe.endswith("rtn-q4k"):
        quantkit.quantize(model, recipe, progress=False)
        layers = {n: m for n, m in model.named_modules() if isinstance(m, GgufLinear)}
        assert len(layers) == 7
        for name, layer in layers.items():
            t = tensors[names.get_name(name + ".weight", try_suffixes=(".weight",))]
            assert t.tensor_type == T.Q4_K
            assert torch.equal(read_back(t, name, layer.out_features), layer.dequantized_weight()), name
    else:
        for t in tensors.values():
            if t.name.startswith("blk.") and t.name.endswith(".weight") and "norm" not in t.name:
                assert t.tensor_type == T.Q4_K, t.name


def test_what_cannot_be_written_is_refused_or_announced(tmp_path, capsys):
    src = _source(tmp_path)
    capsys.readouterr()
    # a Q4_K recipe into a compressed-tensors folder: refused before any work, nothing written
    assert main(["quantize", str(src), "--recipe", "w4a16-rtn-q4k", "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "only a GGUF file holds" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ckpt").exists()
    model = quantkit.load(src)
    quantkit.quantize(model, "w4a16-rtn-q4k", progress=False)
    with pytest.raises(QuantizationError, match="GGUF"):
        quantkit.save(model, tmp_path / "ckpt2")
    assert not (tmp_path / "ckpt2").exists()
    # linears whose inputs are no whole super-blocks fall back to Q4_1 with float minimums, with a warning
    with pytest.warns(UserWarning, match="super-block of 256 does not divide in_features 128"):
        assert main(["quantize", "ref:tiny", "--recipe", "w4a16-rtn-q4k", "--out", str(tmp_path / "t.gguf")]) == 0
    out = capsys.readouterr().out
    assert "14 Q4_1" in out and "on the Q4_1 grid: 14 linears" in out and "minimum m = -s*(zp+8)" not in out


def test_kquant_linear_forward_is_its_dequantized_weight():
    kw = rtn_quantize(_weight(48, 512, 8), Q4K)
    bias = torch.randn(48)
    layer = GgufLinear.from_weight(kw, bias)
    x = torch.randn(5, 512)
    torch.testing.assert_close(layer(x), x @ kw.dequantize().T + bias)
    assert not isinstance(layer, QuantLinear)


def test_float_tensors_in_llama_cpps_k_quants(tmp_path, capsys):
    """--float-type q6_k / q4_k: the embedding in llama.cpp's own rounding (gguf_reference_quants), falling
    back to Q8_0 where the width is no multiple of 256, as llama-quantize does."""
    from quantkit.gguf.reference_quants import quantize_q6_k

    src = _source(tmp_path)
    out = tmp_path / "q6.gguf"
    assert main(["quantize", str(src), "--recipe", "w4a16-rtn-q4k", "--out", str(out), "--float-type", "q6_k"]) == 0
    assert "1 Q6_K" in capsys.readouterr().out
    embd = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}["token_embd.weight"]
    assert embd.tensor_type == T.Q6_K
    weight = quantkit.load(src, dtype=torch.float32).get_input_embeddings().weight.detach()
    assert np.array_equal(np.asarray(embd.data).reshape(-1), quantize_q6_k(weight).numpy().reshape(-1))
    tiny = tmp_path / "tiny.gguf"  # width 128: Q8_0
    assert main(["quantize", "ref:tiny", "--recipe", "w4a16-rtn-g32", "--dtype", "bfloat16", "--out", str(tiny),
                 "--float-type", "q6_k"]) == 0
    assert {t.name: t for t in gguf.GGUFReader(str(tiny)).tensors}["token_embd.weight"].tensor_type == T.Q8_0


def test_gguf_output_of_an_unsupported_architecture_is_refused_before_any_work(tmp_path, capsys):
    from fixtures.moe_fixtures import save_moe_model

    folder = tmp_path / "moe"
    save_moe_model("qwen3_moe", folder)
    capsys.readouterr()
    assert main(["quantize", str(folder), "--recipe", "w4a16-rtn-q4k", "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err
    assert "GGUF export supports model types" in err and "qwen3_moe" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m.gguf").exists()
    model = quantkit.load(folder)
    with pytest.raises(QuantizationError, match="mixture-of-experts"):  # the Python API too, before any work
        quantkit.quantize(model, "w4a16-rtn-q4k", progress=False)


def test_uniform_recipes_write_gguf_directly_from_an_fp32_source(tmp_path, capsys):
    """quantize --out FILE.gguf with a Q4_0-grid recipe on a float32 model: the scales are rounded to GGUF's
    fp16 block scale before the weights are, so the file is exact without a second rounding."""
    tiny = resolve_model_name("ref:tiny")
    src = tmp_path / "fp32"
    make_random_model("llama", seed=3, vocab=4160, layers=1).save_pretrained(src)  # float32
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny}/{name}", src / name)
    out = tmp_path / "q4_0.gguf"
    assert main(["quantize", str(src), "--recipe", "w4a16-rtn-g32", "--out", str(out)]) == 0
    assert "7 Q4_0" in capsys.readouterr().out
    model = quantkit.load(src)
    quantkit.quantize(model, "w4a16-rtn-g32", progress=False, scale_dtype=torch.float16)
    tensors = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    theirs = gguf.quants.dequantize(tensors["blk.0.ffn_down.weight"].data, T.Q4_0)
    assert np.array_equal(theirs, down.dequantized_weight().numpy())
