"""Whether an evaluation's baseline is the model the checkpoint was quantized from.

Quality measured against another model is a number about two different models, so the baseline must
agree with the checkpoint on the architecture's shapes (config.json) and on its unquantized embedding
tables, which quantization leaves as they are: they may differ only by the rounding of the dtypes each
model was stored and is run in (or, for tables a GGUF file stores on a grid, by that grid's rounding).
Embeddings are compared (not norms or biases) because calibrated algorithms such as AWQ legitimately fold
scales into the norms and linears inside the decoder blocks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..core.errors import UsageError
from ..formats.loading import source_dtype
from ..gguf.reading import gguf_origin
from ..modules.fused_linear import checkpoint_linear_count
from ..quantization import provenance

#: config fields that must agree: the architecture and every dimension of its weights
SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings")
_ROWS = 4096  # embedding rows compared at a time (bounded temporary memory for large vocabularies)
#: The most |quantized - source| / |source| (Frobenius norms) an embedding table stored on a GGUF grid may be
#: from its source's: a grid of 2 bits or more per weight leaves well under half the norm (Q8_0 on ref:tiny:
#: 0.0045), while a table of other weights leaves about the norm or more (|a - b|^2 = |a|^2 + |b|^2 for
#: uncorrelated tables; ref:tiny against a random model of its shapes: 3.1).
GRID_RESIDUAL = 0.5


def source_mismatches(model: nn.Module, baseline: nn.Module) -> list[str]:
    """How `baseline` differs from the model `model` was quantized from: quantized weights of its own (a
    checkpoint is no float baseline, whatever it shares with `model`), config fields, then the input (and
    untied, unquantized output) embedding tables; [] when it can be that model. Models without a config or
    embeddings (plain torch modules) are not compared."""
    quantized = checkpoint_linear_count(baseline)
    if quantized:
        return [f"the baseline is itself quantized: {quantized} of its linears hold quantized weights"]
    origin = gguf_origin(baseline)
    if origin is not None and origin.quantized_tensors:
        return [f"the baseline is itself quantized: the GGUF file {origin.path} stores {origin.quantized_tensors} "
                f"tensors on a grid"]
    configs = [_text_config(m) for m in (model, baseline)]
    if None in configs:
        return []
    problems = shape_mismatches(model, baseline)
    if problems:
        return problems
    rtol, atol = _rounding(model, baseline)
    stored_quantized = origin.quantized_tables if (origin := gguf_origin(model)) else frozenset()
    for what, ours, theirs in _embedding_tables(model, baseline):
        if ours.shape != theirs.shape:
            problems.append(f"{what}: shape {list(ours.shape)} in the model, {list(theirs.shape)} in the baseline")
        elif ("output" if "output" in what else "input") in stored_quantized:  # on a GGUF grid: its own rounding
            if (residual := _relative_residual(ours, theirs)) > GRID_RESIDUAL:
                problems.append(f"{what} differ from the baseline's by {residual:.3g} of their norm, more than "
                                f"rounding to the GGUF file's grid leaves (under {GRID_RESIDUAL})")
        elif (worst := _largest_excess(ours, theirs, rtol, atol)) > 1:
            problems.append(f"{what} differ by up to {worst:.3g}x what rounding to their dtypes explains")
    return problems


def shape_mismatches(model: nn.Module, baseline: nn.Module) -> list[str]:
    """The config fields of SHAPE_FIELDS in which `baseline` differs from `model` ("hidden_size 128 in the
    model, 256 in the baseline"); [] when they agree or a model has no config."""
    configs = [_text_config(m) for m in (model, baseline)]
    if None in configs:
        return []
    problems = []
    if _architecture(configs[0]) != _architecture(configs[1]):
        problems.append(f"model_type {configs[0].model_type} in the model, {configs[1].model_type} in the baseline"
                        f"{_window_note(configs)}")
    return problems + [
        f"{field} {getattr(configs[0], field)} in the model, {getattr(configs[1], field)} in the baseline"
        for field in SHAPE_FIELDS if field != "model_type"
        if getattr(configs[0], field, None) is not None and getattr(configs[1], field, None) is not None
        and getattr(configs[0], field) != getattr(configs[1], field)]


def _architecture(config) -> str | None:
    """config's model_type, "llama" for a Mistral model whose attention is Llama's (no sliding window narrower
    than its context): the same weights and the same outputs; llama.cpp runs Mistral GGUF files as llama."""
    mtype = getattr(config, "model_type", None)
    window = getattr(config, "sliding_window", None)
    context = getattr(config, "max_position_embeddings", None)
    if mtype == "mistral" and (window is None or (context is not None and window >= context)):
        return "llama"
    return mtype


def _window_note(configs) -> str:
    """Why a llama and a mistral config differ: the sliding window one of them attends within."""
    windows = [getattr(c, "sliding_window", None) for c in configs if getattr(c, "model_type", None) == "mistral"]
    if len(windows) == 1 and {c.model_type for c in configs} == {"llama", "mistral"}:
        return (f", whose attention keeps to a sliding window of {windows[0]} tokens the other has not (llama.cpp runs a "
                f"Mistral GGUF file as llama, without it)")
    return ""


def check_same_source(model: nn.Module, baseline: nn.Module, which: str) -> None:
    """UsageError unless `baseline` can be the model `model` was quantized from (see source_mismatches).
    which: how the message names `model` (its path, or "variant 'w4'")."""
    problems = source_mismatches(model, baseline)
    if not problems:
        return
    folder = getattr(model, "name_or_path", None)
    source = provenance.recorded_source(Path(folder)) if folder and Path(folder).is_dir() else None
    made_from = f"; its recipe.yaml says it was made from {source}" if source else ""
    name = getattr(baseline, "name_or_path", "") or ""
    raise UsageError(
        f"the baseline{' ' + name if name else ''} is not the model {which} was quantized from "
        f"({'; '.join(problems[:4])}){made_from}: give the source model as the baseline, or pass "
        f"--allow-other-baseline (allow_other_baseline=True in Python) to compare with another model on purpose"
    )


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        return None
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _embedding_tables(model: nn.Module, baseline: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what, model's table, baseline's table): the input embeddings, and the output embeddings when
    both models keep them as an untied float nn.Linear (not quantized)."""
    tables = []
    inputs = [getattr(m, "get_input_embeddings", lambda: None)() for m in (model, baseline)]
    if all(isinstance(getattr(e, "weight", None), torch.Tensor) for e in inputs):
        tables.append(("the input embeddings", inputs[0].weight, inputs[1].weight))
    outputs = [getattr(m, "get_output_embeddings", lambda: None)() for m in (model, baseline)]
    if all(type(o) is nn.Linear for o in outputs) and not any(
            o.weight is e.weight for o, e in zip(outputs, inputs) if e is not None):
        tables.append(("the output embeddings (lm_head)", outputs[0].weight, outputs[1].weight))
    return tables


def _rounding(model: nn.Module, baseline: nn.Module) -> tuple[float, float]:
    """(rtol, atol) of two copies of one tensor that went through the dtypes both models were stored and run
    in: each rounding moves a value by at most half the coarsest dtype's epsilon (relative), or by one
    subnormal step near zero."""
    dtypes = {source_dtype(m) for m in (model, baseline)} | {
        p.dtype for m in (model, baseline) for p in m.parameters() if p.is_floating_point()}
    infos = [torch.finfo(d) for d in dtypes if d.is_floating_point]
    return 2 * max(i.eps for i in infos), max(i.tiny * i.eps for i in infos)


@torch.no_grad()
def _relative_residual(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (Frobenius norms; 0 when both are 0). a, b: tensors of one shape, _ROWS rows at a time in fp32."""
    residual = norm = 0.0
    for x, y in zip(a.split(_ROWS), b.split(_ROWS)):
        x, y = x.float(), y.to(x.device).float()
        residual += float((x - y).square().sum())
        norm += float(y.square().sum())
    return (residual / norm) ** 0.5 if norm else (float("inf") if residual else 0.0)


@torch.no_grad()
def _largest_excess(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> float:
    """max over elements of |a - b| / (atol + rtol * max(|a|, |b|)): above 1 where rounding cannot explain
    the difference. a, b: tensors of one shape, compared _ROWS rows at a time in fp32."""
    worst = 0.0
    for x, y in zip(a.split(_ROWS), b.split(_ROWS)):
        x, y = x.float(), y.to(x.device).float()
        worst = max(worst, float(((x - y).abs() / (atol + rtol * torch.maximum(x.abs(), y.abs()))).max()))
    return worst
