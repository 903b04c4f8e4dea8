"""GPTQ inside the block-by-block runner: per sub-layer step, accumulate H from the step's input, quantize."""

from __future__ import annotations

from collections.abc import Callable

from ..algorithms.gptq import GPTQOptions, gptq_quantize, hessian_update
from ..scheme import QuantScheme
from .runner import BlockContext, check_finite


class GPTQProcessor:
    """Quantizes a block's targeted linears with GPTQ, step by step (q/k/v, o, gate/up, down).

    The linears of one step read the same input, so they share one Hessian: one fp32 [K, K] matrix
    on the compute device at a time.
    """

    def __init__(self, scheme_for: Callable[[int], QuantScheme], options: GPTQOptions, scale_dtype=None) -> None:
        """scheme_for: in_features -> the weight scheme of a linear that wide (Recipe.weights_for).
        scale_dtype: the dtype the checkpoint stores scales in (default: each weight's dtype)."""
        self.scheme_for, self.options, self.scale_dtype = scheme_for, options, scale_dtype

    def process_block(self, ctx: BlockContext) -> None:
        for step in ctx.steps:
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
                    linear.weight, acc["h"], self.scheme_for(linear.in_features), self.options,
                    scale_dtype=self.scale_dtype or linear.weight.dtype, name=f"{ctx.name}.{name}",
                )
                ctx.set_quantized(name, qweight)
