"""Checkpoints keep the source's dtype (bf16 in, bf16 out) unless asked, and quantize prints sizes on disk."""

import re
from collections import Counter

import pytest
import torch
from safetensors import safe_open

import quantkit
from quantkit.commands.cli import main
from quantkit.core.errors import QuantizationError
from quantkit.formats.loading import folder_size_bytes, load_float_model, resolve_model_source


def _float_dtypes(folder) -> Counter:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return Counter(f.get_slice(k).get_dtype() for k in f.keys() if f.get_slice(k).get_dtype().startswith(("F", "BF")))


def test_bf16_source_gives_a_bf16_checkpoint_and_the_size_on_disk(tmp_path, capsys):
    source = resolve_model_source("ref:tiny")  # weights stored in bf16, config.json says float32
    out = tmp_path / "w8"
    assert main(["quantize", "ref:tiny", "--recipe", "w8a16-rtn", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert set(_float_dtypes(out)) == {"BF16"}, "embeddings, norms and scales stay in the source dtype"
    before, after = folder_size_bytes(source), folder_size_bytes(out)
    assert after < before
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    assert f"{mib(before)} source (bfloat16, on disk) -> {mib(after)} checkpoint (bfloat16, on disk), " \
           f"{before / after:.2f}x smaller" in printed
    bits = float(re.search(r"([\d.]+) bits/weight stored", printed).group(1))
    assert 8 < bits < 8.5, "bits/weight counts the scales as saved (bf16)"
    assert quantkit.load(out).dtype == torch.float32, "evaluation still runs in config.json's dtype"


def test_asked_dtype_is_kept(tmp_path, capsys):
    out = tmp_path / "w4"
    assert main(["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", str(out), "--dtype", "float32"]) == 0
    assert "checkpoint (float32, on disk)" in capsys.readouterr().out
    assert set(_float_dtypes(out)) == {"F32"}


def test_save_writes_the_source_dtype_or_the_one_given(tmp_path):
    model = quantkit.quantize(load_float_model("ref:tiny"), "w4a16-rtn", progress=False)
    assert model.dtype == torch.float32
    assert set(_float_dtypes(quantkit.save(model, tmp_path / "a"))) == {"BF16"}
    assert set(_float_dtypes(quantkit.save(model, tmp_path / "b", dtype=torch.float16))) == {"F16"}
    reloaded = quantkit.load(tmp_path / "a")
    assert set(_float_dtypes(quantkit.save(reloaded, tmp_path / "c"))) == {"BF16"}, "a reloaded checkpoint stays bf16"


def test_values_that_do_not_fit_the_dtype_are_refused(tmp_path):
    from .conftest import make_random_model

    model = quantkit.quantize(make_random_model("llama"), "w8a16-rtn", progress=False)
    with torch.no_grad():
        model.model.norm.weight[0] = 1e6
    with pytest.raises(QuantizationError, match=r"model\.norm\.weight \(1 NaN/Inf value\) after conversion to torch\.float16"):
        quantkit.save(model, tmp_path / "f16", dtype=torch.float16)
    assert not (tmp_path / "f16").exists()


@torch.no_grad()
def test_in_memory_model_computes_what_the_bf16_checkpoint_holds(tmp_path):
    model = quantkit.quantize(load_float_model("ref:tiny"), "w4a16-rtn", progress=False)
    reloaded = quantkit.load(quantkit.save(model, tmp_path / "w4"), backend="reference")
    model.apply(lambda m: m.prepare("reference") if hasattr(m, "prepare") else None)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids).logits, reloaded(ids).logits, rtol=0, atol=0)


@pytest.fixture(scope="module")
def w8_model():
    from tests.conftest import make_random_model

    return quantkit.quantize(make_random_model("llama"), "w8a16-rtn", progress=False)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int8, torch.bool, torch.float64, torch.float8_e4m3fn,
                                   "int8", "cuda", "float64", 16])
def test_save_refuses_a_dtype_no_checkpoint_holds(tmp_path, w8_model, dtype):
    from quantkit.core.errors import UsageError

    with pytest.raises(UsageError, match=r"cannot be written in a checkpoint: choose torch.bfloat16, torch.float16"):
        quantkit.save(w8_model, tmp_path / "ck", dtype=dtype)
    assert list(tmp_path.iterdir()) == [], "nothing is written"


@pytest.mark.parametrize("name, stored", [("bfloat16", "BF16"), ("float16", "F16"), ("float32", "F32"),
                                          ("torch.bfloat16", "BF16")])
def test_save_takes_a_dtype_by_name(tmp_path, w8_model, name, stored):
    out = quantkit.save(w8_model, tmp_path / "ck", dtype=name)
    assert set(_float_dtypes(out)) == {stored}
    quantkit.load(out)  # and the checkpoint loads
