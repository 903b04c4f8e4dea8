"""Calibration token counts (one rule for the CLI and the API), the cache folder's environment variables and
unwritable caches, damaged cached kernel libraries, and the roofline of models whose linears took several
weight schemes."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

import quantkit
from quantkit.calibration.data import MIN_CALIBRATION_TOKENS, CalibrationConfig
from quantkit.commands.cli import main
from quantkit.core.errors import QuantizationError, UsageError
from quantkit.harness.roofline import (
    ModelShape, RooflineScheme, decoder_weight_bytes, linear_weight_bytes, scheme_from_quantization_config,
)
from quantkit.kernels import cpu_extension
from quantkit.modules.quant_linear import QuantLinear
from quantkit.refmodels import corpus

from fixtures.moe_fixtures import make_moe_model


# -- calibration: at least MIN_CALIBRATION_TOKENS tokens, however they are asked for ----------------------

@pytest.mark.parametrize("samples,seq_len", [(1, 4), (3, 64), (1, 255)])
def test_too_few_calibration_tokens_are_refused_in_python(samples, seq_len):
    with pytest.raises(QuantizationError, match=rf"would see {samples * seq_len} tokens \({samples} samples x "
                                                rf"{seq_len} tokens\); calibration needs at least "
                                                rf"{MIN_CALIBRATION_TOKENS}"):
        CalibrationConfig(source="ref", num_samples=samples, seq_len=seq_len)


def test_the_cli_refuses_too_few_calibration_tokens_before_writing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["quantize", "ref:tiny", "--recipe", "w4a16-gptq", "--out", str(out), "--calib-samples", "1",
                 "--calib-seq-len", "4"]) == 2
    assert "would see 4 tokens (1 samples x 4 tokens); calibration needs at least 256" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("field,value", [("num_samples", "8"), ("seq_len", 64.0), ("seed", None), ("batch_size", True)])
def test_calibration_config_fields_of_the_wrong_type_are_named(field, value):
    with pytest.raises(QuantizationError, match=f"calibration {field} must be an integer"):
        CalibrationConfig(**{field: value})


# -- the cache folder ----------------------------------------------------------------------------------

@pytest.mark.parametrize("env,expected", [
    ({"QUANTKIT_CACHE_DIR": "/a/qk"}, "/a/qk"),
    ({"QUANTKIT_CACHE": "/b/qk"}, "/b/qk"),
    ({"XDG_CACHE_HOME": "/c"}, "/c/quantkit"),
    ({}, os.path.expanduser("~/.cache/quantkit")),
])
def test_the_corpus_and_the_kernels_share_one_cache_folder(monkeypatch, env, expected):
    for key in ("QUANTKIT_CACHE_DIR", "QUANTKIT_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert str(corpus.cache_root()) == expected == str(cpu_extension.cache_root())


@pytest.mark.parametrize("how", ["unwritable", "too long"])
def test_a_corpus_cache_that_cannot_be_written_is_a_usage_error(monkeypatch, tmp_path, how):
    if how == "unwritable":
        if os.geteuid() == 0:
            (tmp_path / "corpus").write_text("a file where the folder goes")  # stops root too
        else:
            tmp_path.chmod(0o500)
        monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path))
    else:
        monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path / ("x" * 300)))
    with pytest.raises(UsageError, match="the corpus cache .* cannot be written .*set QUANTKIT_CACHE_DIR"):
        corpus.heldout_text_path()
    tmp_path.chmod(0o700)


# -- a damaged cached kernel library is built again, never loaded -----------------------------------------

def _fake_library(library, size=4096):
    """A 64-bit ELF file of `size` bytes: one segment over the whole file, the section header table at its end."""
    import struct

    header = bytearray(size)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<QQ", header, 0x20, 64, size - 64 * 4)  # e_phoff, e_shoff
    struct.pack_into("<HHHH", header, 0x36, 56, 1, 64, 4)  # e_phentsize, e_phnum, e_shentsize, e_shnum
    struct.pack_into("<QQQQ", header, 64 + 8, 0, 0, 0, size)  # p_offset 0, p_vaddr, p_paddr, p_filesz
    library.write_bytes(bytes(header))
    return library


@pytest.mark.parametrize("damage", ["truncated", "edited", "truncated, no record"])
def test_a_damaged_cached_library_is_discarded(tmp_path, capsys, damage):
    library = _fake_library(tmp_path / "quantkit_cpu_test.so")
    (tmp_path / "wna16_q8dot.o").write_bytes(b"object")
    cpu_extension._write_record(library)
    if "no record" in damage:
        cpu_extension._record(library).unlink()
    if "truncated" in damage:
        os.truncate(library, 1000)
    else:
        library.write_bytes(library.read_bytes()[:-1] + b"\1")
    cpu_extension._discard_if_damaged(library)
    assert not any(tmp_path.iterdir())  # objects too: the build starts from the sources
    assert "do not match their build record" in capsys.readouterr().err


def test_a_whole_library_is_kept_and_one_built_before_records_is_recorded(tmp_path):
    library = _fake_library(tmp_path / "quantkit_cpu_test.so")
    cpu_extension._discard_if_damaged(library)  # no record yet: a whole ELF file is adopted
    record = cpu_extension._record(library)
    assert record.read_text().split()[1] == "4096"
    cpu_extension._discard_if_damaged(library)
    assert library.exists() and record.exists()


def test_load_builds_again_instead_of_loading_a_truncated_library(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path))
    key = cpu_extension.build_key()
    folder = tmp_path / "cpu-kernels" / key
    folder.mkdir(parents=True)
    library = _fake_library(folder / f"quantkit_cpu_{key}.so")
    os.truncate(library, 1000)  # what a full disk left of a build that had not written its record
    seen = []

    def load(**kwargs):
        seen.append(library.exists())
        raise RuntimeError("stop here")  # the test does not compile

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", load)
    with pytest.warns(UserWarning, match="stop here"):
        kernels = cpu_extension.load_cpu_kernels.__wrapped__()
    assert seen == [False] and not kernels.available  # the build ran without the damaged library


# -- the roofline sums each linear by its own scheme ---------------------------------------------------

def _true_linear_bytes(model, dtype_bytes: int) -> float:
    total = 0.0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            s = module.scheme
            total += linear_weight_bytes(module.in_features, module.out_features, RooflineScheme(
                weight_bits=s.num_bits, group_size=s.group_size if s.strategy == "group" else None,
                symmetric=s.symmetric, scale_bytes=dtype_bytes, dtype_bytes=dtype_bytes))
    return total


def _ragged_llama(**extra):
    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=256,
                                      max_position_embeddings=256, **extra)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("recipe", ["w4a16-rtn", "w4a16-rtn-asym", "w8a16-rtn"])
def test_roofline_of_a_ragged_dense_checkpoint_is_its_linears_bytes(recipe):
    model = quantkit.quantize(_ragged_llama(), recipe, progress=False)
    config = model.config.to_dict() | {"torch_dtype": "float32"}
    scheme = scheme_from_quantization_config(config)
    assert decoder_weight_bytes(ModelShape.from_config(config), scheme) == _true_linear_bytes(model, 4)
    if recipe != "w8a16-rtn":  # 576-wide inputs get groups of 64, down_proj's 1536 keeps 128
        assert scheme.group_size == 64 and scheme.describe().endswith("except down_proj: int4 g128 " +
                                                                      ("sym" if "asym" not in recipe else "asym"))


def test_roofline_of_a_moe_checkpoint_whose_expert_down_proj_took_g64():
    config = make_moe_model("qwen3_moe", layers=1).config
    config.moe_intermediate_size = 192  # no multiple of 128: the experts' down_proj takes g64
    torch.manual_seed(0)
    model = quantkit.quantize(transformers.Qwen3MoeForCausalLM(config), "w4a16-rtn", progress=False)
    config = model.config.to_dict() | {"torch_dtype": "float32"}
    scheme = scheme_from_quantization_config(config)
    assert scheme.layers == (("expert.down_proj", 4, 64, True, 1.0),)
    assert "expert.down_proj: int4 g64 sym" in scheme.describe()
    router = model.config.num_experts * model.config.hidden_size * 4  # float, counted by ModelShape
    assert decoder_weight_bytes(ModelShape.from_config(config), scheme) == _true_linear_bytes(model, 4) + router


def test_linears_left_float_by_the_ignore_list_count_float():
    model = _ragged_llama()
    recipe = {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64},
              "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}
    quantkit.quantize(model, recipe, progress=False)
    config = model.config.to_dict() | {"torch_dtype": "float32"}
    scheme = scheme_from_quantization_config(config)
    assert scheme.layers == (("down_proj", 32, None, True, 0.5),) and not scheme.quantize_lm_head
    float_down = 1536 * 576 * 4
    assert decoder_weight_bytes(ModelShape.from_config(config), scheme) == _true_linear_bytes(model, 4) + float_down


def test_bench_of_a_ragged_checkpoint_and_recipe_reports_each_scheme(tmp_path, capsys):
    model = _ragged_llama(tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "float")
    quantkit.save(quantkit.quantize(model, "w4a16-rtn", progress=False), tmp_path / "w4")
    for loop in ("transformers", "quantkit"):
        out = tmp_path / f"bench-{loop}.json"
        assert main(["bench", str(tmp_path / "w4"), "--baseline", str(tmp_path / "float"), "--variants", "w4a16-rtn",
                     "--decode-loop", loop, "--prompt-lens", "8",
                     "--context-lens", "8", "--batch-sizes", "1", "--warmup", "0", "--repeats", "1", "--gpu",
                     "h200", "--device", "cpu", "--dtype", "float32", "--json", str(out)]) == 0
        data = json.loads(out.read_text())
        described = {v["name"]: v["weights"] for v in data["variants"]}
        assert described["w4"] == described["w4a16-rtn"] == "int4 g64 sym, except down_proj: int4 g128 sym"
        assert "w4a16-rtn weights: int4 g64 sym, except down_proj: int4 g128 sym" in capsys.readouterr().out
        decode = {r["variant"]: r["roofline"]["bytes_breakdown"]["weights"] for r in data["decode"]}
        assert decode["w4"] == decode["w4a16-rtn"]


def test_advise_prices_w4g128_as_the_recipe_stores_it_on_ragged_widths():
    from quantkit.harness.roofline import fitted_to, standard_schemes

    model = quantkit.quantize(_ragged_llama(), "w4a16-rtn", progress=False)
    shape = ModelShape.from_config(model.config)
    w4 = next(s for s in standard_schemes() if s.name == "w4g128")
    fitted = fitted_to(w4, shape)
    assert [kind for kind, *_ in fitted.layers] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]
    assert decoder_weight_bytes(shape, fitted) == _true_linear_bytes(model, 2)
    assert decoder_weight_bytes(shape, w4) != _true_linear_bytes(model, 2)
