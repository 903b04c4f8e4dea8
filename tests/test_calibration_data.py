"""Calibration data: sources (text, JSONL, Parquet, folders, hub syntax), deterministic sampling, errors."""

import json

import pytest
import torch

import quantkit
from quantkit.calibration import CalibrationConfig, calibration_batches, load_texts, sample_token_windows
from quantkit.calibration.data import parse_source
from quantkit.core.errors import QuantizationError

from .calibration_fixtures import byte_tokenizer, tiny_model

LINES = [f"def function_{i}(x):\n    return x * {i} + {i * i}\n" for i in range(200)]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text("\n".join(LINES))
    return path


def test_windows_are_deterministic_per_seed_and_come_from_the_text(text_file):
    tok = byte_tokenizer()
    texts = load_texts(text_file)
    a = sample_token_windows(texts, tok, 6, 64, seed=0)
    b = sample_token_windows(texts, tok, 6, 64, seed=0)
    c = sample_token_windows(texts, tok, 6, 64, seed=1)
    assert a.shape == (6, 64) and a.dtype == torch.int64
    assert torch.equal(a, b) and not torch.equal(a, c)
    whole = text_file.read_text()
    for row in a:
        assert tok.decode(row[8:40].tolist()) in whole


def test_windows_start_with_bos_when_the_tokenizer_adds_it(text_file):
    tok = byte_tokenizer(bos=True)
    windows = sample_token_windows(load_texts(text_file), tok, 3, 32, seed=0)
    assert windows.shape == (3, 32) and (windows[:, 0] == tok.bos_token_id).all()
    assert (windows[:, 1:] != tok.bos_token_id).all()


def test_jsonl_parquet_and_folders(tmp_path, text_file):
    rows = [{"content": line, "id": i} for i, line in enumerate(LINES)]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    assert load_texts(jsonl, column="content") == LINES
    with pytest.raises(QuantizationError, match=r"no column 'text'; its columns: content, id .*--calib-column"):
        load_texts(jsonl)

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "parquet"
    folder.mkdir()
    pq.write_table(pa.table({"text": LINES[:100]}), folder / "a.parquet")
    pq.write_table(pa.table({"text": LINES[100:]}), folder / "b.parquet")
    (folder / "README.md").write_text("not data")
    assert load_texts(folder) == LINES  # parquet files win over text files, in sorted order

    texts = tmp_path / "texts"
    (texts / "sub").mkdir(parents=True)
    (texts / "one.txt").write_text("first document\nsecond line")
    (texts / "sub" / "two.py").write_text("x = 1")
    assert load_texts(texts) == ["first document\nsecond line", "x = 1"]  # one row per file


def test_source_syntax():
    hub = parse_source("hub:wikitext:wikitext-2-raw-v1:train:text")
    assert (hub.name, hub.config, hub.split, hub.column) == ("wikitext", "wikitext-2-raw-v1", "train", "text")
    hub = parse_source("hub:allenai/c4:validation:text")
    assert (hub.name, hub.config, hub.split, hub.column) == ("allenai/c4", None, "validation", "text")
    with pytest.raises(QuantizationError, match="expected hub:NAME"):
        parse_source("hub:wikitext:train")
    with pytest.raises(QuantizationError, match="is not a file, a folder or a hub dataset"):
        parse_source("/nonexistent/calib.txt")


def test_unknown_file_type(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"\x00\x01")
    with pytest.raises(QuantizationError, match="unknown type"):
        parse_source(path)


def test_too_few_tokens_in_a_source(text_file):
    model = tiny_model("llama", layers=1)
    config = CalibrationConfig(source=str(text_file), num_samples=1000, seq_len=128)
    with pytest.raises(QuantizationError, match=r"has only \d+ tokens, but 1000 samples x 128 tokens need 128000.*"
                                                r"--calib-samples"):
        calibration_batches(config, model, byte_tokenizer())


def test_too_few_or_invalid_token_tensors():
    model = tiny_model("llama", layers=1)
    with pytest.raises(QuantizationError, match=r"would see 40 tokens \(the token ids of calibration_data\); "
                                                r"calibration needs at least 256"):
        quantkit.quantize(model, "w4a16-gptq", calibration_data=[torch.randint(0, 320, (2, 20))], progress=False)
    with pytest.raises(QuantizationError, match=r"token ids outside \[0, 320\)"):
        calibration_batches(torch.full((2, 200), 5000), model)
    with pytest.raises(QuantizationError, match="integer token tensor"):
        calibration_batches([torch.randn(2, 200)], model)
    batches = calibration_batches([torch.randint(0, 320, (300,)), torch.randint(0, 320, (2, 50))], model)
    assert [tuple(b.shape) for b in batches] == [(1, 300), (2, 50)]


def test_no_source_for_a_non_reference_model_says_how_to_give_one():
    model = tiny_model("llama", layers=1)
    with pytest.raises(QuantizationError, match=r"needs calibration data: pass calibration_data= .* or --calib"):
        quantkit.quantize(model, "w4a16-awq", progress=False)


def test_text_source_end_to_end(text_file):
    model = tiny_model("llama", layers=1, vocab=320)
    config = CalibrationConfig(source=str(text_file), num_samples=8, seq_len=64, batch_size=3)
    batches = calibration_batches(config, model, byte_tokenizer())
    assert [tuple(b.shape) for b in batches] == [(3, 64), (3, 64), (2, 64)]
    quantkit.quantize(model, "w4a16-gptq", calibration_data=config, tokenizer=byte_tokenizer(), progress=False)
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "QuantLinear"
