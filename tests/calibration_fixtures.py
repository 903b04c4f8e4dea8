"""Helpers for the calibration tests: tiny random models of every supported family, a byte tokenizer."""

from __future__ import annotations

import torch

CALIBRATION_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_model(family: str = "llama", *, layers: int = 2, hidden: int = 128, intermediate: int = 384, heads: int = 4,
               kv_heads: int = 2, vocab: int = 320, seed: int = 0, sliding_window: int | None = None):
    """A random causal LM of `family` (fp32, eval mode). Linear inputs are multiples of 128.

    sliding_window: for mistral / qwen2, a window shorter than the calibration windows, so that the
    blocks' attention masks differ from a plain causal mask (qwen2: every layer but the first).
    """
    import transformers

    common = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                  max_position_embeddings=256, tie_word_embeddings=True)
    if family == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif family == "mistral":
        config, cls = transformers.MistralConfig(**common, sliding_window=sliding_window), transformers.MistralForCausalLM
    elif family == "qwen2":
        extra = dict(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=1) if sliding_window else {}
        config, cls = transformers.Qwen2Config(**common, **extra), transformers.Qwen2ForCausalLM
    elif family == "qwen3":
        config, cls = transformers.Qwen3Config(**common, head_dim=hidden // heads), transformers.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # random norms (not all ones), so scale folding into them is exercised
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def token_batches(vocab: int = 320, *, batches: int = 2, batch_size: int = 4, seq_len: int = 48, seed: int = 1):
    """Random calibration token batches [B, T] (int64)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch_size, seq_len), generator=g) for _ in range(batches)]


def byte_tokenizer(bos: bool = False):
    """A byte-level tokenizer (256 byte tokens + <s> at id 256), built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")
