"""Per-family adapters: where a model keeps its decoder blocks and how a block's linears are grouped.

The block-by-block runner walks decoder blocks through these small descriptions instead of tracing
the model: an adapter names the list of blocks and, inside a block, the *sub-layer steps* in the
order the block computes them. Each step is a group of linears fed by the same input (q/k/v read the
attention norm's output; gate/up read the MLP norm's output), with the module that produces that
input (for AWQ to fold its scales into) and optionally the sub-module whose output AWQ compares.

Supporting a new family whose blocks follow a known layout is one `register_adapter` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..core.errors import QuantizationError
from ..modules.moe import experts_modules


@dataclass(frozen=True)
class LinearGroup:
    """One sub-layer step: linears that read the same input, quantized together.

    linears: names relative to the block, in call order (e.g. "self_attn.q_proj").
    prev: the module whose output is the group's input (a norm or a linear; AWQ folds 1/s into it),
      or None when there is no such module to fold into.
    inspect: the sub-module whose output AWQ's scale search compares; None compares the outputs of the
      group's linears.
    inspect_in_block: the inspect module takes more than the group's input (an attention takes the mask
      and the rotary embeddings): its output is read from forwards through the block up to it, instead of
      calling it on the group's input alone (an MLP).
    separate: the linears do not share one input (MoE experts: each sees the tokens routed to it): their
      statistics are collected per parent module (an expert's gate and up share theirs), in one forward.
    input_of: the module whose input AWQ's scale search reads (None: the first linear's), e.g. the MoE
      block, whose input every expert's rows come from.
    also_scale: float modules that read the same input and stay unquantized (MoE routers): AWQ multiplies
      their weight columns by s too when it folds 1/s into `prev`, so they compute what they did.
    """

    linears: tuple[str, ...]
    prev: str | None = None
    inspect: str | None = None
    inspect_in_block: bool = False
    separate: bool = False
    input_of: str | None = None
    also_scale: tuple[str, ...] = ()


@dataclass(frozen=True)
class FamilyAdapter:
    """How the calibration runner walks one model family.

    model_types: `config.model_type` values this adapter handles.
    blocks: dotted path of the nn.ModuleList of decoder blocks in the *CausalLM model.
    groups: the sub-layer steps of one block, in the order the block computes them.
    """

    name: str
    model_types: tuple[str, ...]
    blocks: str
    groups: tuple[LinearGroup, ...]
    expand: Callable[[nn.Module], tuple[LinearGroup, ...]] | None = None

    def groups_for(self, block: nn.Module) -> tuple[LinearGroup, ...]:
        """The block's sub-layer steps: `groups`, then those `expand` derives from the block (MoE experts)."""
        return self.groups + (self.expand(block) if self.expand is not None else ())

    def blocks_of(self, model: nn.Module) -> nn.ModuleList:
        try:
            blocks = model.get_submodule(self.blocks)
        except AttributeError:
            raise QuantizationError(
                f"{type(model).__name__} has no module {self.blocks!r} although its model_type is handled by the "
                f"{self.name!r} adapter; pass the *ForCausalLM model (not the base model or a wrapper)"
            ) from None
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise QuantizationError(f"{type(model).__name__}.{self.blocks} is not a non-empty list of decoder blocks")
        return blocks

    def check_block(self, block: nn.Module, where: str) -> None:
        """Raise if a block lacks a module the adapter names (a layout this adapter does not know)."""
        for group in self.groups:
            for name in (*group.linears, group.prev, group.inspect):
                if name is None:
                    continue
                try:
                    block.get_submodule(name)
                except AttributeError:
                    raise QuantizationError(
                        f"{where} has no sub-module {name!r} expected by the {self.name!r} adapter; "
                        f"this checkpoint's block layout differs from the family's usual one"
                    ) from None


LLAMA_LIKE_GROUPS = (
    LinearGroup(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), prev="input_layernorm",
                inspect="self_attn", inspect_in_block=True),
    LinearGroup(("self_attn.o_proj",), prev="self_attn.v_proj"),
    LinearGroup(("mlp.gate_proj", "mlp.up_proj"), prev="post_attention_layernorm", inspect="mlp"),
    LinearGroup(("mlp.down_proj",), prev="mlp.up_proj"),
)

