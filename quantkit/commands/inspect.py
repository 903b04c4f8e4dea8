"""`quantkit inspect DIR`: the scheme of each layer and the sizes, read from the files alone."""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path

from quantkit.core.errors import CheckpointError
from quantkit.core.units import human_bytes


def register(sub) -> None:
    p = sub.add_parser("inspect", help="show each layer's scheme and the sizes of a checkpoint")
    p.add_argument("path", help="checkpoint folder, or a GGUF file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from quantkit.gguf.reading import is_gguf_file

    if is_gguf_file(args.path):
        return inspect_gguf(args.path)
    from quantkit.formats.compressed_tensors import parse_quantization_config
    from quantkit.formats.safetensors_io import folder_tensors, read_state_dict
    from quantkit.formats.shapes import SCALE_TENSORS
    from quantkit.formats.loading import read_config_json, refuse_quantized_tensors, resolve_model_source

    folder = Path(resolve_model_source(args.path))
    config = read_config_json(folder)
    headers = folder_tensors(folder)  # every file's header checked
    if "quantization_config" in config:
        parsed = parse_quantization_config(config["quantization_config"], str(folder / "config.json"))
    else:
        refuse_quantized_tensors(folder, headers)
        parsed = None
    values = read_state_dict(folder, lambda name: name.rpartition(".")[2] in ("weight_shape", *SCALE_TENSORS))
    checked = _check_tensors(folder, parsed, headers, values) if parsed else None
    layers: dict[str, dict[str, tuple]] = defaultdict(dict)  # module -> tensor name -> (shape, dtype, bytes)
    for key in sorted(headers):
        module, _, tensor = key.rpartition(".")
        shape = headers[key].shape
        if tensor == "weight_shape":
            shape = tuple(int(v) for v in values[key].reshape(-1))  # (out, in)
        layers[module][tensor] = (shape, headers[key].dtype, headers[key].nbytes)
    print(f"{folder}  ({config.get('model_type', '?')}, {', '.join(config.get('architectures') or [])})")
    stored = stored_bits(parsed, layers) if parsed else {}
    if parsed:
        for i, (targets, scheme) in enumerate(parsed.groups):
            shown = targets if len(targets) <= 3 else targets[:3] + [f"... {len(targets) - 3} more"]
            print(f"  group {i}: {scheme.describe()} ({_bits_text(*stored.get(i, (0, 0, 0)))} stored) targets {shown}")
        print(f"  ignored: {', '.join(parsed.ignore) or 'none'}")
        print(f"  kv cache: {parsed.kv_cache.describe() if parsed.kv_cache else 'not quantized'}")
        print(f"  tensors: {checked}")
    else:
        print("  not quantized")
    rows = []
    for module, tensors in layers.items():
        size = sum(b for _, _, b in tensors.values())
        if "weight_packed" in tensors:
            out_in = _out_in(tensors)
            shape = str(list(out_in)) if out_in else "?"
            rows.append((module, shape, _scheme_of(parsed, module, out_in[1] if out_in else None), human_bytes(size)))
        elif "weight" in tensors and len(tensors["weight"][0]) == 2:
            rows.append((module, str(list(tensors["weight"][0])), tensors["weight"][1].lower(), human_bytes(size)))
    width = max((len(r[0]) for r in rows), default=10)
    print(f"\n  {'module':<{width}}  {'shape [out, in]':<16} {'scheme':<21} size")
    for r in rows:
        print(f"  {r[0]:<{width}}  {r[1]:<16} {r[2]:<21} {r[3]}")
    total = sum(nbytes for tensors in layers.values() for _, _, nbytes in tensors.values())
    bits, weights, linears = (sum(v) for v in zip(*stored.values())) if stored else (0, 0, 0)
    print(f"\n  total {human_bytes(total)}"
          + (f"; quantized linears ({linears}): {human_bytes(bits / 8)} of {', '.join(WEIGHT_TENSORS)} "
             f"= {bits / weights:.3f} bits/weight (their weight_shape and biases are counted below)"
             if weights else ""))
    print("\n".join(size_summary_lines(size_by_kind(layers))))
    return 0


def inspect_gguf(path: str) -> int:
    """Print a GGUF file's architecture, shapes and each tensor's type, shape and size, after checking the file
    as quantkit.load does (header, metadata, the tensors the architecture needs)."""
    import gguf

    from quantkit.gguf.reading import FLOAT_TYPES, read_gguf

    contents = read_gguf(path)
    hp, fields = contents.hyperparameters, contents.fields
    file_type = fields.get("general.file_type")
    try:
        file_type = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        file_type = "unknown"
    print(f"{contents.path}  (GGUF v{fields.get('GGUF.version')}, architecture {contents.architecture}, "
          f"file type {file_type})")
    print(f"  {hp.blocks} blocks, embedding {hp.embedding}, {hp.heads or '?'} heads ({hp.kv_heads or '?'} KV) of "
          f"{hp.head_dim or '?'}, "
          f"feed-forward {hp.feed_forward or '?'}, vocabulary {hp.vocab} "
          f"({fields.get('tokenizer.ggml.model', 'no')} tokenizer), context {hp.context or '?'}")
    print(f"  tensors: checked against the metadata ({len(contents.tensors)})")
    width = max((len(n) for n in contents.tensors), default=10)
    print(f"\n  {'tensor':<{width}}  {'type':<6} {'shape [in, out]':<16} size")
    for name, t in contents.tensors.items():
        print(f"  {name:<{width}}  {t.type:<6} {str(list(t.shape)):<16} {human_bytes(t.nbytes)}")
    total = sum(t.nbytes for t in contents.tensors.values())
    grid = [t for t in contents.tensors.values() if t.type not in FLOAT_TYPES]
    weights = sum(math.prod(t.shape) for t in grid)
    bits = f"; on a grid ({len(grid)}): {8 * sum(t.nbytes for t in grid) / weights:.3f} bits/weight" if weights else ""
    print(f"\n  total {human_bytes(total)}{bits}")
    return 0


#: the tensors of a quantized linear that its bits per weight count (weight_shape and a bias are not counted)
WEIGHT_TENSORS = ("weight_packed", "weight_scale", "weight_zero_point")


def stored_bits(parsed, layers: dict[str, dict[str, tuple]]) -> dict[int, tuple[int, int, int]]:
    """{group index: (bits stored, weights, linears)} over each group's quantized linears, counting the
    bytes of WEIGHT_TENSORS as they are in the files (scales in the dtype they were saved in)."""
    from torch import nn

    out: dict[int, list[int]] = {}
    for module, tensors in layers.items():
        out_in = _out_in(tensors)
        if "weight_packed" in tensors and out_in:
            totals = out.setdefault(parsed.group_of(module, nn.Linear(1, 1, device="meta")), [0, 0, 0])
            totals[0] += 8 * sum(tensors[t][2] for t in WEIGHT_TENSORS if t in tensors)
            totals[1] += out_in[0] * out_in[1]
            totals[2] += 1
    return {group: tuple(v) for group, v in out.items()}


def _out_in(tensors: dict[str, tuple]) -> tuple[int, int] | None:
    """[out, in] of a quantized linear from its weight_shape values (None when they are not two numbers:
    only a checkpoint whose architecture could not be checked gets this far with them)."""
    values = tensors.get("weight_shape", ((),))[0]
    return tuple(values) if len(values) == 2 else None


def _bits_text(bits: int, weights: int, linears: int) -> str:
    return f"{linears} linear{'s' * (linears != 1)}, {bits / weights:.3f} bits/weight" if weights else "no linears"


def _check_tensors(folder: Path, parsed, tensors: dict, values: dict) -> str:
    """Check the tensors against the model config.json describes (names, dtypes, shapes, scale values);
    raises CheckpointError on a problem. Returns what was checked, for the printout."""
    from quantkit.formats.shapes import check_checkpoint_tensors
    from quantkit.formats.loading import empty_quantized_model

    try:
        model, _, _ = empty_quantized_model(folder)
    except CheckpointError as e:  # an architecture this transformers does not know: nothing to check against
        return f"not checked ({e})"
    check_checkpoint_tensors(folder, model, tensors, values, kv_cache=parsed.kv_cache is not None)
    return "all that config.json describes and no others, each in a usable dtype and its shape; scales positive"


# What each kind of tensor is, in the order the summary lists them.
SIZE_KINDS = {
    "packed weights": "weight_packed: int weights packed into int32 words",
    "scales": "weight_scale",
    "zero points": "weight_zero_point (asymmetric schemes)",
    "float embeddings": "token (and position) embedding tables",
    "float linears": "linears left in full precision (the recipe's ignore list, e.g. an untied lm_head)",
    "norms, biases": "1-D float tensors",
    "kv scales": "k_scale / v_scale of the FP8 KV cache",
    "metadata": "weight_shape: [out, in] of each quantized linear",
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
            elif tensor in ("k_scale", "v_scale"):
                kind = "kv scales"
            elif tensor == "weight_shape":
                kind = "metadata"
            elif tensor == "weight" and len(shape) == 2:
                kind = "float embeddings" if "embed" in module.rsplit(".", 1)[-1] else "float linears"
            else:
                kind = "norms, biases"
            sizes[kind] += nbytes
    return sizes


def size_summary_lines(sizes: dict[str, int]) -> list[str]:
    """The size summary ``inspect`` prints: bytes and share of the total of each kind present."""
    total = sum(sizes.values())
    lines = ["", f"  size by kind (tensor bytes in the safetensors files, {human_bytes(total)} in all):"]
    for kind, nbytes in sizes.items():
        if nbytes:
            lines.append(f"    {kind:<17} {human_bytes(nbytes):>10}  {nbytes / total:6.1%}  {SIZE_KINDS[kind]}")
    return lines


def _scheme_of(parsed, module, in_features: int | None) -> str:
    """The layer's scheme in words; "ragged" when its group size does not divide in_features (shorter last group)."""
    from torch import nn

    s = parsed.scheme_for(module, nn.Linear(1, 1, device="meta")) if parsed else None
    if s is None:
        return "?"
    return s.describe() + ("" if in_features is None or s.divides(in_features) else " ragged")
