"""A quantkit checkpoint as a GGUF file llama.cpp runs: metadata, tokenizer and tensors as llama.cpp's own
converter (convert_hf_to_gguf.py) writes them for Llama, Mistral, Qwen2 and Qwen3, with the quantized
linears written as ggml blocks (quantkit/gguf/blocks.py) without a second rounding.

What is exact (a weight of quantkit's [N, K] int q, fp32 scale [N, G], int zero point [N, G] -> blocks of 32):

- symmetric int4, groups of 32, 64, 128 or per channel (K a multiple of 32) -> Q4_0: each block's d is
  its group's scale, q unchanged (ggml's y = d * (nibble - 8) = s * q);
- symmetric int8, same groups -> Q8_0 (y = d * q);
- asymmetric int4 -> Q4_1 with d = s and m = -s * (zp + 8) (quantkit's q + 8 is the nibble): exact up to
  the fp16 rounding of m, which `GGUFExport.q4_1_min_shift` reports (in units of the block's step d);
- weights on a GGUF grid (quantkit.gguf.grids, a GgufLinear: Q2_K ... Q6_K, Q4_1, Q5_1, Q4_0, Q5_0, Q8_0, IQ4_NL,
  IQ4_XS) -> that
  type: the layer holds the blocks themselves (a recipe's `mix` puts its linears on several);
- the scale must be an fp16 value (a bf16 or fp16 checkpoint's scales are, in fp16's normal range); an
  fp32 checkpoint's are refused unless round_scales, which rounds d to fp16 and reports the change.

Everything else (asymmetric int8, K not a multiple of 32, ragged groups) is refused with the recipe to use.
Norms and biases are F32 (as llama.cpp's converter writes every 1-D tensor); the embedding, the output
head and any linear the recipe left in float get `float_type` ("auto" for a mix: llama-quantize's types for
it, quantkit.gguf.mix.OUTPUT_TYPES).

Every file carries quantkit's marker (`quantkit.written_by`, the key right after `general.architecture`), by
which a forced write knows a file it may replace (`not_written_by_quantkit`), and how it was made
(`quantkit.source`, `quantkit.recipe`, `quantkit.calibration`, `quantkit.command`) where the caller says.
Refused before anything is written: sliding-window attention (llama.cpp's llama, qwen2 and qwen3
architectures attend to the whole context and read no window from the file).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import struct
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path

import torch
from torch import nn

from .. import __version__
from ..core.errors import CheckpointError, UsageError
from ..kernels.packing import unpack_int32, unpack_zero_point
from ..formats.loading import source_dtype
from ..modules.kv_scales import read_kv_scales
from ..modules.quant_linear import QuantLinear
from ..modules.quantized_layer import GGUF, holds_format, is_quantized_layer
from ..modules.targets import matches, output_head_name
from . import blocks, reference_quants
from .choices import FLOAT_TYPES, RECIPES_FOR
from .mix import FILE_TYPES, OUTPUT_TYPES
from .pretokenizers import CHECK_TEXT, PRE_TOKENIZERS
from .sentencepiece import load_processor, set_vocab
from .types import BLOCK, GRID_TYPES, for_width

#: the largest RMS difference between a quantized output head and the embedding, relative to the embedding's
#: RMS, for the two to be one matrix quantized (tie_output): 2-bit rounding stays far below it, two unrelated
#: matrices of similar scale are near sqrt(2)
TIED_HEAD_MAX_CHANGE = 0.5
#: config.json model_type -> (gguf architecture name, whether q/k rows are permuted for llama.cpp's rotary)
ARCHITECTURES = {"llama": ("LLAMA", True), "mistral": ("LLAMA", True), "qwen2": ("QWEN2", False),
                 "qwen3": ("QWEN3", False)}
#: the metadata key that marks a GGUF file quantkit wrote (value: "quantkit VERSION"), written right after
#: general.architecture
MARKER_KEY = "quantkit.written_by"
#: the provenance keys a caller may give (each written as quantkit.KEY, a string)
PROVENANCE_KEYS = ("source", "recipe", "calibration", "command")


@dataclass
class GGUFExport:
    """What an export wrote. tensors: GGUF name -> ggml type name; scale_rounding: largest relative change
    of a scale rounded to fp16 (0 when every scale was an fp16 value; only with round_scales);
    q4_1_min_shift: largest |fp16(m) - m| / d over Q4_1 blocks (None without Q4_1).
    tied_lookup_change: with tie_output, the RMS of (quantized head - float embedding) over the embedding's RMS:
    how far the embedding lookup moves when it reads the quantized head (None without tie_output).
    tie_possible: without tie_output, the quantized output head is the embedding's matrix (a tied source), so
    tie_output would write it once."""

    path: Path
    architecture: str
    file_type: str
    tensors: dict[str, str] = field(default_factory=dict)
    scale_rounding: float = 0.0
    q4_1_min_shift: float | None = None
    q4_1_min_shift_rms: float | None = None
    tied_lookup_change: float | None = None
    tie_possible: bool = False
    bytes: int = 0
    #: (GGUF names, what was asked, ggml type written, why): float tensors that took llama-quantize's fallback type
    fallbacks: list[tuple[list[str], str, str, str]] = field(default_factory=list)
    #: what the file cannot hold of the model, in words (printed as warnings)
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t] = counts.get(t, 0) + 1
        lines = [f"wrote {self.path} ({self.bytes / 2**20:.1f} MiB): architecture {self.architecture}, "
                 f"file type {self.file_type}, tensors " + ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))]
        if self.scale_rounding:
            lines.append(f"  scales rounded to fp16: largest relative change {self.scale_rounding:.3g}")
        if self.q4_1_min_shift is not None:
            lines.append(f"  Q4_1 minimum m = -s*(zp+8) rounded to fp16: moves by at most {self.q4_1_min_shift:.3g} "
                         f"of a step d (rms {self.q4_1_min_shift_rms:.3g})")
        if self.tie_possible:
            lines.append("  the quantized output head is the embedding's matrix (tied in the source model), written "
                         "here beside the float embedding: --tie-output writes it once, as token_embd, as llama.cpp's "
                         "files of tied models are")
        if self.tied_lookup_change is not None:
            lines.append(f"  token_embd is the quantized output head, tied as in the source model (no output.weight): "
                         f"the embedding lookup reads it, an RMS change of {self.tied_lookup_change:.3g} of the "
                         f"embedding's RMS")
        for names, asked, written, why in self.fallbacks:
            lines.append(f"  {', '.join(names)}: {asked} asked, written as {written} ({why}, as llama-quantize "
                         f"falls back)")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


# -- weights ----------------------------------------------------------------------------------------


def rope_permutation(rows: int, n_head: int) -> torch.Tensor:
    """int64 [rows]: the row order llama.cpp's converter gives a q (n_head = heads) or k (n_head = kv heads)
    projection of a Llama-style model (LlamaModel.permute): out[i] = w[perm[i]]."""
    idx = torch.arange(rows)
    return idx.reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(rows)


def _block_scales(scale: torch.Tensor, k: int, group_size: int | None) -> torch.Tensor:
    """[N, G] group scales -> [N, K/32], one per block of 32 (a group of 64 or 128 spans 2 or 4 blocks)."""
    per = (group_size or k) // BLOCK
    return scale.repeat_interleave(per, dim=1) if scale.shape[1] * per == k // BLOCK else None


def _fp16_scales(scale: torch.Tensor, name: str, round_scales: bool) -> tuple[torch.Tensor, float]:
    """fp32 [N, G] -> (fp16 [N, G], largest relative change); UsageError unless exact or round_scales."""
    s16 = scale.to(torch.float16)
    change = ((s16.float() - scale).abs() / scale.abs().clamp(min=1e-30)).max().item() if scale.numel() else 0.0
    if change and not round_scales:
        raise UsageError(
            f"{name}: its scales are not fp16 values (the checkpoint stores them in {scale.dtype}, largest relative "
            f"change to fp16 {change:.3g}), so GGUF's fp16 block scale d would round them again: re-quantize with "
            f"--dtype bfloat16 or --dtype float16, or pass --round-scales to round them (the change is printed)")
    if not torch.isfinite(s16).all():
        raise UsageError(f"{name}: a scale does not fit in fp16 (largest {scale.abs().max().item():.3g})")
    return s16, change


def unwritable_scheme(scheme) -> str | None:
    """Why weights of `scheme` (a QuantScheme) have no GGUF block type, with the recipes to use, or None (a
    scheme on a GGUF grid, or int4 / symmetric int8 in groups or per channel; whether each layer's inputs
    split into blocks of 32 is known only from the model)."""
    if scheme.grid != "uniform":
        return None
    if scheme.type != "int" or (scheme.num_bits == 8 and not scheme.symmetric) or scheme.strategy == "tensor":
        return (f"{scheme.describe()} has no GGUF block type; quantize with a symmetric int8 recipe "
                f"({RECIPES_FOR['Q8_0']}: Q8_0) or an int4 one ({RECIPES_FOR['Q4_0']}: Q4_0)")
    return None


def gguf_weight(layer: QuantLinear, name: str, *, row_order: torch.Tensor | None = None,
                round_scales: bool = False) -> tuple[str, torch.Tensor, dict]:
    """A QuantLinear's weight as ggml blocks, without re-quantizing.

    returns (ggml type name, uint8 [N, K/32 * block bytes], measures: 'scale_rounding', and for Q4_1
    'min_shift' / 'min_shift_sq' / 'blocks' (|fp16(m) - m| / d: largest and sum of squares)).
    row_order: int64 [N] rows in GGUF's order (llama.cpp's rotary permutation of q/k; rows and their
    scales and zero points move together, which is exact).
    """
    scheme, k, n = layer.scheme, layer.in_features, layer.out_features
    bits = scheme.num_bits
    why = unwritable_scheme(scheme)
    if why:
        raise UsageError(f"{name}: {why}")
    kind = "Q8_0" if bits == 8 else "Q4_0" if scheme.symmetric else "Q4_1"
    scale = layer.weight_scale.float()
    d = None if k % BLOCK else _block_scales(scale, k, layer.group_size)
    if d is None:
        raise UsageError(f"{name}: {scheme.describe()} with {k} inputs does not split into GGUF blocks of 32 "
                         f"(K must be a multiple of 32 and each group whole); quantize with {RECIPES_FOR[kind]}")
    q = unpack_int32(layer.weight_packed, bits, k)  # int8 [N, K]
    zp = unpack_zero_point(layer.weight_zero_point, bits, n) if not scheme.symmetric else None  # int32 [N, G]
    if row_order is not None:
        q, d = q[row_order], d[row_order]
        zp = zp[row_order] if zp is not None else None
    d16, change = _fp16_scales(d, name, round_scales)
    measures = {"scale_rounding": change}
    if kind == "Q8_0":
        return kind, blocks.pack_q8_0(q, d16), measures
    if kind == "Q4_0":
        return kind, blocks.pack_q4_0(q, d16), measures
    zb = _block_scales(zp.float(), k, layer.group_size)  # [N, K/32]
    m = -d16.float() * (zb + 8)  # y = s*(q - zp) = d*(q + 8) - s*(zp + 8)
    m16 = m.to(torch.float16)
    shift = (m16.float() - m).abs() / d16.float()
    measures.update(min_shift=shift.max().item(), min_shift_sq=shift.pow(2).sum().item(), blocks=shift.numel())
    return kind, blocks.pack_q4_1((q.to(torch.int16) + 8), d16, m16), measures


# -- metadata and tokenizer -------------------------------------------------------------------------


def _hparams(folder: Path) -> dict:
    with open(folder / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    if "text_config" in config:
        config = {**config, **config["text_config"]}
    return config


def architecture_of(hparams: dict) -> tuple[str, bool]:
    model_type = hparams.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UsageError(f"GGUF export supports model types {', '.join(ARCHITECTURES)}; this checkpoint is "
                         f"{model_type!r}")
    return ARCHITECTURES[model_type]


def sliding_window_problem(config) -> str | None:
    """Why llama.cpp would not run the model of `config` (a transformers config) as it runs, or None: a sliding
    window shorter than its context. llama.cpp's llama, qwen2 and qwen3 architectures read no window from a
    GGUF file (llama-model.cpp: src/models/llama.cpp, qwen2.cpp, qwen3.cpp; its converter writes none for
    Mistral) and attend to every earlier token."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    sliding = "sliding_attention" in layer_types if layer_types is not None else window is not None
    context = getattr(config, "max_position_embeddings", None)
    if not sliding or window is None or (context is not None and window >= context):
        return None
    return (f"the model attends to the last {window} tokens only (sliding_window {window}, context {context}), and "
            f"llama.cpp's {architecture_of(config.to_dict())[0].lower()} architecture has no sliding window: it "
            f"attends to every earlier token, so past {window} tokens its outputs would differ from the model's; to "
            f"write it with full attention (the same outputs on contexts of at most {window} tokens), set "
            f"\"sliding_window\": null in a copy of the model folder's config.json and convert that")


