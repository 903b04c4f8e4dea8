"""GGUF files in: the header and hyperparameters checked before anything else reads the file, the tensor set
checked against what the architecture needs (as llama.cpp checks it when it loads a file), the file's own
vocabulary, and the transformers model of it (weights dequantized by transformers with the `gguf` package).

GGUF shapes are ggml's: ne0 (the row length: a linear's input features) first.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.device import resolve_device
from ..core.errors import CheckpointError, EvaluationError, first_names
from ..core.finite import describe_nonfinite, nonfinite_tensors
from ..formats.loading import SOURCE_DTYPE_ATTRIBUTE, _one_line, _quiet_loading_report, config_errors

#: Attribute that load_gguf_model sets on a model: its GGUFOrigin.
GGUF_ORIGIN_ATTRIBUTE = "quantkit_gguf_origin"
FLOAT_TYPES = ("F32", "F16", "BF16")

#: Bytes a header entry takes at the least: a key/value (key length, a 1-byte key, value type, a 1-byte
#: value) and a tensor description (name length, a 1-byte name, dimension count, one dimension, type, offset).
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, key/value count
_VERSIONS = (2, 3)
#: A size no model has (int32 range): larger values are corrupt metadata, and would be allocated as is.
_SIZE_LIMIT = 2**31 - 1
#: Sizes some architectures give per block, as a list (llama.cpp's per-layer hyperparameters: OpenELM, LFM2)
_PER_LAYER = ("attention.head_count", "attention.head_count_kv", "feed_forward_length")


def is_gguf_file(source: str | os.PathLike) -> bool:
    """Whether `source` names a GGUF file: a path ending in .gguf that is no folder (one that does not exist
    too: read_gguf says so, where a model name would be asked of the hub)."""
    path = Path(os.path.expanduser(str(source)))
    return path.suffix.lower() == ".gguf" and not path.is_dir()


@dataclass(frozen=True)
class GGUFOrigin:
    """What a model load_gguf_model made keeps of its file: the path, the embedding tables ("input",
    "output") the file stores on a grid (llama.cpp quantizes them), which a baseline check compares within a
    grid's rounding, and how many of its tensors are on a grid (0: a float file, such as llama.cpp's F16)."""

    path: str
    quantized_tables: frozenset
    quantized_tensors: int


def gguf_origin(model: nn.Module) -> GGUFOrigin | None:
    """The GGUFOrigin of a model load_gguf_model made; None for any other model."""
    origin = getattr(model, GGUF_ORIGIN_ATTRIBUTE, None)
    return origin if isinstance(origin, GGUFOrigin) else None


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's description: type (a ggml type name: "Q4_0", "F32", ...), shape in ggml order (ne0 first),
    bytes stored."""

    type: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Hyperparameters:
    """The shapes a GGUF file's metadata gives its architecture, checked (check_hyperparameters)."""

    blocks: int
    embedding: int
    feed_forward: int | None  # None: absent, or one per block
    heads: int | None  # None: no attention, or one per block
    kv_heads: int | None
    head_dim: int | None  # attention.key_length, or embedding / heads
    value_dim: int | None  # attention.value_length, or head_dim
    context: int | None
    vocab: int  # tokens in tokenizer.ggml.tokens (or vocab_size)
    experts: int = 0  # expert_count: 0 for a dense model


@dataclass(frozen=True)
class GGUFContents:
    """A GGUF file read and checked: architecture, metadata (key -> value), tensors (name -> GGUFTensor)."""

    path: Path
    architecture: str
    fields: dict
    tensors: dict[str, GGUFTensor]
    hyperparameters: Hyperparameters


