"""The compressed-tensors `quantization_config` (config.json), written and read.

Written exactly as vLLM and transformers + compressed-tensors read it: quant_method
"compressed-tensors", format "pack-quantized", quantization_status "compressed", one config group
per weight scheme, the explicit names of the linears left in full precision under `ignore`, and
`kv_cache_scheme` when the KV cache is quantized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..core.errors import CheckpointError
from ..modules.moe import model_type, router_names, to_disk_name
from ..modules.quantized_layer import COMPRESSED_TENSORS, holds_format
from ..core.scheme import QuantScheme
from ..modules.targets import check_patterns, matches

FORMAT_VERSION = "0.15.0"  # compressed-tensors layout version written into the config


@dataclass
class QuantizationConfig:
    """What a checkpoint's quantization_config says, parsed: (targets, scheme) groups, ignore, KV scheme."""

    groups: list[tuple[list[str], QuantScheme]] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    kv_cache: QuantScheme | None = None

    def group_of(self, name: str, module: nn.Module) -> int | None:
        """Index in `groups` of the group that quantizes this module (None: ignored or not targeted)."""
        if any(matches(name, module, p) for p in self.ignore):
            return None
        for i, (targets, _) in enumerate(self.groups):
            if any(matches(name, module, p) for p in targets):
                return i
        return None

    def scheme_for(self, name: str, module: nn.Module) -> QuantScheme | None:
        i = self.group_of(name, module)
        return None if i is None else self.groups[i][1]


def build_quantization_config(model: nn.Module, kv_cache: QuantScheme | None = None) -> dict[str, Any]:
    """The quantization_config dict for a model whose quantized linears hold compressed-tensors tensors
    (QuantLinear; MoE experts: the per-expert linears of quantkit.modules.QuantExperts); float linears and MoE
    routers are listed under `ignore` by name."""
    by_scheme: dict[QuantScheme, list[str]] = {}
    unquantized: list[str] = []
    mtype = model_type(model)
    routers = set(router_names(model))
    for name, module in model.named_modules():
        disk = to_disk_name(name, mtype)  # names as the checkpoint's tensors and engines' modules have them
        if holds_format(module, COMPRESSED_TENSORS):
            by_scheme.setdefault(module.scheme, []).append(disk)
        elif isinstance(module, nn.Linear) or name in routers:
            unquantized.append(disk)
    groups = {}
    for i, (scheme, names) in enumerate(by_scheme.items()):
        targets = ["Linear"] if len(by_scheme) == 1 else names
        groups[f"group_{i}"] = {
            "targets": targets,
            "weights": scheme.to_dict(),
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized" if groups else "dense",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": unquantized,
        "kv_cache_scheme": kv_cache.to_dict() if kv_cache is not None else None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "version": FORMAT_VERSION,
    }


def kv_cache_scheme_of(model: nn.Module) -> QuantScheme | None:
    """The KV-cache scheme the model's config.quantization_config names (None: no quantized KV cache)."""
    qcfg = getattr(model.config, "quantization_config", None)
    if isinstance(qcfg, dict) and qcfg.get("kv_cache_scheme"):
        return QuantScheme.from_dict(qcfg["kv_cache_scheme"])
    return None


def parse_quantization_config(qcfg: Any, where: str) -> QuantizationConfig:
    """Validate and parse a quantization_config dict; raises CheckpointError naming what is unsupported."""
    if not isinstance(qcfg, dict):
        qcfg = qcfg.to_dict() if hasattr(qcfg, "to_dict") else None
    restore = "restore the config.json written with the checkpoint, or re-create the checkpoint"
    if not isinstance(qcfg, dict):
        raise CheckpointError(f"{where}: quantization_config is not a mapping; {restore}")
    method = qcfg.get("quant_method")
    if method is None:
        raise CheckpointError(f"{where}: quantization_config has no quant_method (it is incomplete); {restore}")
    if method != "compressed-tensors":
        raise CheckpointError(
            f"{where}: quant_method {method!r} is not supported; quantkit loads compressed-tensors checkpoints "
            f"(GPTQ/AWQ checkpoints must be converted first)"
        )
    if qcfg.get("quantization_status") not in (None, "compressed"):
        raise CheckpointError(f"{where}: quantization_status {qcfg.get('quantization_status')!r}; expected 'compressed'")
    out = QuantizationConfig(ignore=_names(qcfg.get("ignore"), f"{where}: ignore", restore))
    groups = qcfg.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise CheckpointError(f"{where}: config_groups must map group names to objects, found "
                              f"{type(groups).__name__}; {restore}")
    for gname, group in groups.items():
        fmt = group.get("format") or qcfg.get("format")
        if group.get("input_activations") or group.get("output_activations"):
            raise CheckpointError(f"{where}: {gname} quantizes activations, which quantkit does not run (weight-only)")
        if group.get("weights") is None:
            continue
        if fmt != "pack-quantized":
            raise CheckpointError(f"{where}: {gname} has format {fmt!r}; quantkit reads 'pack-quantized'")
        try:
            scheme = QuantScheme.from_dict(group["weights"])
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{where}: {gname} weights are not supported: {e}") from None
        if scheme.type != "int" or scheme.strategy == "tensor":
            raise CheckpointError(f"{where}: {gname} weights are {scheme.type} per {scheme.strategy}, which quantkit "
                                  f"does not read: it runs int weights per channel or group (pack-quantized); "
                                  f"{restore}")
        targets = _names(group.get("targets"), f"{where}: {gname} targets", restore)
        out.groups.append((targets, scheme))
    kv = qcfg.get("kv_cache_scheme")
    if kv:
        try:
            out.kv_cache = QuantScheme.from_dict(kv)
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{where}: kv_cache_scheme is not supported: {e}") from None
    return out


def _names(value: Any, where: str, fix: str) -> list[str]:
    """A list of module names / patterns (targets, ignore) from the config, checked (null is an empty list)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{where} must be a list of module names or patterns, found {repr(value)[:60]}; {fix}")
    check_patterns(value, where, CheckpointError)
    return list(value)