def check_exportable(folder: str | os.PathLike) -> None:
    """UsageError now, before any quantization, when the model in `folder` has no GGUF architecture or
    tokenizer here, or an attention llama.cpp would not run as it does (sliding_window_problem)."""
    from transformers import AutoConfig  # import time: transformers loads only where it is used

    hparams = _hparams(Path(folder))
    architecture_of(hparams)
    _rope(hparams)
    problem = sliding_window_problem(AutoConfig.from_pretrained(folder))
    if problem:
        raise UsageError(f"{folder}: {problem}")
    if _tokenizer_kind(Path(folder)) == "sentencepiece":
        load_processor(Path(folder) / "tokenizer.model")
    else:
        _bpe_tokenizer(Path(folder), hparams["vocab_size"])


def _bpe_tokenizer(folder: Path, vocab_size: int):
    """(tokenizer, {id: token}, llama.cpp's pre-tokenizer name) of a BPE folder; CheckpointError for a token id
    the model has no row for, UsageError for a pre-tokenizer llama.cpp does not know."""
    from transformers import AutoTokenizer  # import time: transformers loads only where it is used

    tokenizer_json = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reverse = {i: t for t, i in tokenizer.vocab.items()}
    if max(reverse) >= vocab_size:
        raise CheckpointError(f"{folder}: the tokenizer has token id {max(reverse)} >= vocab_size {vocab_size}")
    return tokenizer, reverse, pre_tokenizer_name(tokenizer, tokenizer_json)