_ADAPTERS: dict[str, FamilyAdapter] = {}


def register_adapter(adapter: FamilyAdapter) -> None:
    """Make the runner handle `adapter.model_types` (replaces an earlier adapter for the same type)."""
    for model_type in adapter.model_types:
        _ADAPTERS[model_type] = adapter


# Llama-layout decoders: pre-norm blocks with q/k/v/o attention and a gated (SwiGLU) MLP. Qwen2 adds q/k/v
# biases, Qwen3 per-head q/k norms inside attention, Mistral sliding-window masks: none of these changes the
# grouping, and the runner replays each block's own attention mask and rotary embeddings.
register_adapter(FamilyAdapter("llama", ("llama",), "model.layers", LLAMA_LIKE_GROUPS))
register_adapter(FamilyAdapter("mistral", ("mistral",), "model.layers", LLAMA_LIKE_GROUPS))
register_adapter(FamilyAdapter("qwen2", ("qwen2",), "model.layers", LLAMA_LIKE_GROUPS))
register_adapter(FamilyAdapter("qwen3", ("qwen3",), "model.layers", LLAMA_LIKE_GROUPS))


ATTENTION_GROUPS = LLAMA_LIKE_GROUPS[:2]


def moe_groups(block: nn.Module) -> tuple[LinearGroup, ...]:
    """A MoE block's steps after attention: every routed expert's gate/up with the shared expert's
    (Qwen2-MoE) if any, then the shared expert's down, then every routed expert's down (one forward per
    step: experts are independent; each down's input comes after its gate/up are quantized). AWQ searches
    one scale for the block's input (scored on the block's output with the real routing) and folds it into
    post_attention_layernorm, scaling the routers' weight columns to match. Experts are those of the
    block's quantkit.modules.QuantExperts."""
    names = dict(block.named_modules())
    shared = "mlp.shared_expert" in names
    gate_up, down, routers = [], [], [n for n in ("mlp.gate", "mlp.shared_expert_gate") if n in names]
    for name, module in experts_modules(block):
        first = module.experts()[0].names
        gate_up += [f"{name}.{e}.{p}" for e in range(module.num_experts) for p in first[:2]]
        down += [f"{name}.{e}.{first[2]}" for e in range(module.num_experts)]
    if shared:
        gate_up += ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"]
    foldable = "post_attention_layernorm" in names and all(
        getattr(names[r], "weight", None) is not None and names[r].weight.dim() == 2 for r in routers)
    groups = [LinearGroup(tuple(gate_up), prev="post_attention_layernorm" if foldable else None, inspect="mlp",
                          separate=True, input_of="mlp", also_scale=tuple(routers))]
    if shared:
        groups.append(LinearGroup(("mlp.shared_expert.down_proj",), prev="mlp.shared_expert.up_proj"))
    groups.append(LinearGroup(tuple(down), separate=True))
    return tuple(groups)


# Mixture-of-experts decoders (transformers 5 fused experts, split by quantkit.modules.moe.unfuse_experts before
# calibration): Llama-layout attention, then the MoE block's experts (moe_groups); routers stay float.
for _name in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe"):
    register_adapter(FamilyAdapter(_name, (_name,), "model.layers", ATTENTION_GROUPS, expand=moe_groups))


def supported_model_types() -> list[str]:
    return sorted(_ADAPTERS)


def adapter_for(model: nn.Module) -> FamilyAdapter:
    """The adapter for `model` (by config.model_type); a clear error for an unknown family."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _ADAPTERS:
        raise QuantizationError(
            f"calibrated quantization does not support model type {model_type!r} ({type(model).__name__}) yet; "
            f"supported: {', '.join(supported_model_types())}. Use an RTN recipe (no calibration; it quantizes the "
            f"model's nn.Linear layers and the experts of transformers MoE blocks, and refuses other weights it "
            f"cannot reach), or describe the family with quantkit.calibration.register_adapter(FamilyAdapter(...))"
        )
    return _ADAPTERS[model_type]