def check_header(path: Path) -> None:
    """CheckpointError unless the file starts with a GGUF header (magic, version 2 or 3) whose tensor and
    key/value counts a file of this size can hold: a corrupt count would have the reader index past the end."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e}); check its permissions") from None
    if len(raw) < _HEADER.size or raw[:4] != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (no GGUF header); give a .gguf file that llama.cpp or "
                              f"quantkit wrote")
    _, version, tensors, kvs = _HEADER.unpack(raw)
    if version not in _VERSIONS:  # a file written on a big-endian machine
        _, version, tensors, kvs = struct.Struct(">4sIQQ").unpack(raw)
    if version not in _VERSIONS:
        raise CheckpointError(f"{path}: GGUF version {version} is not one quantkit reads (2 or 3); re-create the file "
                              f"with a current llama.cpp or quantkit")
    room = size - _HEADER.size
    if tensors * _MIN_TENSOR_INFO_BYTES > room or kvs * _MIN_KV_BYTES > room:
        raise CheckpointError(
            f"{path}: its header says {tensors} tensors and {kvs} metadata entries, more than a file of {size} bytes "
            f"can describe: the file is corrupt or truncated; re-create or re-download it")


def read_gguf(path: str | os.PathLike) -> GGUFContents:
    """The file's metadata and tensor descriptions, checked: header (check_header), structure (the gguf
    package's reader), hyperparameters (check_hyperparameters) and tensors (check_tensors). No weight is read."""
    try:
        import gguf  # an optional dependency (quantkit[gguf])
    except ImportError:
        raise CheckpointError(f"{path}: reading GGUF files needs the `gguf` package (pip install 'quantkit[gguf]')") from None
    path = Path(os.path.expanduser(str(path)))
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist{' as a regular file' if path.exists() else ''}; "
                              f"check the path")
    check_header(path)
    try:
        reader = gguf.GGUFReader(str(path))
        fields = {name: field.contents() for name, field in reader.fields.items()}
        tensors = {t.name: GGUFTensor(t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.n_bytes))
                   for t in reader.tensors}
        ends = [t.data_offset + t.n_bytes for t in reader.tensors]
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {_one_line(e)}); the file is "
                              f"corrupt or truncated: re-create or re-download it") from None
    if ends and max(ends) > path.stat().st_size:
        raise CheckpointError(f"{path}: its tensors end past the end of the file ({max(ends)} > {path.stat().st_size} "
                              f"bytes): the file is truncated; re-create or re-download it")
    architecture = fields.get("general.architecture")
    if not isinstance(architecture, str) or not architecture:
        raise CheckpointError(f"{path}: no general.architecture in its metadata; not a model file llama.cpp can run")
    hyperparameters = check_hyperparameters(architecture, fields, where=str(path))
    check_tensors(architecture, hyperparameters, tensors, where=str(path))
    return GGUFContents(path, architecture, fields, tensors, hyperparameters)


