"""`quantkit inspect DIR`: the scheme of each layer and the sizes, read from the files alone."""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("inspect", help="show each layer's scheme and the sizes of a checkpoint")
    p.add_argument("path", help="checkpoint folder")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from safetensors import safe_open

    from quantkit.formats.compressed_tensors import parse_quantization_config
    from quantkit.formats.safetensors_io import check_complete, safetensors_files
    from quantkit.loading import read_config_json, resolve_model_source
    from quantkit.summaries import human_bytes

    folder = Path(resolve_model_source(args.path))
    config = read_config_json(folder)
    qcfg = config.get("quantization_config")
    parsed = parse_quantization_config(qcfg, str(folder)) if qcfg else None
    layers: dict[str, dict[str, tuple]] = defaultdict(dict)  # module -> tensor name -> (shape, dtype, bytes)
    shapes, weight_shapes = {}, {}  # every tensor's shape; the values of each weight_shape
    for path in safetensors_files(folder):
        check_complete(path)
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
                nbytes = _numel(shape) * _DTYPE_BYTES.get(dtype, 4)
                module, _, tensor = key.rpartition(".")
                shapes[key] = shape
                if tensor == "weight_shape":
                    shape = tuple(int(v) for v in f.get_tensor(key).reshape(-1))  # (out, in), checked below
                    weight_shapes[key] = list(shape)
                layers[module][tensor] = (shape, dtype, nbytes)
    validated = _validate_shapes(folder, shapes, weight_shapes) if parsed else None
    print(f"{folder}  ({config.get('model_type', '?')}, {', '.join(config.get('architectures') or [])})")
    if parsed:
        for i, (targets, scheme) in enumerate(parsed.groups):
            shown = targets if len(targets) <= 3 else targets[:3] + [f"... {len(targets) - 3} more"]
            print(f"  group {i}: {scheme.describe()} ({scheme.bits_per_weight:.3f} bits/weight) targets {shown}")
        print(f"  ignored: {', '.join(parsed.ignore) or 'none'}")
        print(f"  kv cache: {parsed.kv_cache.describe() if parsed.kv_cache else 'not quantized'}")
        print(f"  shapes: {validated}")
    else:
        print("  not quantized")
    total = quantized = weights = 0
    rows = []
    for module, tensors in layers.items():
        size = sum(b for _, _, b in tensors.values())
        total += size
        if "weight_packed" in tensors:
            n, k = tensors["weight_shape"][0]
            quantized += size
            weights += n * k
            rows.append((module, f"[{n}, {k}]", _scheme_of(parsed, module, k), human_bytes(size)))
        elif "weight" in tensors and len(tensors["weight"][0]) == 2:
            rows.append((module, str(list(tensors["weight"][0])), tensors["weight"][1].lower(), human_bytes(size)))
    width = max((len(r[0]) for r in rows), default=10)
    print(f"\n  {'module':<{width}}  {'shape [out, in]':<16} {'scheme':<21} size")
    for r in rows:
        print(f"  {r[0]:<{width}}  {r[1]:<16} {r[2]:<21} {r[3]}")
    print(f"\n  total {human_bytes(total)}; quantized linears {human_bytes(quantized)}"
          + (f" = {quantized * 8 / weights:.3f} bits/weight" if weights else ""))
    print("\n".join(size_summary_lines(size_by_kind(layers))))
    return 0


def _validate_shapes(folder: Path, shapes: dict, weight_shapes: dict) -> str:
    """Check every tensor's shape (and weight_shape's values) against the model config.json describes;
    raises CheckpointError on a mismatch. Returns what was checked, for the printout."""
    from quantkit.errors import CheckpointError
    from quantkit.formats.shapes import raise_on_mismatch, shape_mismatches
    from quantkit.loading import empty_quantized_model

    try:
        model, _, _ = empty_quantized_model(folder)
    except CheckpointError as e:  # an architecture this transformers does not know: nothing to check against
        return f"not checked ({e})"
    raise_on_mismatch(folder, shape_mismatches(model, shapes, weight_shapes))
    return "every tensor matches config.json"


# What each kind of tensor is, in the order the summary lists them.
SIZE_KINDS = {
    "packed weights": "weight_packed: int weights packed into int32 words",
    "scales": "weight_scale",
    "zero points": "weight_zero_point (asymmetric schemes)",
    "float embeddings": "token (and position) embedding tables",
    "float linears": "linears left in full precision (the recipe's ignore list, e.g. an untied lm_head)",
    "norms, biases": "1-D float tensors",
    "metadata": "weight_shape, k_scale / v_scale",
}


def size_by_kind(layers: dict[str, dict[str, tuple]]) -> dict[str, int]:
    """Bytes of a checkpoint's tensors by kind (keys of SIZE_KINDS).

    layers: module name -> tensor name -> (shape, safetensors dtype, bytes), as read from the files.
    """
    sizes = dict.fromkeys(SIZE_KINDS, 0)
    for module, tensors in layers.items():
        for tensor, (shape, _, nbytes) in tensors.items():
            if tensor == "weight_packed":
                kind = "packed weights"
            elif tensor == "weight_scale":
                kind = "scales"
            elif tensor == "weight_zero_point":
                kind = "zero points"
            elif tensor in ("weight_shape", "k_scale", "v_scale"):
                kind = "metadata"
            elif tensor == "weight" and len(shape) == 2:
                kind = "float embeddings" if "embed" in module.rsplit(".", 1)[-1] else "float linears"
            else:
                kind = "norms, biases"
            sizes[kind] += nbytes
    return sizes


def size_summary_lines(sizes: dict[str, int]) -> list[str]:
    """The size summary ``inspect`` prints: bytes and share of the total of each kind present."""
    from quantkit.summaries import human_bytes

    total = sum(sizes.values())
    lines = ["", f"  size by kind (tensor bytes in the safetensors files, {human_bytes(total)} in all):"]
    for kind, nbytes in sizes.items():
        if nbytes:
            lines.append(f"    {kind:<17} {human_bytes(nbytes):>10}  {nbytes / total:6.1%}  {SIZE_KINDS[kind]}")
    return lines


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _scheme(parsed, module):
    from torch import nn

    return parsed.scheme_for(module, nn.Linear(1, 1, device="meta"))


def _scheme_of(parsed, module, in_features: int) -> str:
    """The layer's scheme in words; "ragged" when its group size does not divide in_features (shorter last group)."""
    s = _scheme(parsed, module) if parsed else None
    if s is None:
        return "?"
    return s.describe() + ("" if s.divides(in_features) else " ragged")
