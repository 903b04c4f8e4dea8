"""GGUF export of a SentencePiece vocabulary (a tokenizer.model, as Llama 2 and Mistral ship it), written as
llama.cpp's converter does (quantkit/gguf/sentencepiece.py): a SentencePiece BPE model trained here
(Llama's trainer settings: byte fallback, split digits, unk 0 / bos 1 / eos 2) in a transformers Llama
tokenizer folder beside a random Llama, quantized to a GGUF file, then read back three ways: the file's
tokens, scores and types against sentencepiece's own model; transformers' GGUF tokenizer against the
folder's tokenizer and sentencepiece; llama.cpp's tokenization (llama-perplexity's token ids) against
sentencepiece (skipped without llama.cpp's binaries, as tests/test_gguf_llama_cpp.py)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
import torch

spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

from quantkit.commands.cli import main  # noqa: E402
from quantkit.core.errors import CheckpointError, UsageError  # noqa: E402
from quantkit.gguf.writing import check_exportable  # noqa: E402
from quantkit.gguf.sentencepiece import vocabulary  # noqa: E402

from .conftest import make_random_model  # noqa: E402

T = gguf.TokenType
SP_VOCAB = 400
MODEL_VOCAB = 416  # longer than the tokenizer: ids past its added tokens are padding
ADDED = {400: ("<|im_start|>", T.CONTROL), 401: ("<|im_end|>", T.CONTROL), 402: ("<think>", T.USER_DEFINED)}
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
WORDS = ("the quick brown fox jumps over a lazy dog while llamas quantize weights into blocks of thirty two "
         "naïve café über").split()
# spaces, newlines, tabs, digits, and characters the model never saw (byte fallback): ß € Cyrillic CJK emoji
TEXTS = ["The quick brown fox.", "a  b\n\nc\td", "naïve café 12345 3.14", "Straße kostet 5€, привет",
         "日本語 😀 🦙🦙", "trailing spaces   ", "\n\nnewlines first", "x=y+1; über<think>alles"]


def _corpus(lines: int, seed: int) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) + rng.choice(".,!?:")
                     for _ in range(lines))


def _train(folder, corpus: str) -> None:
    """tokenizer.model in `folder`: a SentencePiece BPE model with Llama's trainer settings."""
    (folder / "corpus.txt").write_text(corpus, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "sp"), vocab_size=SP_VOCAB, model_type="bpe",
        byte_fallback=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0,
        normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, num_threads=1, minloglevel=2)
    shutil.move(folder / "sp.model", folder / "tokenizer.model")
    for name in ("sp.vocab", "corpus.txt"):
        (folder / name).unlink()