def check_hyperparameters(architecture: str, fields: dict, *, where: str = "the GGUF file") -> Hyperparameters:
    """The shapes `fields` (GGUF metadata: key -> value) give `architecture`'s model; CheckpointError naming the
    key when one is missing, not a positive integer (or beyond int32), or inconsistent with another: heads that
    do not divide the embedding (without a key_length), KV heads that do not divide the heads, a rotary dimension
    beyond the head's, a vocabulary that disagrees with the tokenizer's token list, a non-positive norm epsilon
    or rope base."""
    def bad(key: str, value, why: str) -> CheckpointError:
        return CheckpointError(f"{where}: metadata {key} = {_shown(value)} {why}; the file is corrupt or was edited: "
                               f"re-create it from its source model")

    def size(name: str, required: bool = True) -> int | None:
        """The value of `name`; None when it is absent (and not required) or a per-layer list (checked here)."""
        key = f"{architecture}.{name}"
        if key not in fields:
            if required:
                raise CheckpointError(f"{where}: metadata {key} is missing; the file is incomplete: re-create it")
            return None
        value = fields[key]
        if isinstance(value, list) and name in _PER_LAYER:  # one value per block (0: none in that block)
            if len(value) != blocks or not all(type(v) is int and 0 <= v <= _SIZE_LIMIT for v in value) or not any(value):
                raise bad(key, value, f"is not a list of {blocks} integers, one per block, not all 0")
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _SIZE_LIMIT:
            raise bad(key, value, "is not a positive integer (at most 2^31 - 1)")
        return value

    blocks = size("block_count")
    embedding = size("embedding_length")
    heads = size("attention.head_count", required=False)  # absent: no attention (mamba, rwkv)
    kv_heads = size("attention.head_count_kv", required=False) or heads
    feed_forward, context = size("feed_forward_length", required=False), size("context_length", required=False)
    head_dim = size("attention.key_length", required=False)
    if head_dim is None and heads is not None:
        if embedding % heads:
            raise bad(f"{architecture}.embedding_length", embedding,
                      f"is not a multiple of attention.head_count {heads} (and no attention.key_length gives the "
                      f"head size)")
        head_dim = embedding // heads
    value_dim = size("attention.value_length", required=False) or head_dim
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise bad(f"{architecture}.attention.head_count_kv", kv_heads,
                  f"does not divide attention.head_count {heads} (each KV head serves a whole group of heads)")
    rotary = size("rope.dimension_count", required=False)
    if rotary is not None and (rotary % 2 or (head_dim is not None and rotary > head_dim)):
        raise bad(f"{architecture}.rope.dimension_count", rotary, f"is not an even number of at most the head size "
                                                                  f"{head_dim}")
    for name in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base"):
        value = fields.get(f"{architecture}.{name}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise bad(f"{architecture}.{name}", value, "is not a positive finite number")
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = size("vocab_size", required=tokens is None)
    if tokens is not None:
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise bad("tokenizer.ggml.tokens", "...", "is not a list of token strings")
        if vocab is not None and vocab != len(tokens):
            raise bad(f"{architecture}.vocab_size", vocab, f"differs from the {len(tokens)} tokens of "
                                                           f"tokenizer.ggml.tokens")
        vocab = len(tokens)
    for name in ("bos", "eos", "padding", "unknown", "seperator"):
        key = f"tokenizer.ggml.{name}_token_id"
        value = fields.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab):
            raise bad(key, value, f"is no token id of the vocabulary of {vocab}")
    experts = fields.get(f"{architecture}.expert_count", 0)  # 0: a dense model
    if experts != 0:
        experts = size("expert_count")
    return Hyperparameters(blocks, embedding, feed_forward, heads, kv_heads, head_dim, value_dim, context, vocab,
                           experts)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def expected_tensors(architecture: str, hp: Hyperparameters) -> tuple[dict, set] | None:
    """({name: ggml shape} the architecture needs, names it may also have) as llama.cpp's loader lists them
    for the dense llama, qwen2 and qwen3 architectures (llama-model.cpp: a required tensor missing or of
    another shape, or any tensor more, and it refuses the file); None for other architectures or MoE files."""
    if architecture not in ("llama", "qwen2", "qwen3") or hp.feed_forward is None or hp.heads is None or hp.experts:
        return None
    e, q, kv, v = hp.embedding, hp.heads * hp.head_dim, hp.kv_heads * hp.head_dim, hp.kv_heads * hp.value_dim
    need = {"token_embd.weight": (e, hp.vocab), "output_norm.weight": (e,)}
    optional = {"output.weight", "rope_freqs.weight"}
    for i in range(hp.blocks):
        b = f"blk.{i}."
        need |= {b + "attn_norm.weight": (e,), b + "attn_q.weight": (e, q), b + "attn_k.weight": (e, kv),
                 b + "attn_v.weight": (e, v), b + "attn_output.weight": (hp.heads * hp.value_dim, e),
                 b + "ffn_norm.weight": (e,), b + "ffn_gate.weight": (e, hp.feed_forward),
                 b + "ffn_up.weight": (e, hp.feed_forward), b + "ffn_down.weight": (hp.feed_forward, e)}
        biases = {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (v,)}
        if architecture == "qwen2":
            need |= biases
        elif architecture == "qwen3":
            need |= {b + "attn_q_norm.weight": (hp.head_dim,), b + "attn_k_norm.weight": (hp.head_dim,)}
        else:
            optional |= set(biases) | {b + "attn_output.bias"}
    return need, optional