def _rope(hparams: dict) -> dict:
    """The model's rotary parameters (rope_theta among them); UsageError for a scaling GGUF export does not
    write (default and linear it does)."""
    rope = dict(hparams.get("rope_parameters") or hparams.get("rope_scaling") or {})
    if "rope_theta" not in rope and hparams.get("rope_theta") is not None:
        rope["rope_theta"] = hparams["rope_theta"]
    rope_type = rope.get("rope_type", rope.get("type"))
    if not (rope_type in (None, "default") or (rope_type == "linear" and rope.get("factor") is not None)):
        raise UsageError(f"rope type {rope_type!r} is not written to GGUF yet (default and linear are)")
    return rope


def _set_parameters(writer, hparams: dict, arch: str, file_type) -> None:
    """The hyperparameters convert_hf_to_gguf (TextModel and LlamaModel.set_gguf_parameters) writes."""
    import gguf  # an optional dependency (quantkit[gguf])

    writer.add_block_count(hparams["num_hidden_layers"])
    if hparams.get("max_position_embeddings") is not None:
        writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    if hparams.get("num_key_value_heads") is not None:
        writer.add_head_count_kv(hparams["num_key_value_heads"])
    rope = _rope(hparams)
    if rope.get("rope_type", rope.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    if hparams.get("head_dim") is not None:
        writer.add_key_length(hparams["head_dim"])
        writer.add_value_length(hparams["head_dim"])
    writer.add_file_type(file_type)
    if arch == "LLAMA":
        writer.add_vocab_size(hparams["vocab_size"])
        writer.add_rope_dimension_count(hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"])


def pre_tokenizer_name(tokenizer, tokenizer_json: dict) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a BPE tokenizer: by the hash llama.cpp's converter computes,
    else "gpt-2" for a plain byte-level pre-tokenizer with GPT-2's regex (what such a tokenizer applies)."""
    # verbose=False: CHECK_TEXT may be longer than the model's context, which is no problem for hashing it
    digest = sha256(str(tokenizer.encode(CHECK_TEXT, verbose=False)).encode()).hexdigest()
    if digest in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[digest]
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not tokenizer_json.get("normalizer"):
        return "gpt-2"
    raise UsageError(f"the tokenizer's pre-tokenizer is not one llama.cpp knows (hash {digest[:16]}..., "
                     f"pre_tokenizer {json.dumps(pre)[:120]}); llama.cpp could not tokenize text as this model does")


def _tokenizer_kind(folder: Path) -> str:
    """"sentencepiece" for a folder with a tokenizer.model (llama.cpp's converter writes it before any
    tokenizer.json for Llama, Mistral and Qwen2: LlamaModel / Qwen2Model.set_vocab), else "bpe" for a
    tokenizer.json of model type BPE; UsageError for anything else."""
    if (folder / "tokenizer.model").is_file():
        return "sentencepiece"
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UsageError(f"{folder} has neither tokenizer.model nor tokenizer.json: GGUF export writes SentencePiece "
                         f"(tokenizer.model) and BPE (tokenizer.json) vocabularies")
    kind = (json.loads(path.read_text(encoding="utf-8")).get("model") or {}).get("type")
    if kind != "BPE":
        raise UsageError(f"{path}: a {kind} tokenizer, and no SentencePiece tokenizer.model beside it; GGUF export "
                         f"writes BPE tokenizer.json and SentencePiece tokenizer.model vocabularies only")
    return "bpe"


def _set_vocab(writer, folder: Path, vocab_size: int, arch: str) -> None:
    """Tokens, types, merges, special ids and chat template as convert_hf_to_gguf's _set_vocab_gpt2 writes them,
    or a SentencePiece vocabulary as its _set_vocab_sentencepiece does (gguf_sentencepiece.py)."""
    import gguf  # an optional dependency (quantkit[gguf])

    if _tokenizer_kind(folder) == "sentencepiece":
        return set_vocab(writer, folder, vocab_size, arch)
    tokenizer, reverse, pre = _bpe_tokenizer(folder, vocab_size)
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or (token.startswith("<|") and token.endswith("|>")):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with _without_pair_template_warnings():
        gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer, quiet=True)


class _PairTemplateFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "TemplateProcessing<pair>" not in record.getMessage()


@contextmanager
def _without_pair_template_warnings():
    """The gguf package's SpecialVocab guesses add_sep_token from the tokenizer's template for a pair of
    sequences and warns (`Unknown separator token '<|bos|>' in TemplateProcessing<pair>`) when the token
    between the two is not a separator; it then writes no add_sep_token, which is right: llama.cpp reads it
    only to join a pair of texts (reranking), never for text generation. Its other warnings still show."""
    logger, quiet = logging.getLogger("gguf.vocab"), _PairTemplateFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


# -- the file ---------------------------------------------------------------------------------------


def float_fallback(float_type: str, width: int) -> tuple[str, str | None]:
    """(the type a float tensor of `width` inputs takes for float_type, why it is another one or None): as
    llama-quantize falls back (gguf.types.for_width), a width that is no multiple of 256 gets Q8_0 for q6_k and
    Q5_0 for q4_k, one that is no multiple of 32 F16."""
    if float_type not in GRID_TYPES:
        return float_type, None
    ggml, whole = for_width(float_type, width, llama_cpp=True)
    if not whole:
        return "f16", f"{width} inputs are no whole block of {ggml.block}"
    if ggml.grid != float_type:
        return ggml.grid, f"{width} inputs are no whole super-block of {GRID_TYPES[float_type].block}"
    return float_type, None


def _float_tensor(t: torch.Tensor, float_type: str):
    """(numpy data, ggml type) for a float tensor written in float_type (FLOAT_TYPES but auto; its fallback
    for the tensor's width, float_fallback). q8_0, the K-quants and the IQ4 types (a mix's embedding) are
    llama.cpp's rounding (quantkit.gguf.reference_quants), q5_0 and the other blocks of 32 the gguf package's."""
    import gguf  # an optional dependency (quantkit[gguf])

    data = t.detach().float().cpu()
    float_type, _ = float_fallback(float_type, data.shape[-1])
    qtype = getattr(gguf.GGMLQuantizationType, float_type.upper())
    if float_type == "f32":
        return data.numpy(), qtype
    port = getattr(reference_quants, f"quantize_{float_type}", None)  # Q8_0, the K-quants, IQ4_NL, IQ4_XS
    if port is not None:
        rows = data.reshape(-1, data.shape[-1])  # [..., K] -> [rows, K]
        return port(rows).reshape(*data.shape[:-1], -1).numpy(), qtype
    return gguf.quants.quantize(data.numpy(), qtype), qtype


def check_tie_output(recipe, source: Path) -> None:
    """UsageError before any work unless the output head can be tied (tie_output) after quantizing with `recipe`:
    the recipe quantizes the output head, and the model in `source` ties it to the embedding (what the quantized
    model must then show is _tied_head's)."""
    head = nn.Linear(1, 1)
    if recipe.weights is None or any(matches("lm_head", head, p) for p in recipe.ignore) or not any(
            matches("lm_head", head, p) for p in recipe.targets):
        raise UsageError(f"--tie-output writes the quantized output head as the embedding, and recipe {recipe.name} "
                         f"leaves lm_head in float: quantize it too (a recipe with `ignore: []`), or drop --tie-output")
    config = source / "config.json"
    if config.is_file() and not json.loads(config.read_text()).get("tie_word_embeddings", False):
        raise UsageError(f"--tie-output is for a model whose output head is its embedding, and {source}'s "
                         f"config.json has tie_word_embeddings false: drop --tie-output")


def _tied_head(model: nn.Module, head: str | None, embedding: str | None,
               quantized: set[str]) -> tuple[float | None, str | None]:
    """(RMS(dequantized head - float embedding) / RMS(float embedding), None) where the quantized output head
    is the embedding's own matrix, else (None, why it cannot be written as the tied token_embd)."""
    if embedding is None:
        return None, "this model has no input embedding module to tie the output head to; leave the output untied"
    if head not in quantized:
        return None, ("tying the output to the embedding writes the quantized output head as token_embd, and this "
                      "model's output head is not quantized: quantize it too (a recipe with `ignore: []`), or leave "
                      "the output untied")
    table = model.get_submodule(embedding).weight.detach().float()
    weight = model.get_submodule(head).dequantized_weight().float()
    if weight.shape != table.shape:
        return None, (f"the output head {tuple(weight.shape)} and the embedding {tuple(table.shape)} differ in "
                      f"shape: they cannot be one tensor; leave the output untied")
    change = float((weight - table).pow(2).mean().sqrt() / table.pow(2).mean().sqrt().clamp_min(1e-30))
    if change > TIED_HEAD_MAX_CHANGE:
        return None, (f"the quantized output head differs from the embedding by {change:.3g} of its RMS: they are "
                      f"different matrices (the source model's embeddings are not tied); leave the output untied")
    return change, None


def export_gguf(model: nn.Module, folder: str | os.PathLike, out: Path, *, float_type: str = "auto",
                round_scales: bool = False, name: str | None = None, mix: str | None = None,
                tie_output: bool = False, provenance: dict[str, str] | None = None,
                check_space: Callable[[int], None] | None = None) -> GGUFExport:
    """Write `model` (a quantkit checkpoint loaded from `folder`, whose tokenizer and config.json are read)
    to the file `out` (overwritten: the caller writes to a temporary path). returns what was written.
    mix: the recipe's mix (quantkit.gguf.mix), which names the file type and, with float_type "auto", the
    types of the embedding and output head.
    tie_output: write the quantized output head as token_embd and no output.weight, as llama.cpp's files of
    models with tied embeddings are (llama.cpp then reads both the lookup and the head from it): for a
    source model whose embedding is its head, quantized with the head (a recipe with `ignore: []`); the
    lookup's change is measured (GGUFExport.tied_lookup_change).
    provenance: how the model was made, by PROVENANCE_KEYS (written as quantkit.KEY beside the marker).
    check_space: called with the bytes the file's tensors take before anything is written (to refuse a disk
    without room for them)."""
    import gguf  # an optional dependency (quantkit[gguf])


    folder = Path(folder)
    hparams = _hparams(folder)
    arch, permute = architecture_of(hparams)
    problem = sliding_window_problem(model.config)
    if problem:
        raise UsageError(f"{folder}: {problem}")
    unknown = sorted(set(provenance or {}) - set(PROVENANCE_KEYS))
    if unknown:
        raise ValueError(f"unknown provenance keys {unknown}; known: {', '.join(PROVENANCE_KEYS)}")
    if float_type not in FLOAT_TYPES:
        raise UsageError(f"float type must be one of {', '.join(FLOAT_TYPES)}, got {float_type!r}")
    tied = bool(hparams.get("tie_word_embeddings", False))
    float_types = {}  # gguf name -> its type where a mix's defaults choose it
    if float_type == "auto" and mix is not None:
        float_types = {"output.weight": OUTPUT_TYPES[mix]["output"],
                       "token_embd.weight": OUTPUT_TYPES[mix]["output" if tied else "token_embd"]}
    if float_type == "auto":
        float_type = "bf16" if source_dtype(model) == torch.bfloat16 else "f16"  # as stored, not as loaded
    n_blocks = hparams["num_hidden_layers"]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), n_blocks)
    n_head, n_kv = hparams["num_attention_heads"], hparams.get("num_key_value_heads") or hparams["num_attention_heads"]

    def order(hf_name: str, rows: int) -> torch.Tensor | None:
        if not permute:
            return None
        if ".q_proj." in hf_name + ".":
            return rope_permutation(rows, n_head)
        if ".k_proj." in hf_name + ".":
            return rope_permutation(rows, n_kv)
        return None

    pending: list[tuple[str, object, object]] = []  # (gguf name, data, ggml type)
    result = GGUFExport(path=out, architecture=gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch)], file_type="")
    if read_kv_scales(model)[0]:
        result.warnings.append(
            "the FP8 KV cache scales are not written: GGUF holds no calibrated KV-cache scales, and llama.cpp picks "
            "its cache type when it runs (F16 by default; --cache-type-k q8_0 --cache-type-v q8_0 for an 8-bit one)")
    fallbacks: dict[tuple[str, str, str], list[str]] = {}  # (asked, written, why) -> gguf names
    kinds: dict[str, int] = {}
    shift_max, shift_sq, shift_n = None, 0.0, 0
    quantized = {n for n, m in model.named_modules() if is_quantized_layer(m)}
    head = output_head_name(model)
    embedding = next((n for n, m in model.named_modules() if m is model.get_input_embeddings()), None)
    if tie_output or head in quantized:  # with a quantized head, say whether --tie-output applies
        change, why_not = _tied_head(model, head, embedding, quantized)
        if tie_output and why_not:
            raise UsageError(why_not)
        result.tied_lookup_change = change if tie_output else None
        result.tie_possible = not tie_output and why_not is None
    for module_name, module in model.named_modules():
        if module_name not in quantized:
            continue
        gname = names.get_name(module_name + ".weight", try_suffixes=(".weight",))
        if tie_output and module_name == head:
            gname = names.get_name(embedding + ".weight", try_suffixes=(".weight",))
        if gname is None:
            raise UsageError(f"{module_name}: no GGUF tensor name for it in llama.cpp's {arch} layout")
        rows = order(module_name, module.out_features)
        if holds_format(module, GGUF):  # its blocks as they are; a row permutation moves whole rows
            kind, data, measures = module.gguf_type, module.weight_blocks if rows is None else module.weight_blocks[rows], {}
        else:
            kind, data, measures = gguf_weight(module, module_name, row_order=rows, round_scales=round_scales)
        kinds[kind] = kinds.get(kind, 0) + module.in_features * module.out_features
        result.scale_rounding = max(result.scale_rounding, measures.get("scale_rounding", 0.0))
        if "min_shift" in measures:
            shift_max = max(shift_max or 0.0, measures["min_shift"])
            shift_sq, shift_n = shift_sq + measures["min_shift_sq"], shift_n + measures["blocks"]
        pending.append((gname, data.cpu().numpy(), getattr(gguf.GGMLQuantizationType, kind)))
    for pname, tensor in model.state_dict().items():
        module_name, _, leaf = pname.rpartition(".")
        if module_name in quantized and leaf != "bias":
            continue  # the packed weight, its scales and shape: written above
        if leaf not in ("weight", "bias") or pname.endswith("rotary_emb.inv_freq"):
            continue
        if tied and pname == "lm_head.weight":
            continue  # llama.cpp reads the output head from token_embd when output.weight is absent
        if tie_output and pname == embedding + ".weight":
            continue  # token_embd is the quantized head, written above
        gname = names.get_name(pname, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise UsageError(f"{pname}: no GGUF tensor name for it in llama.cpp's {arch} layout")
        rows = order(module_name, tensor.shape[0])
        t = tensor[rows] if rows is not None else tensor
        if t.dim() <= 1 or gname.endswith("_norm.weight"):
            data, qtype = t.detach().float().cpu().numpy(), gguf.GGMLQuantizationType.F32
        else:
            asked = float_types.get(gname, float_type)
            written, why = float_fallback(asked, t.shape[-1])
            if why:
                fallbacks.setdefault((asked, written.upper(), why), []).append(gname)
            data, qtype = _float_tensor(t, asked)
        pending.append((gname, data, qtype))
    result.fallbacks = [(names, asked, written, why) for (asked, written, why), names in fallbacks.items()]
    if shift_max is not None:
        result.q4_1_min_shift, result.q4_1_min_shift_rms = shift_max, math.sqrt(shift_sq / max(shift_n, 1))
    main = max(kinds, key=kinds.get) if kinds else float_type.upper()  # the type most weights have
    main = FILE_TYPES[mix] if mix is not None else {"Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S"}.get(main, main)  # by mix
    result.file_type = main
    file_type = gguf.LlamaFileType.ALL_F32 if main == "F32" else getattr(gguf.LlamaFileType, "MOSTLY_" + main)

    if check_space is not None:
        check_space(sum(data.nbytes for _, data, _ in pending))
    writer = gguf.GGUFWriter(str(out), result.architecture)
    writer.add_string(MARKER_KEY, f"quantkit {__version__}")  # right after general.architecture
    for key, value in (provenance or {}).items():
        writer.add_string(f"quantkit.{key}", value)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or folder.name)
    _set_parameters(writer, hparams, arch, file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _set_vocab(writer, folder, hparams["vocab_size"], arch)
    for gname, data, qtype in pending:
        writer.add_tensor(gname, data, raw_dtype=qtype)
        result.tensors[gname] = qtype.name
    try:
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()  # flushes: a full disk may show here first
    except OSError as e:
        raise _write_error(e, out) from None
    result.bytes = out.stat().st_size
    return result


def _write_error(e: OSError, out: Path) -> OSError:
    """An OSError of the gguf writer that names `out`: numpy's tofile reports a short write ("N requested and M
    written") without an errno, which on a file is a full disk or quota: ENOSPC when the folder has no room
    left, else EIO."""
    if e.errno is not None:
        return OSError(e.errno, e.strerror, str(out)) if e.filename is None else e
    try:
        full = shutil.disk_usage(out.parent).free < 1 << 20
    except OSError:
        full = False
    return OSError(errno.ENOSPC if full else errno.EIO, f"{os.strerror(errno.ENOSPC if full else errno.EIO)} "
                   f"(a short write: {e})", str(out))


def not_written_by_quantkit(path: str | os.PathLike) -> str | None:
    """None when `path` is a GGUF file quantkit wrote (MARKER_KEY among its first metadata entries), else why
    it is not, in words (for a forced write, which replaces only such a file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as e:
        return f"it cannot be read ({e.strerror}), so it is not known to be a file quantkit wrote"
    if head[:4] != b"GGUF":
        return "it is not a GGUF file, and quantkit replaces only GGUF files it wrote"
    if MARKER_KEY not in _first_keys(head, 4):
        return f"it is a GGUF file quantkit did not write (its metadata has no {MARKER_KEY})"
    return None


#: bytes of the GGUF metadata value types of a fixed size (gguf.GGUFValueType: UINT8 ... FLOAT64)
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING = 8


def _first_keys(head: bytes, most: int) -> list[str]:
    """The keys of the first `most` metadata entries of a little-endian GGUF file's first bytes `head`, up to
    the first array value or the end of `head` (header: magic, u32 version, u64 tensor count, u64 entry count;
    an entry: u64 length and key bytes, u32 value type, the value)."""
    keys: list[str] = []
    try:
        (count,) = struct.unpack_from("<Q", head, 16)
        at = 24
        for _ in range(min(count, most)):
            (size,) = struct.unpack_from("<Q", head, at)
            if at + 12 + size > len(head):
                break
            key = head[at + 8:at + 8 + size]
            (kind,) = struct.unpack_from("<I", head, at + 8 + size)
            at += 12 + size
            if kind != _STRING and kind not in _VALUE_BYTES:
                break
            keys.append(key.decode("utf-8", "replace"))
            (size,) = struct.unpack_from("<Q", head, at) if kind == _STRING else (_VALUE_BYTES[kind] - 8,)
            at += 8 + size
    except struct.error:  # the entries run past `head`
        pass
    return keys
