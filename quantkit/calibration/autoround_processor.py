"""AutoRound inside the block-by-block runner: a block's linears tuned together against its float output.

Per decoder block: the float block's outputs on its inputs (the outputs of the already-quantized earlier
blocks) are the targets; every targeted linear computes with its fake-quantized weight
(algorithms.autoround.fake_quantize); each step runs a random draw of `batch_size` calibration windows
through the block, takes the MSE against the targets, and moves the rounding offsets and range
multipliers one signed-gradient step (lr decaying linearly to 0). Memory: the block's float weights, one
offset per weight and the targets (as many activations as the inputs) beside what the runner holds, plus
one step's autograd graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..algorithms.autoround import (
    AutoRoundOptions, RoundingParams, check_scheme, fake_quantize, quantized_weight, signed_step,
)
from ..core.errors import QuantizationError
from ..core.scheme import QuantScheme
from .runner import BlockContext, check_finite


def _rows(obj: Any, rows: torch.Tensor, batch: int) -> Any:
    """`obj` (a block's keyword arguments) with each tensor whose first dimension is the batch's taken at `rows`;
    tensors broadcast over the batch (first dimension 1) are left whole."""
    if isinstance(obj, torch.Tensor):
        return obj[rows.to(obj.device)] if obj.dim() > 0 and obj.shape[0] == batch else obj
    if isinstance(obj, tuple):
        return tuple(_rows(o, rows, batch) for o in obj)
    if isinstance(obj, list):
        return [_rows(o, rows, batch) for o in obj]
    if isinstance(obj, dict):
        return {k: _rows(v, rows, batch) for k, v in obj.items()}
    return obj


class AutoRoundProcessor:
    """Quantizes all of a block's targeted linears at once with AutoRound (signed gradient descent)."""

    def __init__(self, scheme_for: Callable[[str], QuantScheme], options: AutoRoundOptions, scale_dtype=None) -> None:
        """scheme_for: a targeted linear's module path -> its weight scheme (Recipe.schemes_for).
        scale_dtype: the dtype the checkpoint stores scales in (default: each weight's dtype)."""
        self.scheme_for, self.options, self.scale_dtype = scheme_for, options, scale_dtype

    def process_block(self, ctx: BlockContext) -> None:
        if any(step.group.separate for step in ctx.steps):
            raise QuantizationError(f"{ctx.name}: autoround does not tune mixture-of-experts linears yet; use gptq "
                                    f"(e.g. w4a16-gptq) for this model")
        names = [name for step in ctx.steps for name in step.targets]
        if not names:
            return
        schemes = {name: self.scheme_for(f"{ctx.name}.{name}") for name in names}
        for name, scheme in schemes.items():
            try:
                check_scheme(scheme, f"{ctx.name}.{name}")
            except ValueError as e:
                raise QuantizationError(str(e)) from None
        ctx.status("autoround targets")
        targets = ctx.forward()  # the float block's outputs [B, T, H] per batch
        linears = {name: ctx.module(name) for name in names}
        params = {name: RoundingParams.init(linear.weight, schemes[name]) for name, linear in linears.items()}
        frozen = [(p, p.requires_grad) for p in ctx.block.parameters()]
        for p, _ in frozen:
            p.requires_grad_(False)
        for name, linear in linears.items():
            linear.forward = self._fake_forward(linear, params[name], schemes[name])
        try:
            with torch.enable_grad():
                self._tune(ctx, params, targets)
        finally:
            for linear in linears.values():
                del linear.forward
            for p, flag in frozen:
                p.requires_grad_(flag)
        for name, linear in linears.items():
            scale_dtype = self.scale_dtype or linear.weight.dtype
            ctx.set_quantized(name, quantized_weight(linear.weight, params[name], schemes[name], self.options,
                                                     scale_dtype=scale_dtype))

    def _fake_forward(self, linear: nn.Linear, params: RoundingParams, scheme: QuantScheme):
        options = self.options

        def forward(x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, fake_quantize(linear.weight, params, scheme, options).to(x.dtype), linear.bias)

        return forward

    def _tune(self, ctx: BlockContext, params: dict[str, RoundingParams], targets: list[torch.Tensor]) -> None:
        """Signed gradient descent of `params` over options.iters steps; leaves the best parameters in place."""
        options = self.options
        for p in params.values():
            p.offset.requires_grad_(True)
            for t in (p.low, p.high):
                t.requires_grad_(options.tune_ranges)
        initial = {name: p.clone() for name, p in params.items()}
        best, best_loss = {name: p.clone() for name, p in params.items()}, float("inf")
        generator = torch.Generator().manual_seed(options.seed * 1_000_003 + ctx.index)
        for it in range(options.iters):
            b = int(torch.randint(len(ctx.inputs), (1,), generator=generator))
            x, kwargs, target = ctx.inputs[b], ctx.kwargs[b], targets[b]
            if x.shape[0] > options.batch_size:
                rows = torch.randperm(x.shape[0], generator=generator)[:options.batch_size]
                kwargs = _rows(kwargs, rows, x.shape[0])
                x, target = x[rows.to(x.device)], target[rows.to(x.device)]
            loss = self._loss(ctx, x, kwargs, target)
            value = float(loss.detach())
            if value < best_loss:
                best_loss = value
                for name, p in params.items():
                    best[name].copy_(p)
            loss.backward()
            decay = 1.0 - it / options.iters
            for p in params.values():
                signed_step(p, options.rounding_lr * decay, options.range_lr * decay, options)
            if it % 20 == 0:
                ctx.status(f"autoround {it}/{options.iters} loss {value:.3g}")
        if not options.keep_best:
            return
        for name, p in params.items():
            p.copy_(best[name])
        tuned = self._full_loss(ctx, targets)
        for name, p in params.items():
            p.copy_(initial[name])
        rtn = self._full_loss(ctx, targets)
        if tuned <= rtn:
            for name, p in params.items():
                p.copy_(best[name])

    def _loss(self, ctx: BlockContext, x: torch.Tensor, kwargs: dict, target: torch.Tensor) -> torch.Tensor:
        out = ctx.block(x, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return F.mse_loss(out.float(), target.float())

    @torch.no_grad()
    def _full_loss(self, ctx: BlockContext, targets: list[torch.Tensor]) -> float:
        """The MSE of the block's output against `targets` over every calibration window."""
        total, count = 0.0, 0
        for b, (x, kwargs, target) in enumerate(zip(ctx.inputs, ctx.kwargs, targets)):
            out = ctx.block(x, **kwargs)
            out = out[0] if isinstance(out, (tuple, list)) else out
            check_finite(out, f"the output of {ctx.name} (calibration batch {b})")
            total += float((out.float() - target.float()).pow(2).sum())
            count += out.numel()
        return total / max(count, 1)
