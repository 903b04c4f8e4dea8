"""Roofline model of one prefill and one decode step of a Llama-family decoder.

Pure functions over numbers: a ``ModelShape`` (read from a HF config), a ``RooflineScheme`` (how
weights and the KV cache are stored) and a ``DeviceSpec`` (bandwidth and compute peak) give the
bytes moved, the flops done and the predicted time max(bytes / bandwidth, flops / peak).

Why quantization helps decode far more than prefill: a decode step at batch B does ~2B flops per
weight it reads, an arithmetic intensity of ~2B / (bytes per weight) flop/byte, far below a GPU's
ridge point (~200 flop/byte on an H200), so its time is bytes / bandwidth and 4-bit weights cut it
by up to ~3.9x. A prefill of P tokens does ~2P flops per weight: above the ridge for P in the
hundreds, so its time is flops / peak, which weight-only quantization does not change.

What is counted (a lower bound on traffic; norms, rotary and elementwise ops are left out):
- weights: every targeted linear read once per forward, packed values + scales (+ zero points), each by its
  own scheme (RooflineScheme.layers: a checkpoint whose linears took several, e.g. groups of 64 on the
  576-wide inputs of SmolLM2 and 128 on the others, or left some float);
  mixture-of-experts models: the dense linears, the float routers, and only the experts the forward's
  tokens reach (k per layer for one token; E * (1 - (1 - k/E)^T) expected distinct experts for T
  tokens under uniform routing, so a batch-32 decode of a 128-expert top-8 model reads ~112 of them);
- lm_head: read once per forward (quantized only when ``quantize_lm_head``); logits for the last
  position only, as generation does;
- embeddings: one row per token;
- activations: each linear reads its input and writes its output once;
- kv_write: the new tokens' K and V; kv_read: K and V of all attended positions, once per layer
  (a fused attention kernel).
FLOPs: 2 per multiply-add in the linears, the lm_head and attention (QK^T and PV; causal prefill
counts only the lower triangle).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from ..core import dtypes
from ..core.errors import CheckpointError
from ..core.scheme import QuantScheme
from ..formats.compressed_tensors import parse_quantization_config
from ..modules.moe import moe_config_problem
from .hardware import DeviceSpec



@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-family decoder (GQA attention, SwiGLU MLP), or of a mixture-of-experts
    one: `experts` > 0 SwiGLU experts of width `expert_intermediate` per layer, `experts_per_token` (k) of
    them run per token, plus a shared expert of width `shared_intermediate` (0: none) and a router
    (E x hidden, float); the dense MLP (`intermediate`) is then absent. Every layer is taken as a MoE
    layer (Qwen3-MoE's mlp_only_layers / decoder_sparse_step are not modelled)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    max_context: int | None = None
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0

    def __post_init__(self):
        for name in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name} must be positive, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """From a transformers config object, a config dict, or a path to a model folder / config.json."""
        if isinstance(config, (str, Path)):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            if not path.exists():
                raise FileNotFoundError(f"no config.json at {path}")
            config = json.loads(path.read_text())
        d = config if isinstance(config, Mapping) else config.to_dict()
        if "text_config" in d and "hidden_size" not in d:
            d = d["text_config"]
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if d.get(k) is None]
        if missing:
            raise ValueError(
                f"config lacks {missing}: the roofline models Llama-family decoders "
                "(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size)"
            )
        problem = moe_config_problem(d)
        if problem:
            raise CheckpointError(f"the model's config: {problem}")
        heads = int(d["num_attention_heads"])
        experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
        moe = {}
        if experts:
            moe = dict(experts=experts, experts_per_token=int(d.get("num_experts_per_tok") or 1),
                       expert_intermediate=int(d.get("moe_intermediate_size") or d["intermediate_size"]),
                       shared_intermediate=int(d.get("shared_expert_intermediate_size") or 0))
        return cls(
            hidden=int(d["hidden_size"]),
            intermediate=int(d["intermediate_size"]),
            layers=int(d["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            vocab=int(d["vocab_size"]),
            tied_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_context=d.get("max_position_embeddings"),
            **moe,
        )

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, in_features, out_features) of the linears of one decoder layer every token runs
        through (MoE: attention and the shared expert; the routed experts are `expert_linears`)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = [("q_proj", self.hidden, q), ("k_proj", self.hidden, kv), ("v_proj", self.hidden, kv),
                     ("o_proj", q, self.hidden)]
        width = self.shared_intermediate if self.is_moe else self.intermediate
        prefix = "shared_expert." if self.is_moe else ""
        mlp = [(f"{prefix}gate_proj", self.hidden, width), (f"{prefix}up_proj", self.hidden, width),
               (f"{prefix}down_proj", width, self.hidden)] if width else []
        return attention + mlp

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def expert_linears(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of one routed expert (empty for a dense model)."""
        if not self.is_moe:
            return []
        i = self.expert_intermediate
        return [("gate_proj", self.hidden, i), ("up_proj", self.hidden, i), ("down_proj", i, self.hidden)]

    def experts_read(self, tokens: int) -> float:
        """Expected distinct experts per layer that `tokens` tokens reach: k for one token, else
        E * (1 - (1 - k/E)^tokens) (each token's k experts drawn uniformly; real routers are skewed, so
        fewer); 0 for a dense model."""
        if not self.is_moe:
            return 0.0
        if tokens <= 1:
            return float(self.experts_per_token)
        return self.experts * (1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens)

    @property
    def expert_params(self) -> int:
        """Weights of one routed expert."""
        return sum(i * o for _, i, o in self.expert_linears())

    @property
    def linear_params(self) -> int:
        """Weights in the decoder layers' linears (all layers; MoE: every expert)."""
        return self.layers * (sum(i * o for _, i, o in self.linears()) + self.experts * self.expert_params)

    @property
    def active_linear_params(self) -> int:
        """Weights of the linears one token runs through (MoE: k routed experts per layer)."""
        return self.layers * (sum(i * o for _, i, o in self.linears()) + self.experts_per_token * self.expert_params)

    @property
    def params(self) -> int:
        """All parameters: linears, embeddings, lm_head (unless tied), RMSNorm weights, routers."""
        emb = self.vocab * self.hidden
        routers = self.layers * (self.experts + (1 if self.shared_intermediate else 0)) * self.hidden
        return (self.linear_params + emb * (1 if self.tied_embeddings else 2) + (2 * self.layers + 1) * self.hidden
                + routers)

    @property
    def kv_values_per_token(self) -> int:
        """K and V values stored per token, all layers: 2 * layers * kv_heads * head_dim."""
        return 2 * self.layers * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class RooflineScheme:
    """How the model is stored, as far as bytes are concerned.

    weight_bits: 16 (or 32) for float weights, else the integer bits of the quantized linears.
    group_size: scale group along the input dim; None or -1 for one scale per output channel.
    scale_bytes: bytes per scale (the model dtype); zero points (asymmetric) take weight_bits each.
    dtype_bytes: bytes of activations, float weights, embeddings and an unquantized lm_head.
    kv_bytes: bytes per stored K/V value (2 for bf16, 1 for FP8).
    layers: the linears stored otherwise, as (kind, weight_bits, group_size, symmetric, share): `share` of the
      linears of that kind (ModelShape's names: "q_proj", "shared_expert.gate_proj", "expert.down_proj",
      "lm_head"), over all layers and experts, are stored so (weight_bits 16: left float); the rest of that kind
      take the fields above. Empty: every linear takes them (a recipe whose group size divides every width).
    """

    name: str = "bf16"
    weight_bits: int = 16
    group_size: int | None = None
    symmetric: bool = True
    scale_bytes: int = 2
    dtype_bytes: int = 2
    kv_bytes: int = 2
    quantize_lm_head: bool = False
    layers: tuple[tuple[str, int, int | None, bool, float], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(tuple(entry) for entry in self.layers))  # from JSON: lists
        if self.weight_bits not in (2, 3, 4, 8, 16, 32):
            raise ValueError(f"weight_bits must be one of 2, 3, 4, 8, 16, 32; got {self.weight_bits}")
        if self.group_size is not None and self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be positive, -1 or None; got {self.group_size}")
        if self.kv_bytes not in (1, 2, 4):
            raise ValueError(f"kv_bytes must be 1, 2 or 4; got {self.kv_bytes}")

    @property
    def quantized(self) -> bool:
        return self.weight_bits < 8 * self.dtype_bytes

    def of_kind(self, kind: str) -> list[tuple["RooflineScheme", float]]:
        """(scheme, share) of the linears of `kind`: the shares sum to 1."""
        own = [(replace(self, weight_bits=bits, group_size=group, symmetric=symmetric, layers=()), share)
               for k, bits, group, symmetric, share in self.layers if k == kind]
        rest = 1.0 - sum(share for _, share in own)
        return own + ([(replace(self, layers=()), rest)] if rest > 1e-9 else [])

    def describe(self) -> str:
        """The weights as stored, in words: "int4 g128 sym" or, with `layers`, each kind stored otherwise."""
        def words(bits, group, symmetric) -> str:
            if bits >= 8 * self.dtype_bytes:
                return "float"
            return f"int{bits} " + (f"g{group}" if group not in (None, -1) else "per channel") + (
                " sym" if symmetric else " asym")

        main = words(self.weight_bits, self.group_size, self.symmetric)
        if not self.layers:
            return main
        kinds: dict[str, list[str]] = {}  # what they are stored as -> the kinds stored so
        for kind, bits, group, symmetric, share in self.layers:
            stored = words(bits, group, symmetric) + ("" if share > 1 - 1e-9 else f" ({share:.0%} of them)")
            kinds.setdefault(stored, []).append(kind)
        return f"{main}, except " + "; ".join(f"{', '.join(k)}: {stored}" for stored, k in kinds.items())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "RooflineScheme":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def scheme_from_weight_args(
    weights: Any | None, kv_cache: Any | None = None, *, name: str | None = None, dtype_bytes: int = 2
) -> RooflineScheme:
    """From weight / KV-cache quantization args: a mapping (compressed-tensors JSON) or an object
    with ``num_bits``, ``type``, ``symmetric``, ``strategy``, ``group_size`` (quantkit QuantScheme)."""

    def get(obj, key, default=None):
        if obj is None:
            return default
        if isinstance(obj, Mapping):
            return obj.get(key, default)
        value = getattr(obj, key, default)
        return getattr(value, "value", value)  # enums

    kv_bytes = dtype_bytes
    if kv_cache is not None:
        kv_bytes = max(1, int(get(kv_cache, "num_bits", 8)) // 8)
    if weights is None:
        bits, group, symmetric = 8 * dtype_bytes, None, True
    else:
        if str(get(weights, "type", "int")).lower() != "int":
            raise ValueError(f"the roofline models integer weight quantization; got type {get(weights, 'type')!r}")
        bits = int(get(weights, "num_bits"))
        strategy = str(get(weights, "strategy", "channel")).lower()
        group = get(weights, "group_size") if strategy == "group" else None
        symmetric = bool(get(weights, "symmetric", True))
    if name is None:
        name = "bf16" if weights is None else f"w{bits}" + (f"g{group}" if group else "")
        if kv_cache is not None:
            name += f"+kv{8 * kv_bytes}"
    return RooflineScheme(
        name=name, weight_bits=bits, group_size=group, symmetric=symmetric,
        scale_bytes=dtype_bytes, dtype_bytes=dtype_bytes, kv_bytes=kv_bytes,
    )


def scheme_from_quantization_config(config: Any, *, name: str | None = None) -> RooflineScheme:
    """From a checkpoint's config (dict, transformers config or folder): its compressed-tensors
    ``quantization_config`` (config_groups' ``weights`` and ``kv_cache_scheme``) and dtype."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    d = config if isinstance(config, Mapping) else config.to_dict()
    dtype_bytes = dtypes.dtype_bytes(d.get("torch_dtype") or d.get("dtype") or "bfloat16")
    if d.get("quantization_config") is None:
        return scheme_from_weight_args(None, None, name=name, dtype_bytes=dtype_bytes)
    qc = parse_quantization_config(d["quantization_config"], "quantization_config")
    weight_schemes = list(dict.fromkeys(scheme for _, scheme in qc.groups))
    if not weight_schemes:
        return scheme_from_weight_args(None, qc.kv_cache, name=name, dtype_bytes=dtype_bytes)
    try:
        shape = ModelShape.from_config(d)
    except ValueError:
        if len(weight_schemes) > 1:
            raise
        scheme = scheme_from_weight_args(weight_schemes[0], qc.kv_cache, name=name, dtype_bytes=dtype_bytes)
        return replace(scheme, quantize_lm_head="lm_head" not in qc.ignore)
    return _stored_scheme(qc, shape, name=name, dtype_bytes=dtype_bytes)


#: Mixtral's expert projections, by ModelShape's names
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_FLOAT = "float"


def linear_kind(path: str) -> str:
    """The kind of linear a module path names, as ModelShape's linears are named: "q_proj", ...,
    "shared_expert.gate_proj", "expert.down_proj" (Mixtral's w1 / w3 / w2 too), "lm_head"."""
    parts = path.split(".")
    leaf = parts[-1]
    if "experts" in parts[:-1]:
        return "expert." + _EXPERT_NAMES.get(leaf, leaf)
    return f"shared_expert.{leaf}" if "shared_expert" in parts[:-1] else leaf


def _stored_scheme(qc, shape: ModelShape, *, name: str | None, dtype_bytes: int) -> RooflineScheme:
    """The scheme of a checkpoint's config: the weight scheme of the most weights as the main one, and in
    `layers` the share of each kind of linear stored otherwise (another group's scheme, or float under
    `ignore`). A group targets "Linear" (every linear no other group names and `ignore` does not list) or
    names its linears (quantkit writes one group per scheme, each naming its layers)."""
    sizes = {kind: (i, o, shape.layers) for kind, i, o in shape.linears()}
    sizes |= {"expert." + kind: (i, o, shape.layers * shape.experts) for kind, i, o in shape.expert_linears()}
    sizes["lm_head"] = (shape.hidden, shape.vocab, 1)
    counts: dict[tuple[str, Any], int] = {}
    every = None  # the scheme of a group targeting every linear
    for targets, scheme in qc.groups:
        for target in targets:
            kind = linear_kind(target)
            if target == "Linear":
                every = scheme
            elif target.startswith("re:") or kind not in sizes:
                raise CheckpointError(f"the roofline sums each linear by its own scheme, and needs each config group "
                                      f"to target Linear or name its linears of {', '.join(sizes)}; this "
                                      f"checkpoint's group target {target!r} does neither")
            else:
                counts[kind, scheme] = counts.get((kind, scheme), 0) + 1
    for ignored in qc.ignore:
        kind = linear_kind(ignored)
        if kind in sizes:  # routers are no linear kind: ModelShape counts them float anyway
            counts[kind, _FLOAT] = counts.get((kind, _FLOAT), 0) + 1
    for kind, (_, _, total) in sizes.items():  # what no group names and ignore does not list
        rest = total - sum(n for (k, _), n in counts.items() if k == kind)
        if rest > 0:
            key = every if every is not None else _FLOAT
            counts[kind, key] = counts.get((kind, key), 0) + rest
    weights: dict[Any, float] = {}
    for (kind, scheme), n in counts.items():
        if scheme != _FLOAT and kind != "lm_head":
            weights[scheme] = weights.get(scheme, 0.0) + n * sizes[kind][0] * sizes[kind][1]
    head = next((s for (k, s) in counts if k == "lm_head" and s != _FLOAT), None)
    main = max(weights, key=weights.get) if weights else head
    layers = []
    for (kind, scheme), n in counts.items():
        if scheme == main:
            continue
        if scheme == _FLOAT:
            if kind != "lm_head":  # a float head is quantize_lm_head False
                layers.append((kind, 8 * dtype_bytes, None, True, n / sizes[kind][2]))
        else:
            group = scheme.group_size if scheme.strategy == "group" else None
            layers.append((kind, scheme.num_bits, group, scheme.symmetric, n / sizes[kind][2]))
    scheme = scheme_from_weight_args(main, qc.kv_cache, name=name, dtype_bytes=dtype_bytes)
    return replace(scheme, quantize_lm_head=head is not None, layers=tuple(layers))


def scheme_from_recipe(recipe: Any, *, name: str | None = None, dtype_bytes: int = 2) -> RooflineScheme:
    """From a ``quantkit.quantization.recipe.Recipe`` (``.weights`` and ``.kv_cache`` QuantSchemes)."""
    return scheme_from_weight_args(
        getattr(recipe, "weights", None), getattr(recipe, "kv_cache", None), name=name, dtype_bytes=dtype_bytes
    )


# The schemes the advisor compares: float, W8 per channel, W4 g128, each with a bf16 or FP8 KV cache.
def standard_schemes(dtype_bytes: int = 2) -> list[RooflineScheme]:
    float_name = {2: "fp16", 4: "fp32"}[dtype_bytes]
    base = [
        RooflineScheme(float_name, 8 * dtype_bytes, None, True, dtype_bytes, dtype_bytes, dtype_bytes),
        RooflineScheme("w8", 8, None, True, dtype_bytes, dtype_bytes, dtype_bytes),
        RooflineScheme("w4g128", 4, 128, True, dtype_bytes, dtype_bytes, dtype_bytes),
    ]
    return [s for b in base for s in (b, replace(b, name=b.name + "+kv8", kv_bytes=1))]


def fitted_to(scheme: RooflineScheme, shape: ModelShape, indivisible: str = "smaller-group") -> RooflineScheme:
    """`scheme` as a recipe of it quantizes `shape`'s linears: each kind whose width the group size does not
    divide gets what the `indivisible` rule gives it (quantkit.core.scheme.QuantScheme.fitted; SmolLM2's 576-wide
    inputs take groups of 64 under a group-128 recipe), recorded in `layers`."""
    if not scheme.quantized or scheme.group_size in (None, -1) or scheme.layers:
        return scheme
    asked = QuantScheme(num_bits=scheme.weight_bits, symmetric=scheme.symmetric, strategy="group",
                        group_size=scheme.group_size)
    kinds = list(shape.linears()) + [("expert." + k, i, o) for k, i, o in shape.expert_linears()]
    if scheme.quantize_lm_head:
        kinds.append(("lm_head", shape.hidden, shape.vocab))
    layers = []
    for kind, in_features, _ in kinds:
        got = asked.fitted(in_features, indivisible)
        if got != asked:
            layers.append((kind, got.num_bits, got.group_size if got.strategy == "group" else None, got.symmetric, 1.0))
    return replace(scheme, layers=tuple(layers))


def linear_weight_bytes(in_features: int, out_features: int, scheme: RooflineScheme) -> float:
    """Bytes of one linear's weight [out, in] as stored: values, scales and zero points."""
    if not scheme.quantized:
        return in_features * out_features * scheme.weight_bits / 8
    groups = 1 if scheme.group_size in (None, -1) else math.ceil(in_features / scheme.group_size)
    values = out_features * in_features * scheme.weight_bits / 8
    scales = out_features * groups * scheme.scale_bytes
    zeros = 0 if scheme.symmetric else out_features * groups * scheme.weight_bits / 8
    return values + scales + zeros


def moe_roofline_note(shape: ModelShape) -> str:
    """One line saying which expert weights the roofline counts for a MoE model."""
    per_batch = ", ".join(f"{b}: {shape.experts_read(b):.1f}" for b in (1, 4, 16, 64))
    return (f"mixture of experts ({shape.experts} experts, top-{shape.experts_per_token}): the roofline counts the "
            f"experts a step's tokens reach, not all of them: per layer, expected distinct experts at batch "
            f"{per_batch} (uniform routing; prefill of P tokens: the same for B*P tokens)")


def kind_weight_bytes(kind: str, in_features: int, out_features: int, scheme: RooflineScheme) -> float:
    """Mean bytes of one linear of `kind` ([out, in]) under `scheme`, each share by its own scheme."""
    return sum(share * linear_weight_bytes(in_features, out_features, s) for s, share in scheme.of_kind(kind))


def decoder_weight_bytes(shape: ModelShape, scheme: RooflineScheme, experts: float | None = None) -> float:
    """Bytes of the decoder-layer linears a forward streams: all dense ones, plus `experts` routed experts
    per layer (default: every expert; a decode step reads shape.experts_read(batch)) and the routers
    (float, E x hidden per layer). Each linear counts by its own scheme (RooflineScheme.layers)."""
    dense = sum(kind_weight_bytes(kind, i, o, scheme) for kind, i, o in shape.linears())
    if shape.is_moe:
        n = shape.experts if experts is None else experts
        dense += n * sum(kind_weight_bytes("expert." + kind, i, o, scheme) for kind, i, o in shape.expert_linears())
        dense += shape.experts * shape.hidden * scheme.dtype_bytes
    return shape.layers * dense


def lm_head_bytes(shape: ModelShape, scheme: RooflineScheme) -> float:
    if scheme.quantize_lm_head:
        return kind_weight_bytes("lm_head", shape.hidden, shape.vocab, scheme)
    return shape.hidden * shape.vocab * scheme.dtype_bytes


def weight_memory_bytes(shape: ModelShape, scheme: RooflineScheme) -> float:
    """Resident bytes of the model's parameters (linears, embeddings, lm_head unless tied, norms)."""
    embeddings = shape.vocab * shape.hidden * scheme.dtype_bytes
    head = 0 if shape.tied_embeddings and not scheme.quantize_lm_head else lm_head_bytes(shape, scheme)
    norms = (2 * shape.layers + 1) * shape.hidden * scheme.dtype_bytes
    return decoder_weight_bytes(shape, scheme) + embeddings + head + norms


def kv_cache_bytes(shape: ModelShape, scheme: RooflineScheme, tokens: int, batch: int = 1) -> float:
    """Bytes of a KV cache holding ``tokens`` positions for each of ``batch`` sequences."""
    return batch * tokens * shape.kv_values_per_token * scheme.kv_bytes


@dataclass
class Cost:
    """Bytes moved and flops done by one forward, broken down by where they come from."""

    bytes: dict[str, float] = field(default_factory=dict)
    flops: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, flop/byte."""
        return self.total_flops / self.total_bytes

    def to_dict(self) -> dict:
        return {"bytes": dict(self.bytes), "flops": dict(self.flops), "total_bytes": self.total_bytes,
                "total_flops": self.total_flops, "intensity": self.intensity}


def _linear_flops(shape: ModelShape, tokens: int) -> float:
    return 2.0 * tokens * shape.active_linear_params


def _activation_bytes(shape: ModelShape, scheme: RooflineScheme, tokens: int) -> float:
    per_layer = sum(i + o for _, i, o in shape.linears())
    per_layer += shape.experts_per_token * sum(i + o for _, i, o in shape.expert_linears())
    return tokens * shape.layers * per_layer * scheme.dtype_bytes


def prefill_cost(shape: ModelShape, scheme: RooflineScheme, prompt_len: int, batch: int = 1) -> Cost:
    """One forward over ``batch`` prompts of ``prompt_len`` tokens, writing their KV cache and
    producing the logits of the last position."""
    if prompt_len < 1 or batch < 1:
        raise ValueError(f"prompt_len and batch must be >= 1; got {prompt_len}, {batch}")
    tokens = batch * prompt_len
    kv = kv_cache_bytes(shape, scheme, prompt_len, batch)
    causal_pairs = prompt_len * (prompt_len + 1) / 2  # query-key pairs under the causal mask
    return Cost(
        bytes={
            "weights": decoder_weight_bytes(shape, scheme, shape.experts_read(tokens) if shape.is_moe else None),
            "lm_head": lm_head_bytes(shape, scheme),
            "embeddings": tokens * shape.hidden * scheme.dtype_bytes,
            "activations": _activation_bytes(shape, scheme, tokens) + batch * shape.vocab * scheme.dtype_bytes,
            "kv_write": kv,
            "kv_read": kv,
        },
        flops={
            "linear": _linear_flops(shape, tokens),
            "attention": 4.0 * batch * shape.layers * shape.heads * shape.head_dim * causal_pairs,
            "lm_head": 2.0 * batch * shape.hidden * shape.vocab,
        },
    )


def decode_cost(shape: ModelShape, scheme: RooflineScheme, context_len: int, batch: int = 1) -> Cost:
    """One decode step: ``batch`` new tokens, each attending to ``context_len`` cached positions
    plus itself. MoE: the weights read are the dense linears plus the experts the batch's tokens reach
    (k per layer for one token; shape.experts_read(batch) expected distinct ones for a batch)."""
    if context_len < 0 or batch < 1:
        raise ValueError(f"context_len must be >= 0 and batch >= 1; got {context_len}, {batch}")
    attended = context_len + 1
    return Cost(
        bytes={
            "weights": decoder_weight_bytes(shape, scheme, shape.experts_read(batch) if shape.is_moe else None),
            "lm_head": lm_head_bytes(shape, scheme),
            "embeddings": batch * shape.hidden * scheme.dtype_bytes,
            "activations": _activation_bytes(shape, scheme, batch) + batch * shape.vocab * scheme.dtype_bytes,
            "kv_write": kv_cache_bytes(shape, scheme, 1, batch),
            "kv_read": kv_cache_bytes(shape, scheme, attended, batch),
        },
        flops={
            "linear": _linear_flops(shape, batch),
            "attention": 4.0 * batch * shape.layers * shape.heads * shape.head_dim * attended,
            "lm_head": 2.0 * batch * shape.hidden * shape.vocab,
        },
    )


@dataclass(frozen=True)
class Prediction:
    """Roofline time of a Cost on a device: max(bytes / bandwidth, flops / peak)."""

    memory_s: float
    compute_s: float
    intensity: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"

    def to_dict(self) -> dict:
        return {"predicted_s": self.seconds, "memory_s": self.memory_s, "compute_s": self.compute_s,
                "bound": self.bound, "intensity": self.intensity}


def predict(cost: Cost, device: DeviceSpec) -> Prediction:
    return Prediction(
        memory_s=cost.total_bytes / device.memory_bandwidth,
        compute_s=cost.total_flops / device.peak_flops,
        intensity=cost.intensity,
    )
