"""Broken checkpoints, corrupt weight files and wrong baselines."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from .robustness_cases import Case, _copy, _rewrite_header, checkpoint, float_folder

LINEAR = "model.layers.0.mlp.down_proj"  # in the tiny model: [out 128, in 384], int4 g128 -> scale [128, 3]
SHARD = "model-00001-of-00001.safetensors"


def _edit_tensors(folder: Path, edit: Callable[[dict], None]) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _edit_config(folder: Path, edit: Callable[[dict], None]) -> Path:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _edit_header(folder: Path, edit: Callable[[dict], None]) -> Path:
    """Change model.safetensors' JSON header in place (the tensor bytes stay as they are)."""
    _rewrite_header(folder / "model.safetensors", edit)
    return folder


def _sharded(folder: Path, place: Callable[[Path], str], edit_index: Callable[[dict], None] = lambda index: None) -> Path:
    """Turn model.safetensors into one shard listed by an index; place(shard path) -> the weight_map's entry."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    shard = folder / SHARD
    (folder / "model.safetensors").rename(shard)
    index = {"metadata": {"total_size": shard.stat().st_size}, "weight_map": dict.fromkeys(names, place(shard))}
    edit_index(index)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _outside(work: Path, shard: Path) -> str:
    """Move a shard out of its model folder; returns its new absolute path."""
    away = work / "elsewhere"
    away.mkdir(exist_ok=True)
    return str(shard.rename(away / shard.name))


def _eval(folder: Path) -> list[str]:
    return ["eval", str(folder), "--baseline", "ref:tiny", "--max-tokens", "512"]


def _command(command: str, folder: Path, work: Path) -> list[str]:
    quantize = ["quantize", str(folder), "--recipe", "w4a16-rtn", "--out", str(work / "out")]
    return {"quantize": quantize, "eval": _eval(folder), "inspect": ["inspect", str(folder)]}[command]


def _set_scale(value: float):
    def setup(work):
        def edit(tensors):
            tensors[f"{LINEAR}.weight_scale"][5, 1] = value

        return _eval(_edit_tensors(_copy(checkpoint(work), work / "ck"), edit))

    return setup


def _retyped(name: str, dtype: str):
    def setup(work):
        import torch

        def edit(tensors):
            tensors[f"{LINEAR}.{name}"] = tensors[f"{LINEAR}.{name}"].to(getattr(torch, dtype))

        return _eval(_edit_tensors(_copy(checkpoint(work), work / "ck"), edit))

    return setup


def _lost_quantization_config(work):
    folder = _edit_config(_copy(checkpoint(work), work / "ck"), lambda c: c.pop("quantization_config"))
    return _eval(folder)


def _untargeted_groups(work):
    def edit(config):
        config["quantization_config"]["config_groups"]["group_0"]["targets"] = ["Conv2d"]

    return _eval(_edit_config(_copy(checkpoint(work), work / "ck"), edit))


def _config_groups_list(work):
    def edit(config):
        config["quantization_config"]["config_groups"] = [config["quantization_config"]["config_groups"]["group_0"]]

    return _eval(_edit_config(_copy(checkpoint(work), work / "ck"), edit))


def _narrow_baseline(work):
    """A model with the tiny model's vocabulary and tokenizer, but hidden size 64."""
    dest = work / "hidden-64"
    import torch
    import transformers

    tiny = float_folder(work)
    config = transformers.AutoConfig.from_pretrained(tiny)
    config.update(dict(hidden_size=64, head_dim=16, intermediate_size=192))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny / name, dest / name)
    return ["eval", str(checkpoint(work)), "--baseline", str(dest), "--max-tokens", "512"]


def _retrained_baseline(work):
    """The tiny model's exact architecture and tokenizer with other weights (its embeddings shuffled)."""
    import torch

    def edit(tensors):
        table = tensors["model.embed_tokens.weight"]
        tensors["model.embed_tokens.weight"] = table[torch.randperm(table.shape[0], generator=torch.Generator().manual_seed(0))]

    folder = _edit_tensors(_copy(float_folder(work), work / "other-tiny"), edit)
    return ["eval", str(checkpoint(work)), "--baseline", str(folder), "--max-tokens", "512"]


def _missing_tensor(name: str, command: str):
    def setup(work):
        folder = _edit_tensors(_copy(checkpoint(work), work / "ck"), lambda t: t.pop(f"{LINEAR}.{name}"))
        return ["inspect", str(folder)] if command == "inspect" else _eval(folder)

    return setup


def _unexpected_tensor(work):
    import torch

    folder = _edit_tensors(_copy(checkpoint(work), work / "ck"),
                           lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.ones(4, 4)}))
    return ["inspect", str(folder)]


def _stray_kv_scales(work):
    import torch

    def edit(tensors):
        for layer in (0, 1):
            for name in ("k_scale", "v_scale"):
                tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.ones(1, dtype=torch.bfloat16)

    return _eval(_edit_tensors(_copy(checkpoint(work), work / "ck"), edit))


def _metadata(value, source: str, command: str):
    def setup(work):
        folder = _copy(checkpoint(work) if source == "checkpoint" else float_folder(work), work / source)
        _edit_header(folder, lambda h: h.update({"__metadata__": value}))
        return _command(command, folder, work)

    return setup


