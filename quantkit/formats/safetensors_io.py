"""Reading and writing (sharded) safetensors state dicts, with corruption checks. Never pickles."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_state_dict(state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int = 4 << 30) -> list[str]:
    """Write `state` as model.safetensors, or as shards plus model.safetensors.index.json."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        b = _tensor_bytes(tensor)
        if shards[-1] and size + b > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        size += b
    from ..outputs import give_default_mode

    if len(shards) == 1:
        _save_file(shards[0], folder / SINGLE_FILE)
        give_default_mode(folder / SINGLE_FILE)
        return [SINGLE_FILE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_file(shard, folder / fname)
        give_default_mode(folder / fname)
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(_tensor_bytes(t) for t in state.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file; its I/O errors (reported as SafetensorError, "... (os error N)") come back as
    the OSError they are, so that a full disk reads as one."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except Exception as e:  # safetensors raises its own error types
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number), str(path)) from e


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a model folder; raises CheckpointError when there are none or some are missing."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e}); re-create the checkpoint") from None
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{folder}: shard(s) listed in {INDEX_FILE} are missing: {', '.join(missing)}")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
    hint = (
        f" (found {', '.join(pickles)}: quantkit never loads pickled weights; convert them to safetensors)"
        if pickles else ""
    )
    raise CheckpointError(f"{folder} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")


# Bytes per element of each safetensors dtype.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
#: safetensors dtype names of the floating types, and their torch dtypes.
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def stored_float_dtype(folder: Path) -> torch.dtype | None:
    """The floating dtype holding most floating-point bytes of a model folder's weights as stored on
    disk (e.g. bfloat16 for weights saved in bf16, whatever config.json's dtype says); None when
    the folder has no floating tensors."""
    bytes_by_dtype: dict[str, int] = {}
    for path in safetensors_files(Path(folder)):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                name = sl.get_dtype()
                if name in FLOAT_DTYPES:
                    numel = 1
                    for d in sl.get_shape():
                        numel *= d
                    bytes_by_dtype[name] = bytes_by_dtype.get(name, 0) + numel * FLOAT_DTYPES[name].itemsize
    if not bytes_by_dtype:
        return None
    return FLOAT_DTYPES[max(bytes_by_dtype, key=bytes_by_dtype.get)]


def check_complete(path: Path) -> None:
    """Raise CheckpointError if the file is shorter than its header says (a truncated write), or if its
    header lies: offsets that overlap, leave gaps, run past the end or do not match a tensor's shape and dtype."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated ({size} bytes): re-create or re-download it")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CheckpointError(f"{path} is truncated or corrupt (header of {header_len} bytes in a {size}-byte file): re-create or re-download it")
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            raise CheckpointError(f"{path} has a corrupt header: re-create or re-download it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt header (not a JSON object): re-create or re-download it")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(v) for v in info["data_offsets"])
            numel = 1
            for d in info["shape"]:
                numel *= int(d)
            nbytes = numel * DTYPE_BYTES[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: the header entry of {name!r} is malformed ({info!r}); re-create or re-download it"
            ) from None
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(
                f"{path}: the header gives {name!r} bytes {begin}..{end}, but its shape {info['shape']} in "
                f"{info['dtype']} takes {nbytes} bytes; the file is corrupt: re-create or re-download it"
            )
        spans.append((begin, end, name))
    spans.sort()
    expected = 0
    for begin, end, name in spans:
        if begin != expected:
            what = "overlap the tensor before it" if begin < expected else f"leave a gap of {begin - expected} bytes"
            raise CheckpointError(f"{path}: the offsets the header gives {name!r} {what}; the file is corrupt: "
                                  f"re-create or re-download it")
        expected = end
    if 8 + header_len + expected > size:
        raise CheckpointError(
            f"{path} is truncated: its header describes {8 + header_len + expected} bytes but the file has {size}; "
            f"re-create or re-download it"
        )


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a model folder (memory-mapped where possible)."""
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        check_complete(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    state[key] = f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{path} could not be read ({e}); re-create or re-download it") from None
    return state
