"""GGUF export: ggml block layouts against the `gguf` package's own dequantization, and exported files read
back with GGUFReader + gguf.quants.dequantize equal, bit for bit, to quantkit's dequantized weights."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import quantkit  # noqa: E402
from quantkit.commands.cli import main  # noqa: E402
from quantkit.gguf.writing import rope_permutation  # noqa: E402
from quantkit.gguf import blocks as gguf_blocks  # noqa: E402
from quantkit.gguf.grids import dequantize_blocks  # noqa: E402
from quantkit.gguf.types import GGML_TYPES  # noqa: E402
from quantkit.modules.quant_linear import QuantLinear  # noqa: E402
from quantkit.quantization.recipe import load_recipe  # noqa: E402
from quantkit.refmodels import resolve_model_name  # noqa: E402

from .conftest import make_random_model  # noqa: E402

T = gguf.GGMLQuantizationType
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (7, 256)])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_match_the_gguf_package(kind, shape):
    g = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    n, k = shape
    d = (torch.rand(n, k // 32, generator=g) * 0.1 + 1e-3).half()
    if kind == "Q4_0":
        q = torch.randint(-8, 8, shape, generator=g)
        data = gguf_blocks.pack_q4_0(q, d)
        back = gguf_blocks.unpack_q4_0(data)
        assert torch.equal(back[0], q.to(torch.int8)) and torch.equal(back[1], d)
        expect = (q.float().reshape(n, -1, 32) * d.float().unsqueeze(-1)).reshape(n, k)
    elif kind == "Q4_1":
        q = torch.randint(0, 16, shape, generator=g)
        m = (torch.randn(n, k // 32, generator=g) * 0.1).half()
        data = gguf_blocks.pack_q4_1(q, d, m)
        u, d2, m2 = gguf_blocks.unpack_q4_1(data)
        assert torch.equal(u, q.to(torch.uint8)) and torch.equal(d2, d) and torch.equal(m2, m)
        expect = (q.float().reshape(n, -1, 32) * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)).reshape(n, k)
    else:
        q = torch.randint(-128, 128, shape, generator=g)
        data = gguf_blocks.pack_q8_0(q, d)
        assert torch.equal(gguf_blocks.unpack_q8_0(data)[0], q.to(torch.int8))
        expect = (q.float().reshape(n, -1, 32) * d.float().unsqueeze(-1)).reshape(n, k)
    assert data.shape == (n, k // 32 * GGML_TYPES[kind].block_bytes)
    theirs = gguf.quants.dequantize(data.numpy(), getattr(T, kind))
    assert np.array_equal(theirs, dequantize_blocks(data, kind).numpy())
    assert np.array_equal(theirs, expect.numpy())


def test_block_nibble_order_is_ggmls():
    """Weight j in the low nibble of byte j, weight j + 16 in its high nibble (ggml-common.h block_q4_0)."""
    q = torch.arange(32).reshape(1, 32) % 16 - 8  # values -8..7, -8..7
    data = gguf_blocks.pack_q4_0(q, torch.ones(1, 1, dtype=torch.float16))
    assert data[0, 2] == (0 | (0 << 4)) and data[0, 3] == (1 | (1 << 4)) and data[0, 17] == (15 | (15 << 4))
    with pytest.raises(ValueError, match="multiple of the block size"):
        gguf_blocks.pack_q4_0(torch.zeros(2, 48, dtype=torch.int8), torch.ones(2, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="outside"):
        gguf_blocks.pack_q4_0(torch.full((1, 32), 8), torch.ones(1, 1, dtype=torch.float16))


def test_rope_permutation_is_llama_cpps():
    """convert_hf_to_gguf's LlamaModel.permute, as written there."""
    w = torch.randn(64, 8)
    n_head = 4
    theirs = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(w[rope_permutation(64, n_head)], theirs)


