"""Byte-level BPE tokenizer for the reference models, saved so ``AutoTokenizer`` loads it as fast.

Byte-level: every byte has a token, so any text round-trips exactly. The tokenizer adds ``<|bos|>``
in front of every encoded text (as Llama tokenizers do); training data is built the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]  # ids 0, 1, 2


def train_tokenizer(documents: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens (specials and 256 bytes included).

    Deterministic for fixed ``documents``: merges are chosen by count with ties broken by the pair.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    # Post-processing: "<|bos|> text" (offsets are left alone: trim_offsets=False).
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
        ),
    ])
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the tokenizer corpus only supports {tokenizer.get_vocab_size()} tokens, fewer than the "
            f"requested vocab_size {vocab_size}: use more tokenizer text or a smaller vocabulary"
        )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, folder: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``."""
    folder = Path(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    return {
        "bos_token_id": tokenizer.token_to_id(BOS_TOKEN),
        "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
        "pad_token_id": tokenizer.token_to_id(PAD_TOKEN),
    }
