"""The block-by-block calibration runner: one decoder block in memory at a time, whatever the depth.

    capture   run the model with every decoder block replaced by a recorder: the embedding runs, and
              each recorder keeps the arguments the model passes to its block (attention mask, rotary
              (cos, sin), position ids; masks may differ per block, e.g. sliding-window layers), then
              passes the hidden states through. The last recorder stops the forward, so the final norm
              and the LM head never run then.
    per block materialise it on the compute device (from accelerate's CPU/disk offload if needed), let
              each BlockProcessor collect statistics with forward hooks and quantize the block's linears
              in sub-layer order (q/k/v, then o, then gate/up, then down: each step's statistics come
              from a forward through the block with the earlier steps already quantized), recompute the
              block's outputs as the next block's inputs, swap in quantized layers (QuantLinear;
              GgufLinear on a GGUF grid) and move the block back to its home device (the CPU for
              offloaded models).
    head      a targeted output head (lm_head) is quantized last, on the final norm of the last block's
              outputs, by a processor with ``quantize_head`` (GPTQ); others leave it to RTN.

Peak memory is one float block plus the calibration activations (samples x tokens x hidden) plus the
quantized blocks already done (about a quarter of their float size at 4 bits). No tracing: blocks are
found through small per-family adapters (adapters.py).

A BlockProcessor is anything with ``process_block(ctx: BlockContext)``: a weight quantizer (GPTQ, AWQ),
or an observer that only collects statistics (e.g. KV-cache scales, with ``ctx.forward(hooks=...)`` on
the attention's sub-modules), and optionally ``finish(model)``, called once after the last block, where
it publishes what it found. Processors run in list order on each block; one listed after a weight
quantizer sees the block with its linears already quantized.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.errors import QuantizationError
from ..core.finite import describe_nonfinite, nonfinite_tensors
from ..core.quantized_weight import Quantized
from ..core.units import human_seconds
from ..kernels.cpu_flags import compute_dtype
from ..modules.moe import experts_modules
from ..modules.quantized_layer import to_layer
from ..modules.targets import output_head_name, set_submodule
from .adapters import FamilyAdapter, LinearGroup, adapter_for
from .offload import home_device, materialize_, materialize_model_, release_freed_memory
from .spill import BlockSpill

InputHook = Callable[[nn.Module, torch.Tensor, Any], None]  # (module, its first input, its output)


class _StopForward(Exception):
    """Raised from a hook to end a forward pass once everything needed has been seen."""


class BlockProcessor(Protocol):
    def process_block(self, ctx: "BlockContext") -> None: ...


@dataclass
class Step:
    """One sub-layer step of a block: the adapter's group, with the linears of it that are quantized."""

    group: LinearGroup
    targets: tuple[str, ...]  # block-relative names of the targeted linears, in call order


def check_finite(x: torch.Tensor, where: str) -> None:
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise QuantizationError(
            f"{bad} NaN/Inf value(s) in the calibration activations at {where}: the model overflows on this data "
            f"in {x.dtype}; load it in bfloat16 or float32 (not float16), or check its weights"
        )