def _checkpoint(tmp_path, family, recipe, *, dtype=torch.bfloat16, tied=True, seed=0):
    tiny = resolve_model_name("ref:tiny")
    model = make_random_model(family, seed=seed, vocab=4160, tied=tied).to(dtype)
    src = tmp_path / f"{family}-src"
    model.save_pretrained(src)
    for name in TOKENIZER_FILES:
        shutil.copy(f"{tiny}/{name}", src / name)
    model = quantkit.load(src, dtype=dtype)
    calibrated = (load_recipe(recipe) if isinstance(recipe, str) else recipe).needs_calibration
    calib = torch.randint(0, 4160, (4, 64), generator=torch.Generator().manual_seed(seed)) if calibrated else None
    quantkit.quantize(model, recipe, calib, progress=False)
    out = tmp_path / f"{family}-{recipe if isinstance(recipe, str) else recipe.name + '-custom'}"
    quantkit.save(model, out, tokenizer_source=str(src))
    return out


def _read(path):
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    return reader, tensors


def _field(reader, key):
    f = reader.fields[key]
    return f.contents()


CASES = [("llama", "w4a16-rtn-g32", "Q4_0"), ("mistral", "w8a16-rtn-g32", "Q8_0"), ("qwen2", "w4a16-rtn-asym-g32", "Q4_1"),
         ("qwen3", "w4a16-rtn-g32", "Q4_0"), ("llama", "w4a16-rtn", "Q4_0"), ("qwen3", "w8a16-rtn", "Q8_0"),
         ("llama", "w4a16-gptq-g32", "Q4_0"), ("qwen2", "w8a16-gptq-g32", "Q8_0")]


@pytest.mark.parametrize("family,recipe,kind", CASES)
def test_export_reads_back_bit_for_bit(tmp_path, capsys, family, recipe, kind):
    ckpt = _checkpoint(tmp_path, family, recipe, tied=family != "mistral")
    out = tmp_path / "model.gguf"
    assert main(["export", str(ckpt), "--format", "gguf", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"file type {kind}" in printed
    reader, tensors = _read(out)
    model = quantkit.load(ckpt, backend="reference")
    cfg = model.config
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[family]
    assert _field(reader, "general.architecture") == arch
    assert _field(reader, f"{arch}.block_count") == cfg.num_hidden_layers
    assert _field(reader, f"{arch}.attention.head_count") == cfg.num_attention_heads
    assert _field(reader, f"{arch}.attention.head_count_kv") == cfg.num_key_value_heads
    assert _field(reader, f"{arch}.embedding_length") == cfg.hidden_size
    assert _field(reader, f"{arch}.feed_forward_length") == cfg.intermediate_size
    assert _field(reader, "tokenizer.ggml.model") == "gpt2" and _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert len(_field(reader, "tokenizer.ggml.tokens")) == cfg.vocab_size
    assert _field(reader, "tokenizer.ggml.bos_token_id") == 0 and _field(reader, "tokenizer.ggml.eos_token_id") == 1
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), cfg.num_hidden_layers)
    permute = family in ("llama", "mistral")
    seen = 0
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        t = tensors[names.get_name(name + ".weight", try_suffixes=(".weight",))]
        assert t.tensor_type == getattr(T, kind)
        theirs = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        if permute and ".q_proj" in name:
            theirs = theirs[torch.argsort(rope_permutation(module.out_features, cfg.num_attention_heads))]
        elif permute and ".k_proj" in name:
            theirs = theirs[torch.argsort(rope_permutation(module.out_features, cfg.num_key_value_heads))]
        ours = module.dequantized_weight()
        if kind == "Q4_1":  # exact up to the fp16 rounding of the minimum m = -s * (zp + 8), reported
            step = module.weight_scale.float().repeat_interleave(32, dim=1)
            assert ((theirs - ours).abs() <= step * 2**-10 * 8.5).all()
        else:
            assert torch.equal(theirs, ours), name
        seen += 1
    assert seen == 7 * cfg.num_hidden_layers
    embed = torch.from_numpy(gguf.quants.dequantize(tensors["token_embd.weight"].data,
                                                    tensors["token_embd.weight"].tensor_type).copy())
    assert torch.equal(embed, model.get_input_embeddings().weight.float())  # bf16 checkpoint -> BF16 (auto)
    assert ("output.weight" in tensors) == (family == "mistral")
    for n in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        assert tensors[n].tensor_type == T.F32
    if family == "qwen2":
        assert tensors["blk.0.attn_q.bias"].tensor_type == T.F32
    if family == "qwen3":
        assert "blk.0.attn_q_norm.weight" in tensors and "blk.0.attn_k_norm.weight" in tensors


