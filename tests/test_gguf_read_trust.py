"""GGUF files read by quantkit: the header and metadata validator (hypothesis), the tensor set llama.cpp
needs, the file's vocabulary, the baseline of a file whose embedding is on a grid, and the Mistral and
Qwen3 files that were refused though llama.cpp runs them. The CLI's messages: fixtures/robustness_cases_gguf_read.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantkit
from quantkit.core.errors import CheckpointError, EvaluationError, QuantizationError
from quantkit.gguf.reading import (
    Hyperparameters, check_gguf_tokenizer, check_hyperparameters, expected_tensors, gguf_origin, load_gguf_model,
    read_gguf,
)
from quantkit.harness.baseline import shape_mismatches, source_mismatches
from quantkit.harness.eval_text import TOKENIZER_FILES, load_tokenizer
from quantkit.modules.quant_linear import QuantLinear
from quantkit.refmodels import resolve_model_name

from .conftest import make_random_model
from fixtures.robustness_cases_gguf_read import rewrite, set_field, shuffled_vocabulary

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """ref:tiny quantized with w4a16-rtn-q40 and written as GGUF (Q4_0, the embedding Q8_0)."""
    from quantkit.commands.cli import main

    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    assert main(["quantize", "ref:tiny", "--recipe", "w4a16-rtn-q40", "--float-type", "q8_0", "--out", str(out)]) == 0
    return out


# -- the metadata validator -----------------------------------------------------------------------------------

def _fields(**sizes) -> dict:
    base = {"block_count": 2, "embedding_length": 128, "attention.head_count": 4, "attention.head_count_kv": 2,
            "feed_forward_length": 384, "context_length": 256, "rope.dimension_count": 32}
    return {f"llama.{k}": v for k, v in (base | sizes).items() if v is not None} | {"tokenizer.ggml.tokens": ["a"] * 64}


_VALUES = st.one_of(st.integers(-3, 2**40), st.just(0), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3),
                    st.none(), st.lists(st.integers(0, 4), max_size=3))


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(["block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
                            "feed_forward_length", "context_length", "rope.dimension_count", "attention.key_length",
                            "attention.layer_norm_rms_epsilon", "rope.freq_base", "vocab_size", "expert_count"]),
       value=_VALUES)
def test_any_metadata_value_is_accepted_consistently_or_refused_by_name(key, value):
    """Whatever one metadata value holds, the validator returns consistent shapes or raises CheckpointError
    naming the key (or the one it disagrees with): never an exception of its own, nothing transformers would
    divide by zero or refuse with a traceback."""
    fields = _fields() | {f"llama.{key}": value}
    try:
        hp = check_hyperparameters("llama", fields)
    except CheckpointError as e:
        assert "llama." in str(e) and "\n" not in str(e)
        return
    assert min(hp.blocks, hp.embedding, hp.vocab) >= 1
    if hp.heads is None:  # one value per block: llama.cpp's per-layer sizes
        assert key == "attention.head_count" and isinstance(value, list) and len(value) == hp.blocks
        return
    assert min(hp.heads, hp.kv_heads, hp.head_dim) >= 1 and hp.heads % hp.kv_heads == 0
    if key != "attention.key_length":
        assert hp.head_dim * hp.heads == hp.embedding


@settings(max_examples=200, deadline=None)
@given(embedding=st.integers(1, 4096), heads=st.integers(1, 64), kv=st.integers(1, 64))
def test_head_sizes_are_checked_as_llama_cpp_derives_them(embedding, heads, kv):
    fields = _fields(**{"embedding_length": embedding, "attention.head_count": heads, "attention.head_count_kv": kv,
                        "rope.dimension_count": None})
    valid = embedding % heads == 0 and heads % kv == 0
    if valid:
        assert check_hyperparameters("llama", fields).head_dim == embedding // heads
    else:
        with pytest.raises(CheckpointError, match="head_count"):
            check_hyperparameters("llama", fields)


def test_the_examples_of_the_report():
    for sizes, message in [({"attention.head_count": 0}, "head_count = 0 is not a positive integer"),
                           ({"block_count": 10**12}, r"at most 2\^31 - 1"),
                           ({"embedding_length": 129, "attention.key_length": None}, "not a multiple of"),
                           ({"block_count": None}, "llama.block_count is missing")]:
        with pytest.raises(CheckpointError, match=message):
            check_hyperparameters("llama", _fields(**sizes))


def test_sizes_per_block_and_no_attention_are_read():
    """llama.cpp's per-layer sizes (a list, 0 where a block has none) and architectures without attention."""
    hp = check_hyperparameters("lfm2", {f"lfm2.{k}": v for k, v in [("block_count", 3), ("embedding_length", 64),
                                        ("attention.head_count", 4), ("attention.head_count_kv", [0, 2, 0])]}
                               | {"tokenizer.ggml.tokens": ["a"] * 8})
    assert (hp.heads, hp.kv_heads, hp.head_dim) == (4, 4, 16)
    hp = check_hyperparameters("mamba", {"mamba.block_count": 2, "mamba.embedding_length": 64, "mamba.vocab_size": 9})
    assert hp.heads is None and hp.vocab == 9
    with pytest.raises(CheckpointError, match="is not a list of 3 integers"):
        check_hyperparameters("lfm2", {"lfm2.block_count": 3, "lfm2.embedding_length": 64, "lfm2.vocab_size": 9,
                                       "lfm2.attention.head_count_kv": [0, 2]})