def calibration_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a block's calibration passes run in: the model's, except bf16 on a CPU that emulates bf16
    matrix products (no AVX512-BF16 / AMX), where fp32 runs them several times faster and more exactly (a
    2-layer width-1024 GPTQ: 15.4 s in bf16 against 8.9 s in fp32 on a 2-core Xeon without native bf16).
    One block at a time is upcast, and it goes back to the model's dtype before its linears are replaced."""
    return compute_dtype(model_dtype) if device.type == "cpu" and model_dtype == torch.bfloat16 else model_dtype


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to each tensor in it (through tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _float_to(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with its floating tensors cast to ``dtype``."""
    return _map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _to_device(obj: Any, device: torch.device) -> Any:
    return _map_tensors(obj, lambda t: t.to(device))


def _recast(module: nn.Module, src: torch.dtype, dst: torch.dtype, only: set[str] | None = None) -> set[str]:
    """Cast ``module``'s parameters and buffers of dtype ``src`` (those named in ``only``, when given) to
    ``dst`` in place; returns their names. Tensors of other dtypes (a norm kept in fp32) are left alone."""
    cast = set()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.dtype == src and (only is None or name in only):
            t.data = t.data.to(dst)
            cast.add(name)
    return cast


@dataclass
class BlockContext:
    """A decoder block on the compute device with its calibration inputs, handed to each processor.

    inputs: per calibration batch, the block's input hidden states [B, T, H] (in calibration_dtype).
    kwargs: per batch, the other arguments the model passes to this block (mask, rotary, positions).
    steps: the sub-layer steps in call order (only those with targeted linears are listed).
    quantized: block-relative linear name -> its quantized weight (core.quantized_weight.Quantized), filled by
      `set_quantized`.
    """

    index: int
    name: str
    block: nn.Module
    adapter: FamilyAdapter
    steps: list[Step]
    inputs: list[torch.Tensor]
    kwargs: list[dict[str, Any]]
    device: torch.device
    quantized: dict[str, Quantized] = field(default_factory=dict)
    status: Callable[[str], None] = lambda _msg: None

    @property
    def num_tokens(self) -> int:
        return sum(x.shape[0] * x.shape[1] for x in self.inputs)

    def module(self, name: str) -> nn.Module:
        return self.block.get_submodule(name)

    def forward(self, hooks: dict[str, InputHook] | None = None, stop_after: Iterable[str] = (),
                max_tokens: int | None = None) -> list[torch.Tensor] | None:
        """Run every calibration batch through the block, calling `hooks[name](module, input, output)`
        after each call of the named sub-module.

        stop_after: end each batch's pass as soon as all these sub-modules have run (returns None);
        when empty, the full block runs and its outputs [B, T, H] per batch are returned.
        max_tokens: run only the first batches, up to the one that brings the count to max_tokens tokens (None: all).
        """
        hooks = hooks or {}
        stop_after = set(stop_after)
        seen: set[str] = set()
        handles = []

        def make(name: str, fn: InputHook | None):
            def hook(module, args, output):
                if fn is not None:
                    x = args[0] if args else None
                    fn(module, x, output)
                if name in stop_after:
                    seen.add(name)
                    if seen == stop_after:
                        raise _StopForward

            return hook

        for name in set(hooks) | stop_after:
            handles.append(self.module(name).register_forward_hook(make(name, hooks.get(name))))
        outputs: list[torch.Tensor] | None = [] if not stop_after else None
        try:
            done = 0
            for b, (x, kwargs) in enumerate(zip(self.inputs, self.kwargs)):
                if max_tokens is not None and done >= max_tokens:
                    break
                done += x.shape[0] * x.shape[1]
                seen.clear()
                try:
                    out = self.block(x, **kwargs)
                except _StopForward:
                    continue
                if stop_after:
                    raise RuntimeError(f"{self.name}: the block never called {sorted(stop_after - seen)}")
                out = out[0] if isinstance(out, (tuple, list)) else out
                check_finite(out, f"the output of {self.name} (calibration batch {b})")
                outputs.append(out)
        finally:
            for h in handles:
                h.remove()
        return outputs

    def set_quantized(self, name: str, qweight: Quantized) -> None:
        """Record a linear's quantized weight and make the block compute with it from now on (as its layer
        in the model dtype will hold it)."""
        linear = self.module(name)
        dtype = linear.weight.dtype
        weight = qweight.fields_rounded_to(dtype).dequantize()
        linear.weight.data = weight.to(device=linear.weight.device, dtype=dtype)
        self.quantized[name] = qweight


class _BlockRecorder(nn.Module):
    """Stands in for decoder block `index` during capture: records its arguments, passes hidden states on."""

    def __init__(self, index: int, last: int, store: list[dict[int, tuple]]) -> None:
        super().__init__()
        self.index, self.last, self.store = index, last, store

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        if len(args) > 1:
            raise QuantizationError(
                f"decoder block {self.index} was called with {len(args)} positional arguments; the runner replays "
                f"only hidden_states positionally: this model family needs an adapter update"
            )
        self.store[-1][self.index] = (hidden, kwargs)
        if self.index == self.last:
            raise _StopForward
        return hidden


@torch.no_grad()
def capture_block_inputs(
    model: nn.Module, blocks: nn.ModuleList, batches: Sequence[torch.Tensor], device: torch.device
) -> tuple[list[torch.Tensor], list[list[dict[str, Any]]]]:
    """Run only what precedes the decoder blocks; returns (inputs of block 0 per batch [B, T, H],
    per block, per batch, the keyword arguments the model passes to that block), all on `device`."""
    n = len(blocks)
    store: list[dict[int, tuple]] = []
    originals = list(blocks)
    embed = model.get_input_embeddings()
    embed_device = embed.weight.device if embed is not None and not embed.weight.is_meta else torch.device("cpu")
    try:
        for i in range(n):
            blocks[i] = _BlockRecorder(i, n - 1, store)
        for ids in batches:
            store.append({})
            try:
                model(input_ids=ids.to(embed_device), use_cache=False)
            except _StopForward:
                pass
            if len(store[-1]) != n:
                raise QuantizationError(
                    f"{type(model).__name__} called {len(store[-1])} of its {n} decoder blocks during calibration; "
                    f"the runner needs every block called once per forward"
                )
    finally:
        for i, block in enumerate(originals):
            blocks[i] = block
    inputs = []
    for b, record in enumerate(store):
        hidden = record[0][0].to(device)
        check_finite(hidden, f"the input of decoder block 0 (calibration batch {b})")
        inputs.append(hidden)
    kwargs = [[_to_device(record[i][1], device) for record in store] for i in range(n)]
    return inputs, kwargs


@torch.no_grad()
def _quantize_head(model: nn.Module, outside: list[str], last_outputs: list[torch.Tensor],
                   processors: Sequence[BlockProcessor]) -> list[str]:
    """Quantize the output head, if targeted, with the first processor that has `quantize_head(name, linear,
    inputs)`, its inputs being the final norm of the last block's outputs (per batch [B, T, H]); returns
    `outside` without it where one did. A model whose decoder has no `norm` keeps its head for the caller."""
    name = output_head_name(model)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    quantizer = next((p for p in processors if hasattr(p, "quantize_head")), None)
    if name not in outside or not isinstance(norm, nn.Module) or quantizer is None:
        return outside
    linear = model.get_submodule(name)
    home = norm.weight.device if getattr(norm, "weight", None) is not None else linear.weight.device
    inputs = []
    for b, x in enumerate(last_outputs):
        h = norm(x.to(home)).to(linear.weight.device)
        check_finite(h, f"the input of {name} (calibration batch {b})")
        inputs.append(h)
    qweight = quantizer.quantize_head(name, linear, inputs)
    set_submodule(model, name, to_layer(qweight, linear.bias, dtype=linear.weight.dtype))
    return [n for n in outside if n != name]


def estimate_line(first_block_s: float, blocks: int) -> str:
    """What quantize prints after its first block: that block's time and the run's estimate from it."""
    return (f"first of {blocks} blocks took {human_seconds(first_block_s)}: about "
            f"{human_seconds(first_block_s * blocks)} for all of them")


def _block_steps(adapter: FamilyAdapter, block: nn.Module, targets: list[str]) -> list[Step]:
    """The adapter's sub-layer steps restricted to the targeted linears, plus one step per targeted linear
    the adapter does not know (quantized last, each on its own input)."""
    steps, covered = [], set()
    for group in adapter.groups_for(block):
        chosen = tuple(n for n in group.linears if n in targets)
        covered.update(group.linears)
        if chosen:
            steps.append(Step(group, chosen))
    extra = [n for n in targets if n not in covered]
    order = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
    for name in sorted(extra, key=order.index):
        steps.append(Step(LinearGroup((name,)), (name,)))
    return steps


@torch.no_grad()
def run_blockwise(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    targets: Sequence[str],
    processors: Sequence[BlockProcessor],
    *,
    device: torch.device | str | None = None,
    progress: bool = True,
    desc: str = "calibrate",
    spill: BlockSpill | None = None,
) -> list[str]:
    """Walk `model` block by block, letting `processors` quantize the targeted linears inside blocks.

    batches: calibration token ids, each [B, T] int64. targets: full names of the linears to quantize.
    device: compute device (default: cuda if available, else cpu).
    Quantized linears are replaced by QuantLinear (GgufLinear on a GGUF grid) in place. A targeted output
    head is quantized after the last block by the first processor with `quantize_head` (GPTQ), on the final
    norm of the last block's outputs. Returns the targeted names left: those not in any decoder block and
    not so quantized, which the caller quantizes without calibration.
    An offloaded model (accelerate device_map with cpu/disk) comes back as a plain CPU model.
    spill: where each finished block's tensors go (file pages instead of the process's memory; None: kept
    in memory).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    adapter = adapter_for(model)
    blocks = adapter.blocks_of(model)
    prefix = adapter.blocks + "."
    per_block: dict[int, list[str]] = {}
    outside: list[str] = []
    for name in targets:
        index, _, local = name[len(prefix):].partition(".") if name.startswith(prefix) else ("", "", "")
        if index.isdigit() and local:
            per_block.setdefault(int(index), []).append(local)
        else:
            outside.append(name)

    was_training = model.training
    model.eval()
    inputs, kwargs = capture_block_inputs(model, blocks, batches, device)
    model_dtype = inputs[0].dtype
    compute = calibration_dtype(model_dtype, device)
    inputs, kwargs = _float_to(inputs, compute), _float_to(kwargs, compute)
    bar = tqdm(total=len(blocks), desc=desc, unit="block", disable=not progress)
    started = time.perf_counter()
    try:
        for i, block in enumerate(blocks):
            name = f"{adapter.blocks}.{i}"
            home = home_device(block)
            materialize_(block, device)
            upcast = _recast(block, model_dtype, compute) if compute != model_dtype else set()
            adapter.check_block(block, name)
            local_targets = per_block.get(i, [])
            found = nonfinite_tensors((f"{name}.{n}", t) for n, t in block.state_dict().items())
            if found:  # offloaded blocks are only seen here, once materialized
                raise QuantizationError(
                    f"{describe_nonfinite(found)}: a model with NaN/Inf weights cannot be quantized; "
                    f"fix or re-download the source weights"
                )
            ctx = BlockContext(
                index=i, name=name, block=block, adapter=adapter, steps=_block_steps(adapter, block, local_targets),
                inputs=inputs, kwargs=kwargs[i], device=device,
                status=lambda msg: bar.set_postfix_str(msg, refresh=True),
            )
            for processor in processors:
                processor.process_block(ctx)
            missing = [t for t in local_targets if t not in ctx.quantized]
            if missing:
                raise RuntimeError(f"{name}: no processor quantized {missing}")
            ctx.status("outputs")
            for _, experts in experts_modules(block):  # MoE: count the routing of this one pass
                if experts.count_routing:
                    experts.routed_tokens = None
            inputs = ctx.forward()
            _recast(block, compute, model_dtype, upcast)  # before the quantized layers go in: they hold their own
            for local, qweight in ctx.quantized.items():
                linear = block.get_submodule(local)
                layer = to_layer(qweight, linear.bias, dtype=model_dtype)
                block.set_submodule(local, layer)
            block.to(home)
            if spill is not None:
                spill.keep(block)
            kwargs[i] = []
            del ctx
            release_freed_memory()
            bar.update(1)
            if i == 0 and progress and len(blocks) > 1:
                bar.write(estimate_line(time.perf_counter() - started, len(blocks)))
    finally:
        bar.close()
    materialize_model_(model)
    outside = _quantize_head(model, outside, inputs, processors)
    del inputs
    for processor in processors:
        finish = getattr(processor, "finish", None)
        if finish is not None:
            finish(model)
    model.train(was_training)
    return outside
