"""quantkit's C++ decode loop on CPU: one call per decode step for Llama-family models.

On a CPU, a transformers decode step of a small model is thousands of small op calls from Python
(norms, rotary embeddings, cache updates, attention, residual adds; ~4,800 for SmolLM2-135M), and
they, not the bytes of the weights, set its time: the thesis that fewer weight bytes decode faster
cannot show through them. ``CpuDecoder`` runs the whole step in C++ (``quantkit/kernels/csrc/decode_step.cpp``,
``torch.classes.quantkit.CpuDecoder``) on the model's own tensors: quantized linears through
``quantkit::wna16_cpu_q8dot`` (their int8 activation rounding included), float linears through
``at::linear`` in their dtype. A float model and its quantized variants run the same loop, so they
differ only in their linears. A quantized linear joins the loop where the kernel chooser
(``kernels.backend_choice.paths_by_rows``) gives its prepared layout that kernel (``LOOP_PATH``) for the
loop's fp32 rows at every batch size (``loop_path_reason``); the loop passes it that path's operands.

    model = quantkit.load("ckpt")                      # or any supported float transformers model
    decoder = quantkit.CpuDecoder(model, max_len=2048)  # cache_dtype="auto": fp8 if the model has k/v scales
    ids = decoder.generate(input_ids, max_new_tokens=64)  # greedy: prefill in transformers, decode in C++
    ids = decoder.generate(left_padded_ids, 64, attention_mask=mask)  # rows of different lengths

Supported: LlamaForCausalLM, MistralForCausalLM (no sliding window), Qwen2ForCausalLM, Qwen3ForCausalLM
on CPU: RMSNorm, SiLU-gated MLP, grouped-query attention, rotary embeddings whose tables do not depend on
the sequence length (default, linear, llama3, yarn), tied or untied lm_head, biases. Anything else
(mixture-of-experts layers, sliding windows, GGUF K-quant linears, a layer the C++ kernel does not run)
raises ``UsageError`` naming it; the model itself still runs in transformers.

The KV cache (``cache_dtype``, ``CACHE_DTYPES``): "auto" is the model's dtype (bf16 for a bf16 model),
or fp8 when the model holds calibrated ``k_scale`` / ``v_scale`` (an FP8-KV checkpoint); "fp8" stores
float8_e4m3fn(x / scale) with those scales (per tensor or per kv head) as quantkit's FP8KVCache does,
and the prompt runs through transformers with that cache, so both see the same values; "int8" stores
round(x / s) with one scale s = amax / 127 per token and kv head. ``2 * layers * kv_heads * head_dim``
values per position and sequence (int8: and 8 bytes of scales per kv head), allocated in blocks of
``cache_block`` positions (default: 1024, or ``max_len`` rounded up to a multiple of 32 where that is
less) as the longest sequence grows: ``max_len`` is a limit; ``cache_bytes()`` says what is held. Long
blocks are faster: attention pays for each jump from one block to the next (decode_step.cpp has the figures).
Attention reads the cache in its stored type (quantkit/kernels/csrc/decode_attention_cpu.cpp). An fp8
cache of a checkpoint whose KV cache is Hadamard-rotated (quantkit.modules.kv_rotation) stores
fp8(k H / s), fp8(v H / s) with the rotated-basis scales, and the loop rotates q by H before attention
and the output back after it (``rotation``: "hadamard" or "none").

Numerics: the residual stream, norms, rotary embeddings and attention are fp32; a bf16 model's float
linears compute in bf16 as transformers' do. Against the model's own fp32 forward the logits agree to
fp32 rounding with an fp32 cache (tests/test_cpu_decoder.py).

Each sequence keeps its own length: ``prefill`` takes an ``attention_mask`` of left-padded prompts
(transformers' padding for generation) and each row decodes as it would alone.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.errors import UsageError
from ..kernels.backend_choice import paths_by_rows
from ..kernels.cpu_extension import ISA_NAMES, cpu_kernel_isa, load_cpu_kernels
from ..kernels.cpu_kernel_choice import Q8Dot
from ..modules.fused_linear import FusedPart
from ..modules.kv_rotation import check_rotation
from ..modules.kv_scales import cache_keyword, kv_rotation_of, read_kv_scales
from ..modules.quant_linear import QuantLinear
from .decode_loop import decode, eos_stop
from .sampling import SamplingConfig

#: the model types (config.model_type) the loop runs
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
#: cache dtypes -> the C++ KvDtype codes (quantkit/kernels/csrc/decode_attention_cpu.h); "auto" is resolved first
CACHE_DTYPES = {"fp32": 0, "bf16": 1, "fp16": 2, "fp8": 3, "int8": 4}
_MODEL_CACHE_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
#: bytes per stored value (int8 also stores an fp32 scale per token and kv head)
CACHE_VALUE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
CACHE_BLOCK = 1024  # positions per cache block by default (see the module docstring)
CACHE_BLOCK_MULTIPLE = 32  # two key tiles of the attention kernel (decode_attention_cpu.h)
#: rotary types whose cos / sin tables depend on the position only (not on the sequence length)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: what the C++ loop's quantized linears run (decode_step.cpp's run_linear: quantkit::wna16_cpu_q8dot on
#: x fp32 [B, K], B the batch, any number of rows); its float linears run at::linear
LOOP_PATH = Q8Dot
LOOP_ACTIVATION_DTYPE = torch.float32


def decoder_unavailable(model: nn.Module) -> str | None:
    """Why ``CpuDecoder(model)`` cannot run here (the C++ kernels did not build, or the model is not
    supported), or None."""
    kernels = load_cpu_kernels()
    return unsupported_reason(model) if kernels.available else kernels.reason


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``CpuDecoder`` cannot run ``model`` (one line), or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        return f"model type {model_type!r} is not one of {', '.join(ARCHITECTURES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the loop's MLP is SiLU-gated)"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):  # Qwen2/3 keep a window they do not use
        return f"sliding-window attention (sliding_window={window})"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") not in STATIC_ROPE_TYPES:
        return f"rotary type {getattr(rotary, 'rope_type', None)!r} (supported: {', '.join(STATIC_ROPE_TYPES)})"
    if next(model.parameters()).device.type != "cpu":
        return "the model is not on the CPU"
    for i, layer in enumerate(inner.layers):
        mlp, attn = getattr(layer, "mlp", None), getattr(layer, "self_attn", None)
        if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {i}'s MLP is not a gated MLP (mixture-of-experts layers are not supported)"
        if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"layer {i}'s attention has no q/k/v/o projections"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            reason = _linear_reason(getattr(attn if name[0] in "qkvo" else mlp, name))
            if reason:
                return f"layer {i} {name}: {reason}"
    return _linear_reason(model.get_output_embeddings())


def _linear_reason(module: nn.Module) -> str | None:
    if isinstance(module, FusedPart):
        module = module._group.fused
    if isinstance(module, QuantLinear):
        return loop_path_reason(module)
    if type(module) is nn.Linear:
        return None
    return f"{type(module).__name__} is neither nn.Linear nor a QuantLinear"


def loop_path_reason(linear: QuantLinear) -> str | None:
    """Why the C++ loop cannot run ``linear``: the path ``backend_choice`` chooses for its prepared layout
    and the loop's fp32 rows is not the loop's own (``LOOP_PATH``) at some number of rows; None if it is
    at every number."""
    runs = paths_by_rows(linear.in_features, linear.out_features, LOOP_ACTIVATION_DTYPE, linear.kernel_layout)
    others = [f"{path.name} at {rows}+ rows" for rows, path in runs if type(path) is not LOOP_PATH]
    if not others:
        return None
    return (f"a quantized linear prepared for {linear.kernel_layout!r}, not quantkit's C++ kernel "
            f"({LOOP_PATH.layout}): {', '.join(others)}")


def default_cache_block(max_len: int) -> int:
    """Positions per cache block for sequences of at most ``max_len`` positions: CACHE_BLOCK, or ``max_len``
    rounded up to a multiple of CACHE_BLOCK_MULTIPLE where that is less."""
    m = CACHE_BLOCK_MULTIPLE
    return min(CACHE_BLOCK, -(-max_len // m) * m)


def resolve_cache_dtype(model: nn.Module, cache_dtype: str) -> str:
    """The cache dtype ``CpuDecoder(model, cache_dtype=...)`` stores ("auto" resolved); UsageError for
    a name not in CACHE_DTYPES, or fp8 on a model without calibrated k/v scales for every layer."""
    if cache_dtype not in ("auto", *CACHE_DTYPES):
        raise UsageError(f"cache_dtype {cache_dtype!r}: choose one of auto, {', '.join(CACHE_DTYPES)}")
    scales, missing = read_kv_scales(model)
    if cache_dtype == "auto":
        if scales and not missing:
            return "fp8"
        return _MODEL_CACHE_DTYPES.get(next(model.parameters()).dtype, "fp32")
    if cache_dtype == "fp8" and (missing or not scales):
        raise UsageError("cache_dtype 'fp8' needs the checkpoint's calibrated k_scale / v_scale on every attention "
                         f"layer ({len(missing)} lack them): quantize with a kv-fp8 recipe, or choose bf16 or int8")
    return cache_dtype


class CpuDecoder:
    """Batch decode of a supported model in quantkit's C++ loop (see the module docstring).

    Holds the model's tensors (not copies, except the float q/k/v and gate/up weights, concatenated
    once) and its own KV cache (``cache_dtype``), up to ``max_len`` positions per sequence.
    ``lengths`` int64 [B]: the positions each sequence has cached."""

    def __init__(self, model: nn.Module, max_len: int | None = None, cache_dtype: str = "auto",
                 cache_block: int | None = None) -> None:
        reason = decoder_unavailable(model)
        if reason:
            raise UsageError(f"quantkit's CPU decoder cannot run this model: {reason}. Run it in transformers "
                             f"(model.generate) instead")
        config, inner = model.config, model.model
        self.model = model
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
            raise UsageError(f"max_len must be a positive number of positions, got {max_len!r}")
        self.max_len = int(config.max_position_embeddings if max_len is None else max_len)
        m = CACHE_BLOCK_MULTIPLE
        if cache_block is None:
            cache_block = default_cache_block(self.max_len)
        elif isinstance(cache_block, bool) or not isinstance(cache_block, int) or cache_block < m or cache_block % m:
            raise UsageError(f"cache_block must be a positive multiple of {m} positions, got {cache_block!r}")
        self.cache_block = cache_block
        self.cache_dtype = resolve_cache_dtype(model, cache_dtype)
        attn0 = inner.layers[0].self_attn
        head_dim = attn0.head_dim
        self.num_layers, self.kv_heads, self.head_dim = config.num_hidden_layers, config.num_key_value_heads, head_dim
        dims = [config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                head_dim, config.intermediate_size, self.max_len, CACHE_DTYPES[self.cache_dtype],
                ISA_NAMES.index(cpu_kernel_isa()), self.cache_block]
        eps = float(inner.norm.variance_epsilon)
        rotary = inner.rotary_emb
        with torch.inference_mode():
            embed = model.get_input_embeddings().weight
            self.vocab_size = embed.shape[0]
            self._native = torch.classes.quantkit.CpuDecoder(
                dims, [eps, float(attn0.scaling), float(rotary.attention_scaling)], embed, inner.norm.weight,
                rotary.inv_freq.float())
            # an fp8 cache applies the checkpoint's rotation of head_dim (its scales are of that basis)
            self.rotation = kv_rotation_of(model) if self.cache_dtype == "fp8" else "none"
            if self.rotation != "none":
                try:
                    check_rotation(self.rotation, head_dim)
                except Exception as e:
                    raise UsageError(str(e)) from None
                self._native.set_rotation(True)
            if self.cache_dtype == "fp8":
                self._set_kv_scales()
            for i, layer in enumerate(inner.layers):
                attn, mlp = layer.self_attn, layer.mlp
                self._add_group(i, "qkv", [attn.q_proj, attn.k_proj, attn.v_proj])
                self._add(i, "o", attn.o_proj)
                self._add_group(i, "gate_up", [mlp.gate_proj, mlp.up_proj])
                self._add(i, "down", mlp.down_proj)
                q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
                self._native.set_norms(i, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                       None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight)
            self._add(-1, "lm_head", model.get_output_embeddings())
        self.batch = 0
        self.lengths = torch.zeros(0, dtype=torch.int64)

    def _set_kv_scales(self) -> None:
        scales, missing = read_kv_scales(self.model, rotated=self.rotation != "none")
        if missing:
            raise UsageError(f"the checkpoint's KV cache is rotated but {len(missing)} attention layers lack the "
                             "rotated-basis k / v scales: load it with quantkit.load, or choose cache_dtype bf16")
        for i, (k, v) in scales.items():
            if k.numel() not in (1, self.kv_heads) or v.numel() not in (1, self.kv_heads):
                raise UsageError(f"layer {i}'s k_scale / v_scale have {k.numel()} / {v.numel()} entries: one per "
                                 f"tensor or one per kv head ({self.kv_heads})")
            self._native.set_kv_scales(i, k.expand(self.kv_heads).contiguous(), v.expand(self.kv_heads).contiguous())

    def _add(self, layer: int, slot: str, module: nn.Module) -> None:
        if isinstance(module, QuantLinear):  # LOOP_PATH's operands, as unsupported_reason has checked
            weight, scale, zero = LOOP_PATH.operands(module.prepared_tensors())
            self._native.add_linear(layer, slot, True, weight, scale, zero, module.bias)
        else:
            self._native.add_linear(layer, slot, False, module.weight, None, None, module.bias)

    def _add_group(self, layer: int, slot: str, parts: list[nn.Module]) -> None:
        """Projections that read one input: the fused QuantLinear where quantkit.load fused them, one
        concatenated float weight for float ones, else each part in order."""
        if all(isinstance(p, FusedPart) for p in parts) and len({id(p._group) for p in parts}) == 1 and [
                p.index for p in parts] == list(range(len(parts))) and len(parts[0]._group.sizes) == len(parts):
            self._add(layer, slot, parts[0]._group.fused)
        elif all(type(p) is nn.Linear for p in parts) and len({p.weight.dtype for p in parts}) == 1:
            bias = None if all(p.bias is None for p in parts) else torch.cat(
                [p.weight.new_zeros(p.out_features) if p.bias is None else p.bias for p in parts])
            self._native.add_linear(layer, slot, False, torch.cat([p.weight for p in parts]), None, None, bias)
        else:
            for p in parts:
                self._add(layer, slot, p._group.fused if isinstance(p, FusedPart) else p)

    def reset(self, batch: int) -> None:
        """An empty cache for ``batch`` sequences (its blocks freed)."""
        if batch < 1:
            raise UsageError(f"batch must be a positive number of sequences, got {batch}")
        self._native.reset(batch)
        self.batch, self.lengths = batch, torch.zeros(batch, dtype=torch.int64)

    def cache_bytes(self) -> int:
        """Bytes the decoder's KV cache holds (its blocks, int8 scales included)."""
        return int(self._native.cache_bytes())

    def truncate(self, length: int) -> None:
        """Forget every sequence's positions from ``length`` on (e.g. to decode again at one context)."""
        if self.batch == 0 or not 0 <= length <= int(self.lengths.min()):
            raise UsageError(f"cannot truncate to {length} positions: the sequences hold {self.lengths.tolist()}")
        self.lengths = torch.full((self.batch,), length, dtype=torch.int64)

    def load_cache(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                   lengths: torch.Tensor | None = None) -> None:
        """Fill the cache from per-layer keys / values [B, kv_heads, L, head_dim] (as transformers caches
        them, after rotary), one pair per layer; ``lengths`` int64 [B] (default: L each): sequence b
        holds the last lengths[b] of the L positions (a left-padded prompt's tokens) and decodes next
        at position lengths[b]."""
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise UsageError(f"load_cache got keys / values for {len(keys)} / {len(values)} layers; the model has "
                             f"{self.num_layers}")
        shape = tuple(keys[0].shape)
        if len(shape) != 4 or shape[0] < 1 or shape[1] != self.kv_heads or shape[3] != self.head_dim or any(
                tuple(t.shape) != shape for t in (*keys, *values)):
            raise UsageError(f"load_cache needs keys and values of one shape [batch, {self.kv_heads}, length, "
                             f"{self.head_dim}] in every layer, got {shape} (layer 0's keys)")
        lengths = torch.full((shape[0],), shape[2], dtype=torch.int64) if lengths is None else lengths.to(torch.int64)
        if int(lengths.max()) >= self.max_len:
            raise UsageError(f"{int(lengths.max())} cached positions leave no room in a decoder of max_len {self.max_len}")
        self.reset(shape[0])
        for i, (k, v) in enumerate(zip(keys, values)):
            self._native.set_cache(i, k, v, lengths)
        self.lengths = lengths.clone()

    def _check_tokens(self, ids: torch.Tensor, what: str) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dtype in (torch.bool, torch.uint8) or ids.is_floating_point() \
                or ids.is_complex():
            raise UsageError(f"{what} must be integer token ids (torch.int64), got "
                             f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise UsageError(f"{what} holds token id {bad}, outside the vocabulary (0 .. {self.vocab_size - 1})")

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids int64 [B, L] (L >= 1) -> logits fp32 [B, V] of the last position: the prompt runs
        through the model's own transformers forward (with an fp8 cache: quantkit's FP8KVCache, so it
        attends to the values the decoder stores), its keys and values are copied into the decoder's
        cache. attention_mask [B, L] of 0 / 1: left-padded rows (each row's tokens are its last columns)."""
        self._check_tokens(input_ids, "input_ids")
        if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
            raise UsageError(f"prefill needs a prompt of at least one token per sequence, [batch, length], got "
                             f"{tuple(input_ids.shape)}")
        kwargs = {}
        lengths = torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.int64)
        if attention_mask is not None:
            lengths = _left_padded_lengths(attention_mask, tuple(input_ids.shape))
            mask = attention_mask.to(torch.int64)
            kwargs = {"attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
        from transformers import DynamicCache  # import time: transformers loads only where it is used

        with torch.inference_mode():
            if self.cache_dtype == "fp8":
                # it imports transformers' cache classes: only for an fp8 cache
                from ..modules.kv_cache import fp8_cache_for

                cache = fp8_cache_for(self.model)
            else:
                cache = DynamicCache()
            out = self.model(input_ids, use_cache=True, logits_to_keep=1, **{cache_keyword(self.model): cache},
                             **kwargs)
            layers = [layer.dequantized() if self.cache_dtype == "fp8" else (layer.keys, layer.values)
                      for layer in cache.layers]
            self.load_cache([k for k, _ in layers], [v for _, v in layers], lengths)
        return out.logits[:, -1].float()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int64 [B] (one per sequence) -> logits fp32 [B, V]; the step's keys and values are
        cached at each sequence's next position."""
        if self.batch == 0:
            raise UsageError("the decoder holds no sequences: call prefill (or reset) first")
        self._check_tokens(tokens, "tokens")
        if tokens.numel() != self.batch:
            raise UsageError(f"step got {tokens.numel()} tokens for a cache of {self.batch} sequences")
        if int(self.lengths.max()) >= self.max_len:
            raise UsageError(f"the decoder's cache is full ({self.max_len} positions); make it with a larger max_len")
        with torch.inference_mode():
            logits = self._native.step(tokens.reshape(-1).to(torch.int64), self.lengths)
        self.lengths = self.lengths + 1
        return logits

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, sampling=None, *,
                 attention_mask: torch.Tensor | None = None, eos_token_id: int | list[int] | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """input_ids int64 [B, L] -> [B, L + n]: greedy by default, else as ``sampling`` says (a
        ``quantkit.runtime.sampling.SamplingConfig``; ``generator``: its random state). With ``eos_token_id``,
        a sequence ends at one of those tokens (later positions get the first) and generation ends when
        all have, so n <= max_new_tokens; without, n = max_new_tokens. attention_mask: as ``prefill``."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise UsageError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        return decode(self, input_ids, max_new_tokens, sampling or SamplingConfig(), generator=generator,
                      stop=eos_stop(eos) if eos else None, pad_token_id=eos[0] if eos else None,
                      attention_mask=attention_mask)


def _left_padded_lengths(mask: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """attention_mask [B, L] of 0 / 1 whose ones end each row -> tokens per row, int64 [B]; else UsageError."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != shape:
        raise UsageError(f"attention_mask must be a tensor of the prompt's shape {shape}, got "
                         f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    m = mask.to(torch.int64)
    if ((m != 0) & (m != 1)).any():
        raise UsageError("attention_mask must hold 0 (padding) and 1 (token) only")
    lengths = m.sum(1)
    suffix = torch.arange(shape[1]).unsqueeze(0) >= (shape[1] - lengths).unsqueeze(1)  # [B, L]: the last lengths[b]
    bad = ((m == 1) != suffix).any(1) | (lengths == 0)
    if bad.any():
        row = int(bad.nonzero()[0])
        raise UsageError(f"attention_mask row {row} is not left-padded with at least one token (its tokens must be "
                         "its last columns: tokenizer.padding_side = 'left')")
    return lengths