def check_tensors(architecture: str, hp: Hyperparameters, tensors: dict[str, GGUFTensor], *,
                  where: str = "the GGUF file") -> None:
    """CheckpointError naming them when tensors that `architecture` needs are missing, unexpected or of another
    shape than the metadata gives (architectures expected_tensors knows), or when a tensor's row length is no
    whole number of its type's blocks."""
    import gguf  # an optional dependency (quantkit[gguf])

    for name, t in tensors.items():
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.type]][0]
        if not t.shape or any(d < 1 for d in t.shape) or t.shape[0] % block:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(t.shape)}, no whole number of {t.type} "
                                  f"blocks of {block}; the file is corrupt: re-create it")
    expected = expected_tensors(architecture, hp)
    if expected is None:
        return
    need, optional = expected
    missing = [n for n in need if n not in tensors]
    unexpected = [n for n in tensors if n not in need and n not in optional]
    if missing or unexpected:
        parts = ([f"missing {first_names(missing, 3)}"] if missing else []) + (
            [f"unexpected {first_names(unexpected, 3)}"] if unexpected else [])
        raise CheckpointError(f"{where}: the tensors do not make a {architecture} model of its metadata's "
                              f"{hp.blocks} blocks ({'; '.join(parts)}), so llama.cpp refuses the file: it was "
                              f"edited or written incompletely; re-create it from its source model")
    shapes = {"output.weight": need["token_embd.weight"]} | need
    wrong = [f"{n} {list(t.shape)} (metadata: {list(shapes[n])})" for n, t in tensors.items()
             if n in shapes and t.shape != shapes[n]]
    if wrong:
        raise CheckpointError(
            f"{where}: tensor shapes disagree with the metadata's sizes (embedding_length {hp.embedding}, "
            f"feed_forward_length {hp.feed_forward}, {hp.heads} heads and {hp.kv_heads} KV heads of {hp.head_dim}, "
            f"{hp.vocab} tokens): {'; '.join(wrong[:2])}; the file is corrupt or was edited: re-create it from its "
            f"source model")


def load_gguf_model(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> nn.Module:
    """A transformers causal LM from a GGUF file (any: quantkit's export or llama.cpp's own), read and checked
    first (read_gguf), its weights dequantized by transformers with the `gguf` package (fp32 unless dtype says
    otherwise). The model is the one llama.cpp runs: architecture `llama` is a Llama model whatever its name
    (llama.cpp runs Mistral files so, without a sliding window), heads of attention.key_length values.
    Records its GGUFOrigin on the model (gguf_origin). CheckpointError when transformers leaves a weight unread."""
    from transformers import AutoModelForCausalLM, GgufConfig  # import time: transformers loads only where it is used

    contents = read_gguf(path)
    path = contents.path
    types = {name: t.type for name, t in contents.tensors.items()}
    quantized = set()
    if types.get("token_embd.weight", "F32") not in FLOAT_TYPES:
        quantized.add("input")
    if types.get("output.weight", types.get("token_embd.weight", "F32")) not in FLOAT_TYPES:
        quantized.add("output")
    config = _transformers_config(contents)
    try:
        with _quiet_loading_report():  # what it would report is checked below
            model, info = AutoModelForCausalLM.from_pretrained(  # dequantized whether or not `kernels` is installed
                str(path.parent), gguf_file=path.name, config=config, dtype=dtype or torch.float32,
                quantization_config=GgufConfig(dequantize=True), output_loading_info=True)
    except (ValueError, KeyError, TypeError, RuntimeError, OSError) as e:
        raise CheckpointError(f"{path}: transformers could not load this GGUF file ({type(e).__name__}: "
                              f"{_one_line(e)})") from None
    found = nonfinite_tensors(model.named_parameters())
    if found:
        raise CheckpointError(f"{path}: {describe_nonfinite(found)}; the file is corrupt (it would evaluate to NaN or "
                              f"wrong outputs): re-create it from its source model")
    unread = sorted(info["missing_keys"]) + sorted(k for k, *_ in info["mismatched_keys"])
    if unread or info["unexpected_keys"]:
        problems = ([f"no weights for {first_names(unread, 3)}"] if unread else []) + (
            [f"tensors it cannot place: {first_names(sorted(info['unexpected_keys']), 3)}"]
            if info["unexpected_keys"] else [])
        raise CheckpointError(f"{path}: transformers' {type(model).__name__} of this file's metadata does not match "
                              f"its tensors ({'; '.join(problems)}); the file is corrupt, or of a layout transformers "
                              f"does not read")
    setattr(model, GGUF_ORIGIN_ATTRIBUTE, GGUFOrigin(str(path), frozenset(quantized),
                                                     sum(t not in FLOAT_TYPES for t in types.values())))
    stored = {"F16": torch.float16, "BF16": torch.bfloat16}.get(types.get("token_embd.weight"), torch.float32)
    setattr(model, SOURCE_DTYPE_ATTRIBUTE, stored)  # the dtype its float embedding was rounded to
    model.name_or_path = str(path)
    return model.to(resolve_device(device)).eval()


def _transformers_config(contents: GGUFContents):
    """transformers' config of the file, as transformers' GGUF reader maps the metadata, with llama.cpp's
    reading where they differ: architecture llama stays Llama (transformers makes a file named "mistral" a
    Mistral model with a sliding window the file does not have), and the head size is attention.key_length
    (transformers takes llama's from the rotary dimension and leaves qwen2 / qwen3 at their config defaults)."""
    # import time: transformers loads only where it is used
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    path = contents.path
    try:
        parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    except (ValueError, KeyError, TypeError, IndexError) as e:
        supported = ", ".join(sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES))
        raise CheckpointError(f"{path}: transformers cannot read this GGUF file ({_one_line(e)}); quantkit reads the "
                              f"architectures transformers' GGUF reader knows: {supported}") from None
    if contents.architecture in ("llama", "qwen2", "qwen3"):
        parsed["model_type"] = contents.architecture
        parsed["head_dim"] = contents.hyperparameters.head_dim
        parsed.pop("sliding_window", None)
    parsed.pop("_model_name_or_path", None)
    with config_errors(str(path)):
        return AutoConfig.for_model(**parsed)


