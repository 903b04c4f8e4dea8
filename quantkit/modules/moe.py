"""Mixture-of-experts models: find a transformers model's fused experts and routers, unfuse the experts
into per-expert linears (quantkit.modules.QuantExperts), and name their tensors as checkpoints do.

Checked against transformers 5.24: Qwen3-MoE, Qwen2-MoE (plus a shared expert, an nn.Linear MLP, and
its `shared_expert_gate`, nn.Linear(H, 1)), Mixtral and OLMoE keep each block's experts in one
`*Experts` module with `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (gate rows first) and
call it as `experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`; the router
(`mlp.gate`, a `*TopKRouter` holding `weight` [E, H] used with F.linear) is not an nn.Linear.
On disk (what transformers' conversion_mapping splits them into on save, and vLLM's loaders read),
experts are `...mlp.experts.E.{gate_proj,up_proj,down_proj}`; Mixtral's block is `block_sparse_moe`
and its projections `w1` (gate), `w3` (up), `w2` (down).

Routers stay in full precision (vLLM builds them unquantized; llm-compressor's recipes ignore
`re:.*mlp.gate$` and `re:.*shared_expert_gate$`): quantkit never quantizes them and lists them under
the checkpoint's `ignore`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

from .quant_experts import DEFAULT_PROJECTIONS, PROJECTIONS, QuantExperts

#: model_type -> (in-memory block name, on-disk block name) where they differ
DISK_BLOCK_NAMES = {"mixtral": ("mlp", "block_sparse_moe")}


def model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


#: config keys holding the number of routed experts (Qwen2/3-MoE, OLMoE; Mixtral; DeepSeek-V3)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def moe_config_problem(config) -> str | None:
    """What makes a MoE config impossible, as a clause naming the keys and the fix (None when it is
    possible or not MoE): each token is routed to `num_experts_per_tok` of the experts, so it must be a
    whole number from 1 to the number of experts (the router's topk fails otherwise)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if isinstance(text, Mapping):  # config.json as read
        text = text.get("text_config") or text
    get = text.get if isinstance(text, Mapping) else lambda k: getattr(text, k, None)
    top_k = get("num_experts_per_tok")
    key = next((k for k in EXPERT_COUNT_KEYS if isinstance(get(k), int) and not isinstance(get(k), bool)), None)
    if top_k is None or key is None or get(key) == 0:  # dense (Qwen3-MoE's dense layers: 0 experts)
        return None
    experts = get(key)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts or experts < 1:
        return (f"num_experts_per_tok {top_k!r} with {key} {experts!r}: each token is routed to "
                f"num_experts_per_tok of the experts, a whole number from 1 to {key}; correct config.json")
    return None


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers 5 fused experts module quantkit can unfuse: 3-D gate_up_proj and down_proj, gated,
    not transposed, no bias (the layout of Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and getattr(module, "has_gate", True) and not getattr(module, "is_transposed", False)
            and not getattr(module, "has_bias", False) and hasattr(module, "act_fn")
            and gate_up.shape[0] == down.shape[0] and gate_up.shape[1] == 2 * down.shape[2]
            and gate_up.shape[2] == down.shape[1])


def unfuse_experts(model: nn.Module) -> list[str]:
    """Replace every fused experts module by a QuantExperts of per-expert nn.Linear layers, layer by layer
    (each fused parameter is dropped as soon as its layer is copied: at most one layer's experts are held
    twice); returns the replaced module names. Works on the meta device (building a model to load into)."""
    names = PROJECTIONS.get(model_type(model), DEFAULT_PROJECTIONS)
    fused = [name for name, module in model.named_modules() if is_fused_experts(module)]  # names only: holding
    for name in fused:  # the modules would keep every fused parameter alive until the end
        model.set_submodule(name, QuantExperts.from_fused(model.get_submodule(name), names))
    return fused


def experts_modules(model: nn.Module) -> list[tuple[str, QuantExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantExperts)]


def router_names(model: nn.Module) -> list[str]:
    """Modules of a MoE model that are routers (kept float): `*.mlp.gate` beside an experts module, and
    `*.shared_expert_gate`. Empty for a dense model (a dense MLP's `gate` is never matched: the block
    must hold experts)."""
    blocks = {n.rpartition(".")[0] for n, m in model.named_modules()
              if isinstance(m, QuantExperts) or is_fused_experts(m)}
    out = []
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        if parent in blocks and leaf in ("gate", "shared_expert_gate") and hasattr(module, "weight"):
            out.append(name)
    return out


def to_disk_name(name: str, mtype: str | None) -> str:
    """In-memory state-dict name -> the name checkpoints use (Mixtral: `.mlp.` -> `.block_sparse_moe.`)."""
    if mtype in DISK_BLOCK_NAMES:
        mem, disk = DISK_BLOCK_NAMES[mtype]
        return re.sub(rf"(\.layers\.\d+\.){mem}\.", rf"\g<1>{disk}.", name)
    return name


def from_disk_name(name: str, mtype: str | None) -> str:
    if mtype in DISK_BLOCK_NAMES:
        mem, disk = DISK_BLOCK_NAMES[mtype]
        return re.sub(rf"(\.layers\.\d+\.){disk}\.", rf"\g<1>{mem}.", name)
    return name


def routed_token_summary(model: nn.Module) -> dict | None:
    """What calibration routed to the experts (counts kept on each QuantExperts.routed_tokens during the
    runner's forwards): {"least", "median", "most": (token, expert) assignments per expert, "experts",
    "never_routed": names of experts no calibration token reached}; None for a model without them."""
    counts = []
    never = []
    for name, module in experts_modules(model):
        if module.routed_tokens is None:
            continue
        for e, c in enumerate(module.routed_tokens.tolist()):
            counts.append(int(c))
            if c == 0:
                never.append(f"{name}.{e}")
    if not counts:
        return None
    ordered = sorted(counts)
    return {"experts": len(counts), "least": ordered[0], "median": ordered[len(ordered) // 2], "most": ordered[-1],
            "never_routed": never}
