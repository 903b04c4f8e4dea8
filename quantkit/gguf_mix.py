"""llama-quantize's Q4_K_M and Q4_K_S mixes as quantkit recipes (`mix: q4_k_m`): which GGUF grid each linear of
a dense Llama, Mistral, Qwen2 or Qwen3 model gets, and which type its embedding and output head are written in.

The rules are llama.cpp's (src/llama-quant.cpp, llama_tensor_get_type_impl, for a dense model of these
architectures): every linear Q4_K, except

- Q4_K_M: attn_v (v_proj) and ffn_down (down_proj) of the layers where use_more_bits(i, n) holds (the first
  and last eighth of the layers and every third one between) get Q6_K;
- Q4_K_S: attn_v of the first 4 layers and ffn_down of the first eighth get Q5_K;
- both: a Llama model of llama.cpp's 70B type (80 layers, grouped-query attention) takes Q5_K for attn_v
  where the rules above leave Q4_K;

and a linear whose inputs are no whole super-block of 256 falls back as llama-quantize's
tensor_type_fallback does (scheme.LLAMA_CPP_FALLBACK: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), so that a
mix file has llama.cpp's bits tensor by tensor. The output head (or a tied embedding) is written in Q6_K and
an untied embedding in Q4_K, each falling back the same way (OUTPUT_TYPES: what `--float-type auto` means for
a mix). quantkit's algorithms quantize each linear onto its grid directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .scheme import LLAMA_CPP_FALLBACK, QuantScheme, grid_scheme

MIXES = ("q4_k_m", "q4_k_s")
#: the GGUF file type llama.cpp names each mix by
FILE_TYPES = {"q4_k_m": "Q4_K_M", "q4_k_s": "Q4_K_S"}
#: the types of the output head and of an untied embedding in a mix file (llama-quantize's defaults)
OUTPUT_TYPES = {"output": "q6_k", "token_embd": "q4_k"}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class MixModel:
    """What the rules read of a model: its decoder layer count and whether llama.cpp counts it as its 70B
    type (a Llama with 80 layers and fewer KV heads than heads)."""

    n_layers: int
    llama_70b: bool = False

    @classmethod
    def of(cls, config) -> "MixModel":
        """From a transformers config (its text config for a multimodal one)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n_layers = int(text.num_hidden_layers)
        heads = getattr(text, "num_attention_heads", None)
        kv = getattr(text, "num_key_value_heads", None) or heads
        return cls(n_layers, getattr(text, "model_type", None) == "llama" and n_layers == 80 and kv != heads)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third layer between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _role(name: str) -> str | None:
    if name.endswith("self_attn.v_proj"):
        return "attn_v"
    if name.endswith("mlp.down_proj"):
        return "ffn_down"
    return None


def mix_grid(mix: str, name: str, model: MixModel) -> str:
    """The grid ("q4_k", "q5_k" or "q6_k") the mix gives the linear `name` (a module path such as
    "model.layers.3.self_attn.v_proj"; "lm_head", the output head, takes the mix's output type), before any
    fallback."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {', '.join(MIXES)}, got {mix!r}")
    if name == "lm_head":  # the output head, where a recipe quantizes it (ignore: []): llama-quantize's type
        return OUTPUT_TYPES["output"]
    role = _role(name)
    if role is None:
        return "q4_k"
    found = _LAYER.search(name)
    if found is None:
        raise ValueError(f"{name}: a {role} linear outside the decoder layers (model.layers.N); the {mix} rules "
                         f"count layers")
    i, n = int(found.group(1)), model.n_layers
    grid = "q4_k"
    if mix == "q4_k_m" and use_more_bits(i, n):
        grid = "q6_k"
    elif mix == "q4_k_s" and (i < 4 if role == "attn_v" else i < n // 8):
        grid = "q5_k"
    if role == "attn_v" and model.llama_70b and grid == "q4_k":
        grid = "q5_k"
    return grid


def mix_scheme(mix: str, name: str, in_features: int, model: MixModel, indivisible: str) -> QuantScheme:
    """The scheme of linear `name` with `in_features` inputs under the mix, llama-quantize's fallback applied
    (then the recipe's `indivisible` rule, for a width that is no multiple of 32)."""
    return grid_scheme(mix_grid(mix, name, model)).fitted(in_features, indivisible, LLAMA_CPP_FALLBACK)
