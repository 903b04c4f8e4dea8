"""llama-quantize's K-quant and IQ4 mixes as quantkit recipes (`mix: q4_k_m`): which GGUF grid each linear of a dense
Llama, Mistral, Qwen2 or Qwen3 model gets, and which type its embedding and output head are written in.

The rules are llama.cpp's (src/llama-quant.cpp, llama_tensor_get_type_impl, for a dense model of these
architectures, not Falcon): every linear takes the mix's default type (MIX_GRIDS: Q6_K, Q5_K, Q4_K, Q3_K, Q2_K,
IQ4_XS or IQ4_NL), except

| mix | attn_v (v_proj) | ffn_down (down_proj) | attn_output (o_proj) |
|---|---|---|---|
| Q6_K | - | - | - |
| Q5_K_M | Q6_K where use_more_bits(i, n) | Q6_K where use_more_bits(i, n) | - |
| Q5_K_S | - | - | - |
| Q4_K_M | Q6_K where use_more_bits(i, n) | Q6_K where use_more_bits(i, n) | - |
| Q4_K_S | Q5_K in the first 4 layers | Q5_K in the first eighth | - |
| Q3_K_L | Q5_K | Q5_K | Q5_K |
| Q3_K_M | Q5_K in the first 2 layers, else Q4_K | Q5_K in the first sixteenth, else Q4_K | Q4_K |
| Q3_K_S | - | - | - |
| Q2_K | Q4_K with n_gqa >= 4 (4+ heads per KV head), else Q3_K | Q3_K | Q3_K |
| IQ4_XS, IQ4_NL | Q5_K with n_gqa >= 4 | Q5_K in the first eighth | - |

use_more_bits(i, n): the first and last eighth of the layers and every third one between. The IQ4 mixes'
ffn_down rule is llama-quantize's without an importance matrix (`--imatrix` leaves ffn_down at the default
type): quantkit's calibrated recipes follow the file type's standard mix. A Llama of
llama.cpp's 70B type (80 layers, grouped-query attention) takes Q5_K for attn_v where these leave Q3_K or
Q4_K. A linear whose inputs are no whole super-block of 256 falls back as llama-quantize's
tensor_type_fallback does (each type's llama_cpp_fallback in quantkit/gguf/types.py: Q2_K, Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K ->
Q8_0, IQ4_XS -> IQ4_NL), so that a mix file has llama.cpp's bits tensor by tensor. The output head (or a tied embedding) is
written in Q6_K and an untied embedding in the mix's default type, each falling back the same way
(OUTPUT_TYPES: what `--float-type auto` means for a mix). quantkit's algorithms quantize each linear onto
its grid directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..core.scheme import QuantScheme, grid_scheme

#: each mix and its default grid (llama-quantize's default type for the file type), which a recipe's weights take
MIX_GRIDS = {"q6_k": "q6_k", "q5_k_m": "q5_k", "q5_k_s": "q5_k", "q4_k_m": "q4_k", "q4_k_s": "q4_k",
             "q3_k_l": "q3_k", "q3_k_m": "q3_k", "q3_k_s": "q3_k", "q2_k": "q2_k", "iq4_xs": "iq4_xs",
             "iq4_nl": "iq4_nl"}
MIXES = tuple(MIX_GRIDS)
#: the GGUF file type llama.cpp names each mix by
FILE_TYPES = {mix: mix.upper() for mix in MIXES}
#: the types of the output head and of an untied embedding in a mix file (llama-quantize's defaults)
OUTPUT_TYPES = {mix: {"output": "q6_k", "token_embd": grid} for mix, grid in MIX_GRIDS.items()}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ROLES = (("self_attn.v_proj", "attn_v"), ("mlp.down_proj", "ffn_down"), ("self_attn.o_proj", "attn_output"))


@dataclass(frozen=True)
class MixModel:
    """What the rules read of a model: its decoder layer count, whether llama.cpp counts it as its 70B type (a
    Llama with 80 layers and fewer KV heads than heads), and n_gqa, its heads per KV head (n_head / n_head_kv)."""

    n_layers: int
    llama_70b: bool = False
    n_gqa: int = 1

    @classmethod
    def of(cls, config) -> "MixModel":
        """From a transformers config (its text config for a multimodal one)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n_layers = int(text.num_hidden_layers)
        heads = getattr(text, "num_attention_heads", None)
        kv = getattr(text, "num_key_value_heads", None) or heads
        return cls(n_layers, getattr(text, "model_type", None) == "llama" and n_layers == 80 and kv != heads,
                   int(heads) // int(kv) if heads else 1)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third layer between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _role(name: str) -> str | None:
    return next((role for suffix, role in _ROLES if name.endswith(suffix)), None)


def _rule(mix: str, role: str, i: int, model: MixModel) -> str | None:
    """The grid llama_tensor_get_type_impl gives the `role` linear of layer i under `mix`; None: the default."""
    n = model.n_layers
    if mix in ("q4_k_m", "q5_k_m"):
        return "q6_k" if role != "attn_output" and use_more_bits(i, n) else None
    if mix == "q4_k_s":
        return "q5_k" if (role == "attn_v" and i < 4) or (role == "ffn_down" and i < n // 8) else None
    if mix == "q3_k_l":
        return "q5_k"
    if mix == "q3_k_m":
        first = {"attn_v": i < 2, "ffn_down": i < n // 16, "attn_output": False}[role]
        return "q5_k" if first else "q4_k"
    if mix == "q2_k":
        return "q4_k" if role == "attn_v" and model.n_gqa >= 4 else "q3_k"
    if mix in ("iq4_nl", "iq4_xs"):  # llama-quantize without an importance matrix (with one, ffn_down stays)
        first = {"attn_v": model.n_gqa >= 4, "ffn_down": i < n // 8, "attn_output": False}[role]
        return "q5_k" if first else None
    return None  # q3_k_s, q5_k_s, q6_k


def mix_grid(mix: str, name: str, model: MixModel) -> str:
    """The grid the mix gives the linear `name` (a module path such as "model.layers.3.self_attn.v_proj";
    "lm_head", the output head, takes the mix's output type), before any fallback."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {', '.join(MIXES)}, got {mix!r}")
    if name == "lm_head":  # the output head, where a recipe quantizes it (ignore: []): llama-quantize's type
        return OUTPUT_TYPES[mix]["output"]
    role = _role(name)
    if role is None:
        return MIX_GRIDS[mix]
    found = _LAYER.search(name)
    if found is None:
        raise ValueError(f"{name}: a {role} linear outside the decoder layers (model.layers.N); the {mix} rules "
                         f"count layers")
    grid = _rule(mix, role, int(found.group(1)), model) or MIX_GRIDS[mix]
    if role == "attn_v" and model.llama_70b and grid in ("q3_k", "q4_k"):
        grid = "q5_k"
    return grid


def mix_scheme(mix: str, name: str, in_features: int, model: MixModel, indivisible: str) -> QuantScheme:
    """The scheme of linear `name` with `in_features` inputs under the mix, llama-quantize's fallback applied
    (then the recipe's `indivisible` rule, for a width that is no multiple of 32)."""
    return grid_scheme(mix_grid(mix, name, model)).fitted(in_features, indivisible, llama_cpp=True)
