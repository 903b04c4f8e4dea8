"""Which of a model's weights quantize leaves in full precision, by kind, and which it cannot reach.

``weight_census`` counts every weight (tied tensors once) as quantized (a quantized layer's) or float by
kind: embeddings, lm_head, routers (MoE), norms and biases (1-D), float linears (ignored by the recipe),
other. ``unquantizable_weights`` names the matrices a recipe's targets look as if they meant but that
quantkit would leave float without being told: 2-D+ parameters of modules that are not nn.Linear,
nn.Embedding, the LM head or a router (e.g. fused 3-D expert weights of a layout quantkit does not know).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from ..modules.moe import router_names
from ..modules.quant_experts import QuantExperts
from ..modules.quantized_layer import QuantizedLayer, is_quantized_layer
from ..modules.targets import matches

#: matrices smaller than this many weights are never reported (e.g. a learned 2-D position bias)
LARGE_MATRIX = 4096
KINDS = ("embeddings", "lm_head", "routers", "norms and biases", "float linears", "other")


@dataclass
class WeightCensus:
    """Weights (element counts) quantized and left float per kind; `float_names` lists module names per kind."""

    quantized: int = 0
    float_by_kind: dict[str, int] = field(default_factory=dict)
    float_names: dict[str, list[str]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.quantized + sum(self.float_by_kind.values())

    def share(self, n: int) -> float:
        return 100.0 * n / self.total if self.total else 0.0

    def tied_to_head(self) -> "WeightCensus":
        """The census of a file whose token embedding is the quantized output head (GGUF tie_output): the
        float embedding is not written, the head's quantized weights stand for both."""
        by_kind = {k: n for k, n in self.float_by_kind.items() if k != "embeddings"}
        names = {k: v for k, v in self.float_names.items() if k != "embeddings"}
        return WeightCensus(self.quantized, by_kind, names)

    def lines(self) -> list[str]:
        """'weights quantized: 93.8% (...)' and one 'left float: ...' line, kinds in KINDS order."""
        out = [f"{self.share(self.quantized):.1f}% of {self.total / 1e6:.2f}M weights quantized"]
        parts = []
        for kind in KINDS:
            n = self.float_by_kind.get(kind, 0)
            if n:
                names = self.float_names.get(kind, [])
                shown = f" ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" if kind in (
                    "float linears", "other") else ""
                parts.append(f"{kind} {self.share(n):.1f}%{shown}")
        out.append("left float: " + ("; ".join(parts) if parts else "nothing"))
        return out


def _owned_parameters(model: nn.Module):
    """(module name, module, parameter-or-buffer name, tensor) of every weight, tied tensors once."""
    seen = set()
    for mname, module in model.named_modules():
        tensors = list(module.named_parameters(recurse=False))
        if is_quantized_layer(module):  # the tensor that holds the weight itself, and the bias
            packed = module.PACKED_WEIGHT
            tensors = [(packed, getattr(module, packed))] + ([("bias", module.bias)] if module.bias is not None else [])
        for pname, t in tensors:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            yield mname, module, pname, t


def weight_census(model: nn.Module) -> WeightCensus:
    census = WeightCensus()
    routers = set(router_names(model))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for mname, module, pname, t in _owned_parameters(model):
        if is_quantized_layer(module) and pname == module.PACKED_WEIGHT:
            census.quantized += module.in_features * module.out_features
            continue
        n = t.numel()
        if module is head:
            kind = "lm_head"
        elif isinstance(module, nn.Embedding):
            kind = "embeddings"
        elif mname in routers:
            kind = "routers"
        elif t.dim() <= 1:
            kind = "norms and biases"
        elif isinstance(module, nn.Linear):
            kind = "float linears"
        else:
            kind = "other"
        census.float_by_kind[kind] = census.float_by_kind.get(kind, 0) + n
        names = census.float_names.setdefault(kind, [])
        if mname not in names:
            names.append(mname)
    return census


def unquantizable_weights(model: nn.Module, ignore: Iterable[str]) -> list[str]:
    """'name [shape]' of each large 2-D+ parameter quantkit cannot quantize (its module is no nn.Linear,
    embedding, LM head or router) whose module no `ignore` pattern matches."""
    ignore = list(ignore)
    routers = set(router_names(model))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = []
    for mname, module, pname, t in _owned_parameters(model):
        if (t.dim() < 2 or t.numel() < LARGE_MATRIX or module is head or mname in routers
                or isinstance(module, (nn.Linear, nn.Embedding, QuantizedLayer, QuantExperts))):
            continue
        full = f"{mname}.{pname}" if mname else pname
        if any(matches(mname, module, p) or matches(full, module, p) for p in ignore):
            continue
        found.append(f"{full} {list(t.shape)}")
    return found