# -- the file: header, structure, tensors ---------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(offset=st.integers(0, 4095), byte=st.integers(0, 255))
def test_a_corrupted_header_byte_is_read_or_refused_cleanly(tiny_gguf, tmp_path_factory, offset, byte):
    """Any one byte of the header region changed: read_gguf gives the file or a CheckpointError, never the
    reader's IndexError / ValueError / KeyError or a MemoryError."""
    data = bytearray(tiny_gguf.read_bytes())
    data[offset] = byte
    path = tmp_path_factory.getbasetemp() / "corrupt.gguf"
    path.write_bytes(data)
    try:
        read_gguf(path)
    except CheckpointError as e:
        assert "\n" not in str(e)


def test_every_needed_tensor_is_checked(tiny_gguf, tmp_path):
    contents = read_gguf(tiny_gguf)
    need, optional = expected_tensors("llama", contents.hyperparameters)
    assert set(contents.tensors) == set(need)  # an export of ref:tiny: tied, so no output.weight
    for name in ("token_embd.weight", "output_norm.weight", "blk.0.attn_k.weight", "blk.1.ffn_norm.weight"):
        dropped = rewrite(tiny_gguf, tmp_path / "dropped.gguf", tensors=lambda ts: [t for t in ts if t[0] != name])
        with pytest.raises(CheckpointError, match=f"missing {name}"):
            read_gguf(dropped)
    extra = rewrite(tiny_gguf, tmp_path / "extra.gguf", tensors=lambda ts: ts + [("blk.2.attn_q.weight", *ts[0][1:])])
    with pytest.raises(CheckpointError, match="unexpected blk.2.attn_q.weight"):
        read_gguf(extra)


def test_qwen_tensor_sets():
    hp = Hyperparameters(1, 64, 128, 2, 1, 32, 32, 256, 100)
    qwen2, _ = expected_tensors("qwen2", hp)
    qwen3, _ = expected_tensors("qwen3", hp)
    assert qwen2["blk.0.attn_k.bias"] == (32,) and "blk.0.attn_q_norm.weight" not in qwen2
    assert qwen3["blk.0.attn_q_norm.weight"] == (32,) and "blk.0.attn_q.bias" not in qwen3
    assert expected_tensors("phi3", hp) is None
    moe = check_hyperparameters("llama", _fields(expert_count=8))  # Mixtral's files: architecture llama, experts
    assert moe.experts == 8 and expected_tensors("llama", moe) is None
    assert check_hyperparameters("llama", _fields(expert_count=0)).experts == 0
    with pytest.raises(CheckpointError, match="expert_count = -1"):
        check_hyperparameters("llama", _fields(expert_count=-1))


# -- the vocabulary the file carries --------------------------------------------------------------------------

def test_a_shuffled_vocabulary_is_refused(tiny_gguf, tmp_path):
    tokenizer = load_tokenizer("ref:tiny")
    assert "same vocabulary" in check_gguf_tokenizer(tiny_gguf, tokenizer, "ref:tiny")
    with pytest.raises(EvaluationError, match="4095 of the baseline tokenizer's 4096 token ids"):
        check_gguf_tokenizer(shuffled_vocabulary(tiny_gguf, tmp_path / "s.gguf"), tokenizer, "ref:tiny")
    merges = list(gguf.GGUFReader(str(tiny_gguf)).fields["tokenizer.ggml.merges"].contents())
    other = rewrite(tiny_gguf, tmp_path / "m.gguf", fields={"tokenizer.ggml.merges": merges[::-1]})
    with pytest.raises(EvaluationError, match="BPE merges differ"):
        check_gguf_tokenizer(other, tokenizer, "ref:tiny")


# -- the baseline of a file whose embedding is on a grid ------------------------------------------------------

def test_a_baseline_of_other_weights_is_refused_when_the_embedding_is_quantized(tiny_gguf):
    model = load_gguf_model(tiny_gguf)
    assert gguf_origin(model).quantized_tables == {"input", "output"}
    assert source_mismatches(model, quantkit.load("ref:tiny")) == []
    other = make_random_model("llama", vocab=4096)
    other.config = quantkit.load("ref:tiny").config
    problems = source_mismatches(model, other)
    assert len(problems) == 1 and "more than rounding to the GGUF file's grid leaves" in problems[0]