def _index(source: str, place: str, command: str):
    def setup(work):
        folder = _copy(checkpoint(work) if source == "checkpoint" else float_folder(work), work / source)
        where = {
            "absolute": lambda shard: _outside(work, shard),
            "parent": lambda shard: "../elsewhere/" + Path(_outside(work, shard)).name,
            "list": lambda shard: shard.name,
            "no-metadata": lambda shard: shard.name,
        }[place]
        edit = {"list": lambda index: index.update(weight_map=list(index["weight_map"].items())),
                "no-metadata": lambda index: index.pop("metadata")}.get(place, lambda index: None)
        _sharded(folder, where, edit)
        return _command(command, folder, work)

    return setup


CASES = [
    Case("ck-lost-quantization-config", "a checkpoint whose config.json lost its `quantization_config`",
         _lost_quantization_config, "but its config.json has no quantization_config"),
    Case("ck-untargeted-groups", "a checkpoint whose `config_groups` target no linear", _untargeted_groups,
         "quantization_config does not quantize"),
    Case("ck-config-groups-list", "a checkpoint whose `config_groups` is a list", _config_groups_list,
         "config_groups must map group names to objects"),
    Case("ck-baseline-other-shapes", "a baseline of the same vocabulary but hidden size 64", _narrow_baseline,
         "hidden_size 128 in the model, 64 in the baseline"),
    Case("ck-baseline-other-weights", "a baseline of the same shapes but other weights", _retrained_baseline,
         "the input embeddings differ"),
    Case("ck-scale-zero", "a `weight_scale` of 0", _set_scale(0.0), f"{LINEAR}.weight_scale: 1 of 384 values, e.g. 0)"),
    Case("ck-scale-negative", "a negative `weight_scale`", _set_scale(-0.01),
         f"scales must be positive normal numbers ({LINEAR}.weight_scale: 1 of 384 values, e.g. -0.01"),
    Case("ck-scale-denormal", "a denormal `weight_scale` (1e-40)", _set_scale(1e-40),
         f"scales must be positive normal numbers ({LINEAR}.weight_scale: 1 of 384 values, e.g. 9."),
    Case("ck-inspect-missing-scale", "`inspect` of a checkpoint missing a `weight_scale`",
         _missing_tensor("weight_scale", "inspect"), f"missing: {LINEAR}.weight_scale"),
    Case("ck-inspect-missing-shape", "`inspect` of a checkpoint missing a `weight_shape`",
         _missing_tensor("weight_shape", "inspect"), f"missing: {LINEAR}.weight_shape"),
    Case("ck-eval-missing-shape", "a checkpoint missing a `weight_shape`", _missing_tensor("weight_shape", "eval"),
         f"missing: {LINEAR}.weight_shape"),
    Case("ck-inspect-unexpected", "`inspect` of a checkpoint with a tensor the model does not have",
         _unexpected_tensor, "unexpected: model.layers.0.mlp.extra_proj.weight"),
    Case("ck-stray-kv-scales", "k_scale / v_scale tensors without a `kv_cache_scheme`", _stray_kv_scales,
         "unexpected: model.layers.0.self_attn.k_scale"),
    Case("ck-packed-float", "`weight_packed` stored as float32", _retyped("weight_packed", "float32"),
         f"{LINEAR}.weight_packed is F32, expected I32"),
    Case("ck-packed-int64", "`weight_packed` stored as int64", _retyped("weight_packed", "int64"),
         f"{LINEAR}.weight_packed is I64, expected I32"),
    Case("ck-packed-int8", "`weight_packed` stored as int8", _retyped("weight_packed", "int8"),
         f"{LINEAR}.weight_packed is I8, expected I32"),
    Case("ck-scale-int32", "`weight_scale` stored as int32", _retyped("weight_scale", "int32"),
         f"{LINEAR}.weight_scale is I32, expected F16, BF16, F32 or F64"),
    Case("ck-metadata-list-inspect", "`inspect` of a checkpoint whose safetensors `__metadata__` is a list",
         _metadata([1, 2], "checkpoint", "inspect"), "__metadata__ must map names to strings"),
    Case("ck-metadata-int-eval", "a checkpoint whose safetensors `__metadata__` is an int",
         _metadata(3, "checkpoint", "eval"), "__metadata__ must map names to strings"),
    Case("ck-metadata-nested-quantize", "a source model whose safetensors `__metadata__` holds a nested dict",
         _metadata({"format": {"nested": "pt"}}, "source", "quantize"), "__metadata__ must map names to strings",
         creates="out"),
    Case("ck-metadata-list-quantize", "a source model whose safetensors `__metadata__` is a list",
         _metadata(["pt"], "source", "quantize"), "__metadata__ must map names to strings", creates="out"),
    Case("ck-index-absolute", "an index whose weight_map names an absolute path outside the checkpoint",
         _index("checkpoint", "absolute", "eval"), "outside the model folder"),
    Case("ck-index-parent-quantize", "a source model's index naming `../` shards", _index("source", "parent", "quantize"),
         "outside the model folder", creates="out"),
    Case("ck-index-absolute-quantize", "a source model's index naming an absolute path",
         _index("source", "absolute", "quantize"), "outside the model folder", creates="out"),
    Case("ck-index-list", "an index whose weight_map is a list", _index("checkpoint", "list", "inspect"),
         "'weight_map' must be a non-empty object"),
    Case("ck-index-list-quantize", "a source model's index whose weight_map is a list",
         _index("source", "list", "quantize"), "'weight_map' must be a non-empty object", creates="out"),
    Case("ck-index-no-metadata-quantize", "a source model's index without `metadata`",
         _index("source", "no-metadata", "quantize"), "'metadata' must be an object", creates="out"),
]
