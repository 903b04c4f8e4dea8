"""GPTQ inside the block-by-block runner: per sub-layer step, accumulate H from the step's input, quantize."""

from __future__ import annotations

from collections.abc import Callable

from ..algorithms.gptq import GPTQOptions, gptq_quantize, hessian_update
from ..algorithms.rtn import rtn_quantize
from ..scheme import QuantScheme
from .runner import BlockContext, check_finite


class GPTQProcessor:
    """Quantizes a block's targeted linears with GPTQ, step by step (q/k/v, o, gate/up, down).

    The linears of one step read the same input, so they share one Hessian: one fp32 [K, K] matrix
    on the compute device at a time.
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
            acc = {"h": None, "count": 0}

            def accumulate(module, x, output, _where=f"the input of {ctx.name}.{first}"):
                check_finite(x, _where)
                acc["h"], acc["count"] = hessian_update(acc["h"], acc["count"], x)

            ctx.forward({first: accumulate}, stop_after=[first])
            for name in step.targets:
                linear = ctx.module(name)
                qweight = gptq_quantize(
                    linear.weight, acc["h"], self.scheme_for(f"{ctx.name}.{name}"), self.options,
                    scale_dtype=self.scale_dtype or linear.weight.dtype, name=f"{ctx.name}.{name}",
                )
                ctx.set_quantized(name, qweight)

    def quantize_head(self, name: str, linear, inputs: list):
        """The output head `linear` with GPTQ, its Hessian from `inputs` (per batch, the final norm of the last
        block's outputs [B, T, H])."""
        h, count = None, 0
        for x in inputs:
            h, count = hessian_update(h, count, x)
        return gptq_quantize(linear.weight, h, self.scheme_for(name), self.options,
                             scale_dtype=self.scale_dtype or linear.weight.dtype, name=name)

    def _separate_step(self, ctx: BlockContext, targets: tuple[str, ...]) -> None:
        """MoE experts: one Hessian per expert (its gate and up share it), all from one forward; an expert
        no calibration token reached gets RTN scales from its weights (announced in `rtn_fallback`)."""
        ctx.status(f"gptq {len(targets)} expert linears")
        by_parent: dict[str, list[str]] = {}
        for name in targets:
            by_parent.setdefault(name.rpartition(".")[0], []).append(name)
        acc = {parent: {"h": None, "count": 0} for parent in by_parent}

        def make(parent: str):
            def accumulate(module, x, output, _where=f"the input of {ctx.name}.{parent}"):
                if x.numel():
                    check_finite(x, _where)
                    a = acc[parent]
                    a["h"], a["count"] = hessian_update(a["h"], a["count"], x)
            return accumulate

        firsts = {names[0]: make(parent) for parent, names in by_parent.items()}
        ctx.forward(firsts, stop_after=list(firsts))
        for parent, names in by_parent.items():
            a = acc.pop(parent)
            for name in names:
                linear = ctx.module(name)
                scheme = self.scheme_for(f"{ctx.name}.{name}")
                if a["count"] == 0:
                    self.rtn_fallback.append(f"{ctx.name}.{name}")
                    qweight = rtn_quantize(linear.weight.detach().float(), scheme)
                else:
                    qweight = gptq_quantize(
                        linear.weight, a["h"], scheme, self.options,
                        scale_dtype=self.scale_dtype or linear.weight.dtype, name=f"{ctx.name}.{name}",
                    )
                ctx.set_quantized(name, qweight)
