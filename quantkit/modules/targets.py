"""Module selection by compressed-tensors style patterns.

A pattern is a class name ("Linear"), an exact module name ("lm_head", "model.layers.0.mlp.down_proj"),
or a regular expression on the module name prefixed with "re:" ("re:.*mlp.*"). For names, a pattern
also matches as a dotted suffix: "lm_head" matches "lm_head" and "model.lm_head".
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

from torch import nn

from ..core.errors import ConfigError, QuantizationError, first_names


def check_patterns(patterns: Iterable[str], where: str, error: type[Exception] = ConfigError) -> None:
    """Raise `error` naming the first "re:" pattern that is not a valid regular expression."""
    for p in patterns:
        if isinstance(p, str) and p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise error(f"{where}: {p!r} is not a valid regular expression ({e}); fix the pattern") from None


def matches(name: str, module: nn.Module, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    if pattern == type(module).__name__:
        return True
    return name == pattern or name.endswith("." + pattern)


def quantizable(module: nn.Module) -> bool:
    """Whether quantkit can quantize `module`'s weight (an nn.Linear)."""
    return isinstance(module, nn.Linear)


def _holds_matrix(module: nn.Module) -> bool:
    """Whether ``module`` itself holds a parameter of two or more dimensions (a weight matrix)."""
    return any(p.dim() >= 2 for p in module.parameters(recurse=False))


def _holds_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a quantizable linear or holds one (an ignore entry naming it keeps them float)."""
    return any(quantizable(m) for m in module.modules())


def check_every_pattern_matches(model: nn.Module, targets: Iterable[str], ignore: Iterable[str]) -> None:
    """QuantizationError naming the first target or ignore entry that matches no quantizable module of `model`:
    a typo (`lm_haed`) or a module quantkit cannot quantize (`model.embed_tokens`) would otherwise be dropped
    without a word, and an ignore list that ignores nothing quantizes what it was meant to keep. An ignore
    entry may also name a module holding linears (`re:.*mlp\\.experts$`: all of them stay float) or a matrix
    outside nn.Linear: that keeps it float on purpose."""
    modules = list(model.named_modules())
    for key, patterns in (("targets", targets), ("ignore", ignore)):
        for pattern in patterns:
            hits = [(name, m) for name, m in modules if name and matches(name, m, pattern)]
            if any(quantizable(m) for _, m in hits):
                continue
            if key == "ignore" and any(_holds_linear(m) or _holds_matrix(m) for _, m in hits):
                continue  # keeps float the linears inside it, or a matrix outside nn.Linear quantize would refuse
            if hits:
                shown = first_names((f"{name} ({type(m).__name__})" for name, m in hits), 3)
                what = f"matches only modules quantkit cannot quantize: {shown}; quantkit quantizes nn.Linear"
            else:
                linears = [name for name, m in modules if quantizable(m)]
                close = difflib.get_close_matches(pattern, linears + [n.rsplit(".", 1)[-1] for n in linears], n=1)
                what = "matches no module of the model" + (f" (did you mean {close[0]!r}?)" if close else "")
            raise QuantizationError(f"the recipe's {key} entry {pattern!r} {what} in {type(model).__name__}; fix or "
                                    f"remove the entry")


def _ignored(name: str, module_of: dict[str, nn.Module], patterns: list[str]) -> bool:
    """Whether an ignore pattern matches the module `name` or a module holding it."""
    parts = name.split(".")
    return any(matches(n, module_of[n], p) for n in (".".join(parts[:i]) for i in range(len(parts), 0, -1))
               for p in patterns)


def select_linears(model: nn.Module, targets: Iterable[str], ignore: Iterable[str],
                   optional_ignore: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """Names of nn.Linear modules to quantize, and names of nn.Linear modules left unquantized.

    A linear is left unquantized when an `ignore` or `optional_ignore` pattern matches it or a module
    holding it. `optional_ignore` (a recipe's default list: the output head) applies where it matches and
    is never reported. Raises QuantizationError when no module matches (naming what the model's linears
    look like), and when a target or ignore entry matches no quantizable module (check_every_pattern_matches).
    """
    targets, ignore = list(targets), list(ignore)
    skip = ignore + list(optional_ignore)
    module_of = dict(model.named_modules())
    chosen, skipped = [], []
    for name, module in module_of.items():
        if not quantizable(module):
            continue
        if any(matches(name, module, p) for p in targets) and not _ignored(name, module_of, skip):
            chosen.append(name)
        else:
            skipped.append(name)
    if not chosen:
        examples = ", ".join(skipped[:4]) or "none"
        raise QuantizationError(
            f"no nn.Linear module matches targets {targets} minus ignore {skip} in {type(model).__name__} "
            f"(its linears: {examples}); quantkit quantizes models whose layers are torch.nn.Linear: "
            f"adjust the recipe's targets/ignore"
        )
    check_every_pattern_matches(model, targets, ignore)
    return chosen, skipped


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def output_head_name(model: nn.Module) -> str | None:
    """The module path of the model's output head (`get_output_embeddings()`), None where it has none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