def test_q4_1_reports_the_minimum_shift(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path, "llama", "w4a16-rtn-asym-g32")
    assert main(["export", str(ckpt), "--format", "gguf", "--out", str(tmp_path / "a.gguf")]) == 0
    assert "Q4_1 minimum m = -s*(zp+8) rounded to fp16: moves by at most" in capsys.readouterr().out


def test_refusals(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path, "llama", "w4a16-rtn-g32", dtype=torch.float32)  # fp32 scales: not fp16 values
    out = tmp_path / "m.gguf"
    assert main(["export", str(ckpt), "--format", "gguf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not fp16 values" in err and "--round-scales" in err and not out.exists()
    assert main(["export", str(ckpt), "--format", "gguf", "--out", str(out), "--round-scales"]) == 0
    assert "scales rounded to fp16: largest relative change" in capsys.readouterr().out
    assert main(["export", str(ckpt), "--format", "gguf", "--out", str(out), "--round-scales"]) == 2
    assert "exists" in capsys.readouterr().err  # no overwrite without --force
    assert main(["export", str(ckpt), "--format", "gguf", "--out", str(out), "--round-scales", "--force"]) == 0


def test_int8_asymmetric_is_refused_with_the_recipe_to_use(tmp_path, capsys):
    import dataclasses

    recipe = load_recipe("w8a16-rtn")
    recipe = dataclasses.replace(recipe, weights=dataclasses.replace(recipe.weights, symmetric=False))
    ckpt = _checkpoint(tmp_path, "llama", recipe)
    assert main(["export", str(ckpt), "--format", "gguf", "--out", str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err
    assert "has no GGUF block type" in err and "w8a16-rtn-g32" in err


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_transformers_reads_the_export_as_quantkit_runs_it(tmp_path, family):
    """An independent reader (transformers' GGUF loader, which also undoes the q/k permutation) gives the
    logits of quantkit's own load of the checkpoint, exactly (same dequantized weights, fp32)."""
    ckpt = _checkpoint(tmp_path, family, "w4a16-rtn-g32")
    out = tmp_path / "m.gguf"
    assert main(["export", str(ckpt), "--format", "gguf", "--out", str(out), "--float-type", "f32"]) == 0
    theirs = quantkit.load(out)
    ours = quantkit.load(ckpt, backend="reference", dtype=torch.float32)
    ids = torch.randint(3, 4096, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(theirs(ids).logits, ours(ids).logits, rtol=0, atol=1e-5)


def test_eval_scores_a_gguf_file(tmp_path, capsys):
    import json

    ckpt = tmp_path / "tiny-q4"
    assert main(["quantize", "ref:tiny", "--recipe", "w4a16-rtn-g32", "--dtype", "bfloat16", "--out", str(ckpt)]) == 0
    out = tmp_path / "tiny.gguf"
    assert main(["export", str(ckpt), "--format", "gguf", "--out", str(out)]) == 0
    capsys.readouterr()
    results = []
    for model, backend in ((out, "auto"), (ckpt, "reference")):  # both exact: the GGUF file loads dequantized,
        path = tmp_path / f"{model.name}.json"                    # the CPU kernel would round activations to int8
        assert main(["eval", str(model), "--baseline", "ref:tiny", "--max-tokens", "1024", "--window", "256",
                     "--dtype", "float32", "--backend", backend, "--json", str(path)]) == 0
        results.append(json.loads(path.read_text()))
    gguf_result, ckpt_result = results
    assert 0 < gguf_result["kl_divergence"] < 0.05
    assert gguf_result["kl_divergence"] == pytest.approx(ckpt_result["kl_divergence"], rel=1e-3)
    assert gguf_result["top1_agreement"] == pytest.approx(ckpt_result["top1_agreement"], abs=2e-3)
