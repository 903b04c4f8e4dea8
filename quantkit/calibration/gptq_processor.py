"""GPTQ inside the block-by-block runner: per sub-layer step, accumulate H from the step's input, quantize."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..algorithms.gptq import GPTQOptions, HessianSum, factor_hessian, gptq_quantize
from ..algorithms.rtn import rtn_quantize
from ..core.quantized_weight import QuantizedWeight
from ..core.scheme import QuantScheme
from .distributed import add_hessians, gather_rows, row_share, world
from .runner import BlockContext, check_finite


class GPTQProcessor:
    """Quantizes a block's targeted linears with GPTQ, step by step (q/k/v, o, gate/up, down).

    The linears of one step read the same input, so they share one Hessian: one [K, K] matrix on the
    compute device at a time (its fp64 sum while the step's inputs come, then the fp32 Hessian).
    """

    def __init__(self, scheme_for: Callable[[str], QuantScheme], options: GPTQOptions, scale_dtype=None) -> None:
        """scheme_for: a targeted linear's module path -> its weight scheme (Recipe.schemes_for).
        scale_dtype: the dtype the checkpoint stores scales in (default: each weight's dtype)."""
        self.scheme_for, self.options, self.scale_dtype = scheme_for, options, scale_dtype
        self.rtn_fallback: list[str] = []  # MoE expert linears no calibration token reached

    def process_block(self, ctx: BlockContext) -> None:
        for step in ctx.steps:
            if step.group.separate:
                self._separate_step(ctx, step.targets)
                continue
            first = step.targets[0]
            ctx.status(f"gptq {'/'.join(n.rsplit('.', 1)[-1] for n in step.targets)}")
            acc = HessianSum()

            def accumulate(module, x, output, _where=f"the input of {ctx.name}.{first}"):
                check_finite(x, _where)
                acc.add(x)

            ctx.forward({first: accumulate}, stop_after=[first])
            add_hessians(acc)  # every process's windows
            # one factorisation for the step's linears; the Hessian is handed over and freed
            factor = factor_hessian(acc.hessian(), self.options, name=f"{ctx.name}.{first}", overwrite=True)
            for name in step.targets:
                linear = ctx.module(name)
                ctx.set_quantized(name, self._walk(linear.weight, factor, self.scheme_for(f"{ctx.name}.{name}"),
                                                   f"{ctx.name}.{name}"))
            del factor

    def quantize_head(self, name: str, linear, inputs: list):
        """The output head `linear` with GPTQ, its Hessian from `inputs` (per batch, the final norm of the last
        block's outputs [B, T, H])."""
        acc = HessianSum()
        for x in inputs:
            acc.add(x)
        factor = factor_hessian(add_hessians(acc).hessian(), self.options, name=name, overwrite=True)
        return self._walk(linear.weight, factor, self.scheme_for(name), name)

    def _walk(self, weight, factor, scheme: QuantScheme, name: str):
        """gptq_quantize of `weight` [N, K] with `factor`; under several processes each walks its share of the
        rows (they are independent given the factor) and the rows are gathered (calibration.distributed)."""
        scale_dtype = self.scale_dtype or weight.dtype
        rows = weight.shape[0]
        if world()[1] == 1 or scheme.grid != "uniform" or rows < world()[1]:
            return gptq_quantize(weight, factor, scheme, self.options, scale_dtype=scale_dtype, name=name)
        start, stop = row_share(rows)
        part = gptq_quantize(weight[start:stop], factor, scheme, self.options, scale_dtype=scale_dtype, name=name)
        zero = None if part.zero_point is None else gather_rows(part.zero_point, rows)
        return QuantizedWeight(gather_rows(part.q, rows), gather_rows(part.scale, rows), zero, part.scheme)

    def _separate_step(self, ctx: BlockContext, targets: tuple[str, ...]) -> None:
        """MoE experts: one Hessian per expert (its gate and up share it), all from one forward; an expert
        no calibration token reached gets RTN scales from its weights (announced in `rtn_fallback`)."""
        ctx.status(f"gptq {len(targets)} expert linears")
        by_parent: dict[str, list[str]] = {}
        for name in targets:
            by_parent.setdefault(name.rpartition(".")[0], []).append(name)
        acc = {parent: HessianSum() for parent in by_parent}

        def make(parent: str):
            def accumulate(module, x, output, _where=f"the input of {ctx.name}.{parent}"):
                if x.numel():
                    check_finite(x, _where)
                    acc[parent].add(x)
            return accumulate

        firsts = {names[0]: make(parent) for parent, names in by_parent.items()}
        ctx.forward(firsts, stop_after=list(firsts))
        for parent, names in by_parent.items():
            a = acc.pop(parent)
            if world()[1] > 1:  # an expert no window of this process reached may be reached on another
                add_hessians(a.start(ctx.module(names[0]).in_features, ctx.device))
            factor = None if a.count == 0 else factor_hessian(a.hessian(), self.options, name=f"{ctx.name}.{parent}",
                                                              overwrite=True)
            for name in names:
                linear = ctx.module(name)
                scheme = self.scheme_for(f"{ctx.name}.{name}")
                if factor is None:
                    self.rtn_fallback.append(f"{ctx.name}.{name}")
                    qweight = rtn_quantize(linear.weight.detach().float(), scheme)
                else:
                    qweight = self._walk(linear.weight, factor, scheme, f"{ctx.name}.{name}")
                ctx.set_quantized(name, qweight)
