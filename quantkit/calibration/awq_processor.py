"""AWQ inside the block-by-block runner.

Per block, two phases:

1. scales, on the float block: for each sub-layer step whose input comes from a module we can fold
   into (the attention norm for q/k/v, v_proj for o_proj when shapes allow, the MLP norm for
   gate/up, up_proj for down_proj), search s on the step's input and compare the sub-block's output
   (the three projections' outputs for q/k/v, or with the ``block_outputs`` option the attention's
   output, read from forwards through the block; the MLP's output for gate/up; the linear's own output
   otherwise); then fold: weight columns * s, the producer's output / s. Folding keeps the float
   block's function, so all scales can be searched before anything is quantized (as in AWQ);
2. clipping and rounding, in sub-layer order: each step's inputs come from a forward through the
   block whose earlier steps are already quantized.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..algorithms.awq import (
    AWQOptions, awq_quantize, mean_abs_update, scaled_effective_weight, search_clip, search_scales, weight_channel_mean,
)
from ..core.errors import QuantizationError
from ..core.scheme import QuantScheme
from .adapters import LinearGroup
from .distributed import refuse_unsupported
from .runner import BlockContext, check_finite
from .sampling import TokenSubsample


def can_fold(prev: nn.Module, linears: list[nn.Linear]) -> bool:
    """Whether 1/s over the linears' input channels can be folded into `prev`'s output."""
    k = linears[0].in_features
    if any(lin.in_features != k for lin in linears):
        return False
    if isinstance(prev, nn.Linear):
        return prev.out_features == k  # e.g. v_proj -> o_proj only without grouped-query attention
    weight = getattr(prev, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.numel() == k


def fold_scales(prev: nn.Module, linears: list[nn.Module], s: torch.Tensor) -> None:
    """prev's output channels / s, the linears' input columns * s (the float function is unchanged).

    prev: nn.Linear (rows scaled) or a norm with a 1-D weight (and optional bias); s: [K]. linears: modules
    with a weight [N, K] (nn.Linear, or a MoE router applying its weight with F.linear).
    """
    s_prev = s.to(device=prev.weight.device, dtype=torch.float32)
    if isinstance(prev, nn.Linear):
        prev.weight.data = (prev.weight.data.float() / s_prev.unsqueeze(1)).to(prev.weight.dtype)  # [K, in] rows
    else:
        prev.weight.data = (prev.weight.data.float() / s_prev).to(prev.weight.dtype)
    if getattr(prev, "bias", None) is not None:
        prev.bias.data = (prev.bias.data.float() / s_prev).to(prev.bias.dtype)
    for linear in linears:
        s_lin = s.to(device=linear.weight.device, dtype=torch.float32)
        linear.weight.data = (linear.weight.data.float() * s_lin.unsqueeze(0)).to(linear.weight.dtype)  # [N, K] cols


class AWQProcessor:
    """Quantizes a block's targeted linears with AWQ (scale search and folding, clipping search, rounding)."""

    def __init__(self, scheme_for: Callable[[str], QuantScheme], options: AWQOptions, scale_dtype=None) -> None:
        """scheme_for: a targeted linear's module path -> its weight scheme (Recipe.schemes_for).
        scale_dtype: the dtype the checkpoint stores scales in (default: each weight's dtype)."""
        self.scheme_for, self.options, self.scale_dtype = scheme_for, options, scale_dtype
        self.rtn_fallback: list[str] = []  # MoE expert linears no calibration token reached

    # -- capture -------------------------------------------------------------------------------------
    def _capture(self, ctx: BlockContext, name: str, max_tokens: int, with_mean: bool):
        """Input of sub-module `name` over the calibration data: (mean |x| [K] or None, rows [M, K] fp32)."""
        sample = TokenSubsample(ctx.num_tokens, max_tokens)
        acc = {"mean": None, "count": 0}

        def hook(module, x, output, _where=f"the input of {ctx.name}.{name}"):
            check_finite(x, _where)
            if with_mean:
                acc["mean"], acc["count"] = mean_abs_update(acc["mean"], acc["count"], x)
            sample.add(x)

        ctx.forward({name: hook}, stop_after=[name])
        return acc["mean"], sample.rows

    # -- phase 1 ---------------------------------------------------------------------------------------
    def _group_output(self, ctx: BlockContext, group: LinearGroup, linears: list[nn.Linear], x: torch.Tensor) -> torch.Tensor:
        """The sub-block output the scale search compares, fp32 [M', N']. x: [M, K] fp32 (the group's input rows
        the search sees; an inspect module read in the block sees the first max_search_tokens tokens instead)."""
        if group.inspect is not None and group.inspect_in_block and self.options.block_outputs:
            outputs = []

            def keep(module, inp, out):
                out = out[0] if isinstance(out, tuple) else out
                outputs.append(out.reshape(-1, out.shape[-1]).float())

            ctx.forward({group.inspect: keep}, stop_after=[group.inspect], max_tokens=self.options.max_search_tokens)
            return torch.cat(outputs)
        if group.inspect is not None and not group.inspect_in_block:
            module = ctx.module(group.inspect)
            inp = x.to(linears[0].weight.dtype)
            out = module(inp.unsqueeze(0) if group.separate else inp)  # a MoE block takes [B, T, H]
            out = out[0] if isinstance(out, tuple) else out
            return out.reshape(-1, out.shape[-1]).float()
        return torch.cat(
            [F.linear(x, lin.weight.float(), None if lin.bias is None else lin.bias.float()) for lin in linears], dim=-1
        )  # [M, sum N]

    def _search_and_fold(self, ctx: BlockContext, group: LinearGroup, targets: tuple[str, ...]) -> None:
        prev = ctx.module(group.prev)
        linears = [ctx.module(n) for n in group.linears]
        if not can_fold(prev, linears):
            return
        quantized = set(targets)
        schemes = {n: self.scheme_for(f"{ctx.name}.{n}") for n in quantized}  # a mix may give each its own grid
        x_mean, x = self._capture(ctx, group.input_of or group.linears[0], self.options.max_search_tokens,
                                  with_mean=True)
        reference = self._group_output(ctx, group, linears, x)
        originals = {n: ctx.module(n).weight.data for n in quantized}

        def loss(s: torch.Tensor) -> float:
            try:
                for n in quantized:
                    w = originals[n]
                    ctx.module(n).weight.data = scaled_effective_weight(w, s, schemes[n], w.dtype).to(w.dtype)
                out = self._group_output(ctx, group, linears, x)
            finally:
                for n in quantized:
                    ctx.module(n).weight.data = originals[n]
            return (out - reference).pow(2).mean().item()

        w_mean = None
        if self.options.duo_scaling:
            w_mean = weight_channel_mean([lin.weight for lin in linears], schemes[targets[0]].group_size)
        s, _ratio, _losses = search_scales(x_mean, loss, self.options.grid, w_mean)
        fold_scales(prev, linears + [ctx.module(n) for n in group.also_scale], s)

    # -- block ----------------------------------------------------------------------------------------
    def process_block(self, ctx: BlockContext) -> None:
        refuse_unsupported("AWQ's scale search")
        for step in ctx.steps:
            if step.group.prev is not None:
                ctx.status(f"awq scales {'/'.join(n.rsplit('.', 1)[-1] for n in step.targets)}")
                self._search_and_fold(ctx, step.group, step.targets)
        for step in ctx.steps:
            if step.group.separate:
                self._separate_step(ctx, step.targets)
                continue
            ctx.status(f"awq clip {'/'.join(n.rsplit('.', 1)[-1] for n in step.targets)}")
            x = None
            if self.options.clip:
                _, x = self._capture(ctx, step.targets[0], self.options.clip_tokens, with_mean=False)
            for name in step.targets:
                linear = ctx.module(name)
                scheme = self.scheme_for(f"{ctx.name}.{name}")
                w = linear.weight.data
                if not torch.isfinite(w).all():
                    raise QuantizationError(f"{ctx.name}.{name}: AWQ scaling produced non-finite weights")
                ratio = None
                if x is not None:
                    ratio = search_clip(
                        w, x, scheme, grid=self.options.clip_grid, max_shrink=self.options.max_shrink,
                        scale_dtype=self.scale_dtype or w.dtype,
                    )
                ctx.set_quantized(name, awq_quantize(w, scheme, ratio, scale_dtype=self.scale_dtype or w.dtype))

    def _separate_step(self, ctx: BlockContext, targets: tuple[str, ...]) -> None:
        """MoE experts: no scales are folded (an expert's input is shared with the router and the other
        experts); each expert's clipping search runs on its own input rows, captured in one forward. An
        expert no calibration token reached is rounded unclipped (announced in `rtn_fallback`)."""
        ctx.status(f"awq clip {len(targets)} expert linears")
        by_parent: dict[str, list[str]] = {}
        for name in targets:
            by_parent.setdefault(name.rpartition(".")[0], []).append(name)
        samples = {parent: TokenSubsample(ctx.num_tokens, self.options.clip_tokens) for parent in by_parent}

        def make(parent: str):
            def keep(module, x, output, _where=f"the input of {ctx.name}.{parent}"):
                if x.numel():
                    check_finite(x, _where)
                    samples[parent].add(x)
            return keep

        if self.options.clip:
            hooks = {names[0]: make(parent) for parent, names in by_parent.items()}
            ctx.forward(hooks, stop_after=list(hooks))
        for parent, names in by_parent.items():
            sample = samples.pop(parent)
            x = sample.rows if sample.parts else None
            for name in names:
                linear = ctx.module(name)
                scheme = self.scheme_for(f"{ctx.name}.{name}")
                w = linear.weight.data
                ratio = None
                if x is None or not x.shape[0]:
                    if self.options.clip:
                        self.rtn_fallback.append(f"{ctx.name}.{name}")
                else:
                    ratio = search_clip(w, x, scheme, grid=self.options.clip_grid, max_shrink=self.options.max_shrink,
                                        scale_dtype=self.scale_dtype or w.dtype)
                ctx.set_quantized(name, awq_quantize(w, scheme, ratio, scale_dtype=self.scale_dtype or w.dtype))
