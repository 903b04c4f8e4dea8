"""Layers whose width the recipe's group size does not divide: the `indivisible` rule."""

from __future__ import annotations

from pathlib import Path

from .robustness_cases import Case

G128 = "weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}\n"


def _width_576(work: Path) -> Path:
    """A random Llama of SmolLM2-135M's widths (hidden 576, intermediate 1536), one block, saved as a float folder."""
    dest = work.parent / "_shared" / "width-576-float"
    if not dest.exists():
        import torch
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                                          num_attention_heads=9, num_key_value_heads=3, vocab_size=512,
                                          tie_word_embeddings=True)
        transformers.LlamaForCausalLM(config).save_pretrained(dest)
    return dest


def _recipe(work: Path, rule: str) -> str:
    path = work / "recipe.yaml"
    path.write_text(G128 + f"indivisible: {rule}\n")
    return str(path)


def _unknown_rule(work):
    return ["quantize", str(_width_576(work)), "--recipe", _recipe(work, "pad"), "--out", str(work / "out")]


def _error_rule(work):
    return ["quantize", str(_width_576(work)), "--recipe", _recipe(work, "error"), "--out", str(work / "out")]


CASES = [
    Case("indivisible-unknown", "recipe `indivisible: pad` (no such rule)", _unknown_rule,
         "indivisible must be one of smaller-group, channel, ragged, error", creates="out"),
    Case("indivisible-error", "recipe `indivisible: error` on a model whose width 576 group 128 does not divide",
         _error_rule, "model.layers.0.self_attn.q_proj (in_features=576): group_size 128 does not divide",
         creates="out"),
]