def _wrap(folder) -> None:
    """The transformers Llama tokenizer of folder's tokenizer.model, saved there: vocabulary in piece order and
    merges from it, as transformers converts a SentencePiece BPE model (convert_slow_tokenizer's
    SentencePieceExtractor, which needs protobuf; this does not), two special and one plain added token, a chat
    template. tokenizer_config.json gets the added_tokens_decoder transformers 4 wrote (and hub Llama 2 /
    Mistral folders have), which llama.cpp's converter reads."""
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    vocab = {sp.IdToPiece(i): i for i in range(sp.vocab_size())}
    tokenizer = LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab), add_bos_token=True)
    tokenizer.add_special_tokens({"additional_special_tokens": [ADDED[400][0], ADDED[401][0]]})
    tokenizer.add_tokens([ADDED[402][0]])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(source folder, its sentencepiece processor, the GGUF file quantize wrote from it)."""
    tmp = tmp_path_factory.mktemp("sentencepiece")
    folder = tmp / "llama-sp"
    folder.mkdir()
    _train(folder, _corpus(300, seed=0))
    _wrap(folder)
    model = make_random_model("llama", seed=3, vocab=MODEL_VOCAB, layers=1, hidden=256, intermediate=512)
    model.to(torch.bfloat16).save_pretrained(folder)
    out = tmp / "m.gguf"
    assert main(["quantize", str(folder), "--recipe", "w4a16-rtn-g32", "--out", str(out)]) == 0
    return folder, spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")), out


def _fields(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def test_file_holds_the_sentencepiece_vocabulary(exported):
    folder, sp, out = exported
    f = _fields(out)
    assert f["tokenizer.ggml.model"] == "llama" and f["tokenizer.ggml.pre"] == "default"
    tokens, scores, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.scores"], f["tokenizer.ggml.token_type"]
    assert len(tokens) == len(scores) == len(types) == MODEL_VOCAB and sp.vocab_size() == SP_VOCAB
    assert tokens[:SP_VOCAB] == [sp.IdToPiece(i) for i in range(SP_VOCAB)]
    assert scores[3:SP_VOCAB] == [sp.GetScore(i) for i in range(3, SP_VOCAB)] and len(set(scores[259:SP_VOCAB])) > 100
    # tokenizer_config.json marks <unk> <s> </s> special: the converter makes them CONTROL, score -1000
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and types[:3] == [T.CONTROL] * 3 and scores[:3] == [-1000.0] * 3
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)] and set(types[3:259]) == {T.BYTE}
    assert all(sp.IsByte(i) for i in range(3, 259))
    assert set(types[259:SP_VOCAB]) == {T.NORMAL}
    for i, (token, kind) in ADDED.items():
        assert (tokens[i], types[i], scores[i]) == (token, kind, -1000.0)
    pads = range(len(ADDED) + SP_VOCAB, MODEL_VOCAB)
    assert [tokens[i] for i in pads] == [f"[PAD{i}]" for i in pads]
    assert {types[i] for i in pads} == {T.UNUSED} and {scores[i] for i in pads} == {-10000.0}
    assert (f["tokenizer.ggml.unknown_token_id"], f["tokenizer.ggml.bos_token_id"],
            f["tokenizer.ggml.eos_token_id"]) == (sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2)
    assert f["tokenizer.ggml.add_bos_token"] is True and f.get("tokenizer.ggml.add_eos_token") in (None, False)
    assert f["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert "tokenizer.ggml.merges" not in f


def test_types_from_sentencepiece_and_the_added_token_files(exported, tmp_path):
    """sentencepiece's own types where no added token names them (unk UNKNOWN, bos / eos CONTROL);
    added_tokens.json's tokens USER_DEFINED; tokenizer_config.json's plain added tokens USER_DEFINED with
    "▁" as a space, or CONTROL where they look special (<pad>); a tokenizer longer than the model refused."""
    folder, sp, _ = exported
    shutil.copy(folder / "tokenizer.model", tmp_path / "tokenizer.model")
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<extra>": 405}), encoding="utf-8")
    plain = {"special": False, "normalized": False, "lstrip": False, "rstrip": False, "single_word": False}
    decoder = {"406": {**plain, "content": "\u2581user\u2581tok"}, "407": {**plain, "content": "<pad>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}), encoding="utf-8")
    tokens, scores, types = vocabulary(tmp_path, MODEL_VOCAB)
    assert types[:3] == [T.UNKNOWN, T.CONTROL, T.CONTROL] and scores[:3] == [sp.GetScore(i) for i in range(3)]
    assert (tokens[405], types[405], scores[405]) == ("<extra>", T.USER_DEFINED, -1000.0)
    assert (tokens[406], types[406]) == (" user tok", T.USER_DEFINED)
    assert (tokens[407], types[407]) == ("<pad>", T.CONTROL)
    assert (tokens[400], types[400]) == ("[PAD400]", T.UNUSED)
    with pytest.raises(CheckpointError, match="more than the model's vocab_size 300"):
        vocabulary(tmp_path, 300)
    with pytest.raises(CheckpointError, match="id 405 >= vocab_size 404"):
        vocabulary(tmp_path, 404)


def test_transformers_reads_the_tokenizer_back(exported):
    """transformers' GGUF tokenizer (built from the file's tokens and scores) gives the ids of the folder's own
    tokenizer, and both those of sentencepiece (with BOS), on text with spaces, newlines, digits and characters
    that need byte fallback; the added tokens stay whole."""
    from transformers import AutoTokenizer

    folder, sp, out = exported
    theirs = AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    ours = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS + [" leading space", "<|im_start|>hi<|im_end|>"]:
        assert theirs(text)["input_ids"] == ours(text)["input_ids"], text
    for text in TEXTS:  # not " leading space": transformers' Metaspace adds no second "▁" where sentencepiece does
        if "<think>" not in text:  # an added token sentencepiece does not know
            assert theirs(text)["input_ids"] == [sp.bos_id()] + sp.encode(text), text
    assert any(sp.IsByte(i) for i in sp.encode(TEXTS[3])) and any(sp.IsByte(i) for i in sp.encode(TEXTS[4]))
    assert theirs("<|im_start|>hi<|im_end|><think>")["input_ids"][:2] == [1, 400]
    assert theirs("<|im_start|>hi<|im_end|><think>")["input_ids"][-2:] == [401, 402]


@pytest.mark.parametrize("lead", ["", "  "], ids=["text", "leading-spaces"])
def test_llama_cpp_tokenizes_as_sentencepiece(exported, tmp_path, lead):
    """llama.cpp's tokenization of a text (the token ids llama-perplexity --kl-divergence-base writes: BOS, then
    the text's first tokens) equals sentencepiece's, and the folder's transformers tokenizer's where the text
    does not start with a space (there transformers' Metaspace adds no "▁" of its own, as sentencepiece and
    llama.cpp do)."""
    from transformers import AutoTokenizer

    from .test_gguf_llama_cpp import _bin_dir, read_llama_cpp_logits

    bins = _bin_dir()
    folder, sp, out = exported
    n_ctx, n_chunks = 128, 2
    text = lead + "\n".join(t for t in TEXTS if "<think>" not in t and not t[0].isspace()) + "\n" + _corpus(60, seed=1)
    expect = sp.encode(text)
    assert len(expect) > n_ctx * n_chunks + 8 and sum(map(sp.IsByte, expect[:n_ctx * n_chunks])) > 20
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    run = subprocess.run([str(bins / "llama-perplexity"), "-m", str(out), "-f", str(path), "--kl-divergence-base",
                          str(tmp_path / "base.kld"), "-c", str(n_ctx), "-b", str(n_ctx), "--chunks", str(n_chunks),
                          "-t", "2"], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    tokens, _ = read_llama_cpp_logits(tmp_path / "base.kld")
    flat = tokens.flatten().tolist()
    assert len(flat) == n_ctx * n_chunks and flat[0] == sp.bos_id() and flat[1:] == expect[:len(flat) - 1]
    if not lead:
        hf = AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"]
        assert flat[1:] == hf[:len(flat) - 1]


def _float_folder(tmp_path, name):
    folder = tmp_path / name
    make_random_model("llama", vocab=64, layers=1).save_pretrained(folder)
    return folder


def test_what_cannot_be_written_is_refused_before_any_work(exported, tmp_path, capsys, monkeypatch):
    from tokenizers import Tokenizer, models

    unigram = _float_folder(tmp_path, "unigram")
    pieces = [("<unk>", 0.0), ("a", -1.0), ("b", -2.0)]
    Tokenizer(models.Unigram(pieces, unk_id=0)).save(str(unigram / "tokenizer.json"))
    out = tmp_path / "u.gguf"
    assert main(["quantize", str(unigram), "--recipe", "w4a16-rtn-g32", "--out", str(out)]) == 2
    printed = capsys.readouterr()
    assert "a Unigram tokenizer" in printed.err and "tokenizer.model" in printed.err and not out.exists()
    assert "quantized" not in printed.out

    bad = _float_folder(tmp_path, "bad")
    (bad / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(CheckpointError, match="not a SentencePiece model"):
        check_exportable(bad)

    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import sentencepiece raises ImportError
    with pytest.raises(UsageError, match="pip install sentencepiece"):
        check_exportable(exported[0])
