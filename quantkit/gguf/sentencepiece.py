"""A SentencePiece vocabulary (a folder's tokenizer.model) in a GGUF file, as llama.cpp's converter writes it
for Llama and Mistral: convert_hf_to_gguf.py's TextModel._set_vocab_sentencepiece and
_create_vocab_sentencepiece (conversion/base.py in llama.cpp's tree), which LlamaModel.set_vocab
(conversion/llama.py) and Qwen2Model.set_vocab try before any tokenizer.json. Followed step by step (MIT
licence); the one difference: a piece or added token whose id is not below the model's vocab_size is
refused (the converter drops it with a warning), as quantkit's BPE export refuses such a token.

What is written: tokenizer.ggml.model "llama", pre "default", vocab_size tokens with their scores and
types, then gguf.SpecialVocab's bos / eos / unk / pad ids, add_bos / add_eos flags and chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core.errors import CheckpointError, UsageError

#: added tokens the converter makes CONTROL though the folder does not mark them special
#: (TextModel.does_token_look_special): these names, and <|...|>, <｜...｜>, <unused...>
LOOK_SPECIAL = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")


def _looks_special(token: str) -> bool:
    return (token in LOOK_SPECIAL or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def load_processor(path: Path):
    """The sentencepiece.SentencePieceProcessor of the model file `path`. UsageError without the
    sentencepiece package, CheckpointError when the file is no SentencePiece model."""
    try:
        from sentencepiece import SentencePieceProcessor  # an optional dependency
    except ImportError:
        raise UsageError(f"{path} is a SentencePiece vocabulary: writing it to GGUF needs the sentencepiece "
                         f"package (pip install sentencepiece, or pip install 'quantkit[gguf]')") from None
    processor = SentencePieceProcessor()
    try:
        processor.LoadFromFile(str(path))
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a SentencePiece model ({str(e).strip()[:200]})") from None
    return processor


def vocabulary(folder: Path, vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of `folder`'s tokenizer.model, each vocab_size long, as
    _create_vocab_sentencepiece makes them: each piece with its score and type (UNKNOWN, CONTROL,
    UNUSED, BYTE from sentencepiece, else NORMAL); added_tokens.json's tokens USER_DEFINED; the
    added_tokens_decoder of tokenizer_config.json CONTROL when special (or looking it), else
    USER_DEFINED with U+2581 as a space; added tokens score -1000; ids past the pieces "[PAD{i}]",
    UNUSED, score -10000."""
    import gguf  # an optional dependency (quantkit[gguf])

    processor = load_processor(folder / "tokenizer.model")
    if processor.vocab_size() > vocab_size:
        raise CheckpointError(f"{folder / 'tokenizer.model'}: {processor.vocab_size()} pieces, more than the "
                              f"model's vocab_size {vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [gguf.TokenType.UNUSED] * vocab_size
    for i in range(processor.vocab_size()):
        kind = gguf.TokenType.NORMAL
        if processor.IsUnknown(i):
            kind = gguf.TokenType.UNKNOWN
        elif processor.IsControl(i):
            kind = gguf.TokenType.CONTROL
        elif processor.IsUnused(i):
            kind = gguf.TokenType.UNUSED
        elif processor.IsByte(i):
            kind = gguf.TokenType.BYTE
        tokens[i], scores[i], types[i] = processor.IdToPiece(i), processor.GetScore(i), kind
    added: list[tuple[int, str, gguf.TokenType]] = []
    if (folder / "added_tokens.json").is_file():
        for token, i in json.loads((folder / "added_tokens.json").read_text(encoding="utf-8")).items():
            added.append((i, token, gguf.TokenType.USER_DEFINED))
    if (folder / "tokenizer_config.json").is_file():
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        for i, data in (config.get("added_tokens_decoder") or {}).items():
            token = data["content"]
            if data.get("special") or _looks_special(token):
                added.append((int(i), token, gguf.TokenType.CONTROL))
            else:  # pre-normalized user-defined spaces, as the converter writes them
                added.append((int(i), token.replace("\u2581", " "), gguf.TokenType.USER_DEFINED))
    for i, token, kind in added:
        if i >= vocab_size:
            raise CheckpointError(f"{folder}: added token {token!r} has id {i} >= vocab_size {vocab_size}")
        tokens[i], scores[i], types[i] = token, -1000.0, kind
    return tokens, scores, types


def set_vocab(writer, folder: Path, vocab_size: int, arch: str) -> None:
    """Write `folder`'s SentencePiece vocabulary as _set_vocab_sentencepiece does, with tokenizer_config.json's
    add_prefix_space as add_space_prefix for arch LLAMA (LlamaModel.set_vocab; its CodeLlama-only FIM ids are
    not written)."""
    import gguf  # an optional dependency (quantkit[gguf])

    if arch == "LLAMA" and (folder / "tokenizer_config.json").is_file():
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        if config.get("add_prefix_space") is not None:
            writer.add_add_space_prefix(config["add_prefix_space"])
    tokens, scores, types = vocabulary(folder, vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
