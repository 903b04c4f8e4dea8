"""QuantExperts: a mixture-of-experts layer's experts as one module per expert, each with three linears.

transformers 5 keeps a MoE block's experts fused in two 3-D parameters (``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I]) that no nn.Linear rule reaches. QuantExperts holds the same experts one by one,
``experts.E.{gate,up,down}`` (the names checkpoints and vLLM's loaders use), so the weight-only pipeline
(targets, RTN/GPTQ/AWQ, QuantLinear, save, load) treats every expert projection as a linear:

  float       each projection an nn.Linear (after ``from_fused``, before quantization / during calibration);
  quantized   each projection a QuantLinear; the forward then runs ``quantkit.kernels.wna16_moe`` over
              the experts the tokens were routed to (each expert's layout prepared once, at load).

The forward takes what the family's SparseMoeBlock passes to its experts module (routing stays the
model's own code): hidden_states [T, H], top_k_index int [T, k], top_k_weights [T, k]; returns [T, H] in
hidden_states' dtype: sum over k of top_k_weights[t, k] * down(act(gate(x_t)) * up(x_t)) of expert
top_k_index[t, k].
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit import kernels

from .quant_linear import QuantLinear

#: projection names (gate, up, down) per model family; every other family uses DEFAULT_PROJECTIONS
DEFAULT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = {"mixtral": ("w1", "w3", "w2")}


class ExpertMLP(nn.Module):
    """One expert: the gate, up and down projections under the family's names (children)."""

    def __init__(self, names: tuple[str, str, str], linears: tuple[nn.Module, nn.Module, nn.Module]) -> None:
        super().__init__()
        self.names = names
        for name, linear in zip(names, linears):
            self.add_module(name, linear)

    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return tuple(getattr(self, n) for n in self.names)


class QuantExperts(nn.Module):
    """The experts of one MoE block, expert by expert (children "0" .. "E-1", each an ExpertMLP).

    Attributes: num_experts E, hidden_dim H, intermediate_dim I, act_fn (the family's activation module).
    calibrate_all_experts: during calibration only, every expert also runs on every token (its linears'
    statistics see all tokens) while the output keeps the router's choice. routed_tokens: int64 [E],
    the (token, expert) assignments counted while `count_routing` is set (calibration), else None.
    """

    fuse_children = False  # fused_linear.fuse_projections leaves the experts' projections alone

    def __init__(self, experts: list[ExpertMLP], act_fn: nn.Module, hidden_dim: int, intermediate_dim: int) -> None:
        super().__init__()
        for e, expert in enumerate(experts):
            self.add_module(str(e), expert)
        self.num_experts, self.hidden_dim, self.intermediate_dim = len(experts), hidden_dim, intermediate_dim
        self.act_fn = act_fn
        self.calibrate_all_experts = False
        self.count_routing = False
        self.routed_tokens: torch.Tensor | None = None
        self._moe_prepared: list | None = None

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_fused(cls, fused: nn.Module, names: tuple[str, str, str] = DEFAULT_PROJECTIONS) -> "QuantExperts":
        """Per-expert nn.Linear layers holding copies of a transformers fused experts module's slices
        (gate_up_proj [E, 2I, H] -> gate [I, H] and up [I, H]; down_proj [E, H, I] -> down [H, I]); on the
        meta device for a meta module. The caller drops `fused` afterwards (one layer's experts twice at most)."""
        gate_up, down = fused.gate_up_proj, fused.down_proj
        e, two_i, h = gate_up.shape
        i = two_i // 2
        meta = gate_up.is_meta
        experts = []
        for k in range(e):
            linears = []
            for w in (gate_up[k, :i], gate_up[k, i:], down[k]):
                lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta" if meta else w.device, dtype=w.dtype)
                if not meta:
                    lin.weight = nn.Parameter(w.detach().clone(), requires_grad=False)
                linears.append(lin)
            experts.append(ExpertMLP(names, tuple(linears)))
        return cls(experts, fused.act_fn, h, i)

    def experts(self) -> list[ExpertMLP]:
        return [getattr(self, str(e)) for e in range(self.num_experts)]

    @property
    def quantized(self) -> bool:
        return all(isinstance(p, QuantLinear) for ex in self.experts() for p in ex.projections())

    # -- kernels ------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Build the grouped op's per-expert layout once from the experts' QuantLinear layers (after
        they were prepared for their backend); the float path needs nothing."""
        self._moe_prepared = None
        if not self.quantized:
            return
        self._moe_prepared = [kernels.MoEExpertWeights.from_layers(*ex.projections()) for ex in self.experts()]

    def _apply(self, fn, recurse=True):  # .to() / .cuda() replace the tensors the prepared layout points at
        self._moe_prepared = None
        return super()._apply(fn, recurse)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.count_routing:
            counts = torch.bincount(top_k_index.reshape(-1).cpu(), minlength=self.num_experts)[: self.num_experts]
            self.routed_tokens = counts if self.routed_tokens is None else self.routed_tokens + counts
        if self._moe_prepared is None and self.quantized:
            self.prepare()
        if self._moe_prepared is not None and not self.calibrate_all_experts and not self.count_routing:
            return kernels.wna16_moe(hidden_states, top_k_index, top_k_weights, self._moe_prepared, self.act_fn)
        return self._forward_modules(hidden_states, top_k_index, top_k_weights)

    def _forward_modules(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The loop over experts calling each expert's modules (float, calibration, or a model whose
        experts are only partly quantized). With `calibrate_all_experts` every expert runs on every
        token; with `count_routing` an expert no token reaches is still called (on 0 rows)."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts()):
            pos_t = (top_k_index == e).nonzero()  # [n, 2]: (token, slot)
            if self.calibrate_all_experts:
                y = self._expert(expert, x)
                if pos_t.numel():
                    w = top_k_weights[pos_t[:, 0], pos_t[:, 1], None]
                    out.index_add_(0, pos_t[:, 0], (y[pos_t[:, 0]] * w).to(out.dtype))
                continue
            if not pos_t.numel() and not self.count_routing:
                continue
            tokens = pos_t[:, 0]
            y = self._expert(expert, x[tokens]) * top_k_weights[tokens, pos_t[:, 1], None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def _expert(self, expert: ExpertMLP, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = expert.projections()
        return down(self.act_fn(gate(x)) * up(x))

    def extra_repr(self) -> str:
        state = "quantized" if self.quantized else "float"
        return f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, {state}"