def gguf_vocabulary_mismatch(fields: dict, tokenizer) -> str | None:
    """How a GGUF file's own vocabulary (`fields`: its metadata; tokenizer.ggml.tokens by id, and its BPE merges)
    differs from `tokenizer`'s (a transformers tokenizer); None when every id the tokenizer has is the file's
    token of that id (the file may pad its list beyond) and the merges agree."""
    tokens = fields["tokenizer.ggml.tokens"]
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    differ = sum(tokens[i] != t if i < len(tokens) else True for i, t in by_id.items())
    if differ:
        return f"{differ} of the baseline tokenizer's {len(by_id)} token ids name other tokens in the file"
    merges = fields.get("tokenizer.ggml.merges")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if merges is not None and backend is not None:
        model = json.loads(backend.to_str()).get("model", {})
        if model.get("type") == "BPE":
            theirs = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
            if theirs != merges:
                return f"its {len(merges)} BPE merges differ from the baseline tokenizer's {len(theirs)}"
    return None


def check_gguf_tokenizer(path: str | os.PathLike, tokenizer, baseline: str) -> str:
    """Which tokenizer an evaluation of the GGUF file uses, in words for the log: `tokenizer` (the baseline's),
    which must be the file's own when it carries one (gguf_vocabulary_mismatch); EvaluationError when it is not
    (the file's ids mean other tokens: llama.cpp would read the text with its own vocabulary)."""
    fields = read_gguf(path).fields
    if "tokenizer.ggml.tokens" not in fields:
        return f"the baseline's tokenizer ({baseline}); {path} carries no vocabulary of its own"
    problem = gguf_vocabulary_mismatch(fields, tokenizer)
    if problem:
        raise EvaluationError(f"{path} carries its own vocabulary, which is not the baseline's ({problem}): the "
                              f"evaluation would feed it ids that mean other tokens to it; give the baseline the file "
                              f"was made from, or re-create the file from it")
    return f"the baseline's tokenizer ({baseline}), the same vocabulary as {path}'s own"


def load_gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer a GGUF file carries (transformers' reading of its tokenizer.ggml.* metadata), the file
    checked first (read_gguf)."""
    from transformers import AutoTokenizer  # import time: transformers loads only where it is used

    path = read_gguf(path).path
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 (transformers' GGUF tokenizer conversion raises many kinds)
        raise CheckpointError(f"{path}: transformers could not build a tokenizer from the file's vocabulary "
                              f"({type(e).__name__}: {_one_line(e)})") from None