def test_a_quantized_gguf_baseline_is_refused(tiny_gguf):
    assert "the baseline is itself quantized" in source_mismatches(quantkit.load("ref:tiny"), load_gguf_model(tiny_gguf))[0]


# -- Mistral and Qwen3 files ----------------------------------------------------------------------------------

def _source(tmp_path, model):
    folder = tmp_path / "src"
    model.save_pretrained(folder)
    tiny = Path(resolve_model_name("ref:tiny"))
    for name in TOKENIZER_FILES:
        if (tiny / name).is_file():
            shutil.copy(tiny / name, folder / name)
    return folder


def _logits_agree(tmp_path, source, recipe="w8a16-rtn-g32"):
    from quantkit.commands.cli import main

    out = tmp_path / "m.gguf"
    assert main(["quantize", str(source), "--recipe", recipe, "--out", str(out)]) == 0
    ours, theirs = load_gguf_model(out), quantkit.load(source, dtype=torch.float32)
    assert source_mismatches(ours, theirs) == []
    ids = torch.randint(3, 4096, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        kl = torch.nn.functional.kl_div(ours(ids).logits.log_softmax(-1), theirs(ids).logits.log_softmax(-1),
                                        log_target=True, reduction="batchmean") / 64
    assert kl < 1e-3
    return out


@pytest.mark.parametrize("name", [None, "mistral-7b"])
def test_a_mistral_file_is_scored_against_its_source(tmp_path, name):
    """llama.cpp runs a Mistral GGUF as architecture llama; whatever the file's general.name (transformers makes
    one named "mistral" a Mistral model with a sliding window), it loads as Llama and its source is its baseline."""
    out = _logits_agree(tmp_path, _source(tmp_path, make_random_model("mistral", vocab=4096)))
    if name:
        renamed = rewrite(out, tmp_path / "named.gguf", fields={"general.name": name})
        assert type(load_gguf_model(renamed)).__name__ == "LlamaForCausalLM"


def test_a_sliding_window_narrower_than_the_context_is_named():
    from types import SimpleNamespace

    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, vocab_size=32, max_position_embeddings=256)
    llama = SimpleNamespace(config=transformers.LlamaConfig(**common))
    for window in (None, 256, 4096):
        mistral = SimpleNamespace(config=transformers.MistralConfig(**common, sliding_window=window))
        assert shape_mismatches(llama, mistral) == shape_mismatches(mistral, llama) == []
    narrow = SimpleNamespace(config=transformers.MistralConfig(**common, sliding_window=64))
    assert shape_mismatches(llama, narrow) == [
        "model_type llama in the model, mistral in the baseline, whose attention keeps to a sliding window of 64 "
        "tokens the other has not (llama.cpp runs a Mistral GGUF file as llama, without it)"]


def test_a_qwen3_file_with_head_dim_32_is_scored(tmp_path):
    """Qwen3 with heads of 32 (2 heads, hidden 128): transformers' GGUF reader leaves head_dim at Qwen3's default
    of 128 and refuses the weights; the file's attention.key_length gives it."""
    import transformers

    config = transformers.Qwen3Config(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=32, vocab_size=4096, max_position_embeddings=256)
    torch.manual_seed(0)
    _logits_agree(tmp_path, _source(tmp_path, transformers.Qwen3ForCausalLM(config)))


def test_metadata_edited_in_place_is_refused(tiny_gguf, tmp_path):
    with pytest.raises(CheckpointError, match="head_count_kv = 3"):
        read_gguf(set_field(tiny_gguf, tmp_path / "kv.gguf", "llama.attention.head_count_kv", 3))


def test_a_sentencepiece_file_has_its_sources_vocabulary(tmp_path_factory):
    """A SentencePiece vocabulary (llama.cpp's `llama` tokenizer: pieces, padded to the model's vocabulary, no
    merges) is its source tokenizer's, so eval accepts it."""
    pytest.importorskip("sentencepiece")
    from .test_gguf_sentencepiece import exported

    folder, _, out = exported.__wrapped__(tmp_path_factory)
    assert "same vocabulary" in check_gguf_tokenizer(out, load_tokenizer(str(folder)), str(folder))


def test_a_file_without_a_vocabulary_is_read_with_the_baseline_tokenizer(tiny_gguf, tmp_path):
    bare = rewrite(tiny_gguf, tmp_path / "bare.gguf",
                   fields={key: None for key in gguf.GGUFReader(str(tiny_gguf)).fields if key.startswith("tokenizer.")})
    assert "carries no vocabulary of its own" in check_gguf_tokenizer(bare, load_tokenizer("ref:tiny"), "ref:tiny")


def test_a_model_dequantized_from_a_quantized_gguf_file_is_not_quantized_again(tiny_gguf):
    model = quantkit.load(tiny_gguf)
    with pytest.raises(QuantizationError, match="rounds weights that were rounded already"):
        quantkit.quantize(model, "w4a16-rtn")
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
