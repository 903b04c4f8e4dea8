"""Reading and writing (sharded) safetensors state dicts, with corruption checks. Never pickles."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from ..core.errors import CheckpointError
from ..files.outputs import give_default_mode

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
    if len(shards) == 1:
        save_safetensors_file(shards[0], folder / SINGLE_FILE)
        give_default_mode(folder / SINGLE_FILE)
        return [SINGLE_FILE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors_file(shard, folder / fname)
        give_default_mode(folder / fname)
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(_tensor_bytes(t) for t in state.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def save_safetensors_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write `tensors` (contiguous, on the CPU) as one safetensors file, one tensor at a time.

    The file is byte for byte what safetensors' save_file writes (tensors ordered by dtype as DATA_ORDER,
    then by name, so that every tensor starts at a multiple of its element size; a compact JSON header with
    ``{"format": "pt"}`` metadata, padded with spaces to a multiple of 8 bytes), but save_file first copies
    every tensor into a bytes object of its own, so a shard costs its whole size in memory while it is
    written; here tensors go to the file one by one as they are (memory-mapped ones from the page cache).
    """
    rank = {name: i for i, name in enumerate(DATA_ORDER)}
    order = sorted(tensors, key=lambda n: (rank[SAFETENSORS_DTYPES[tensors[n].dtype]], n))
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + _tensor_bytes(t)]}
        offset += _tensor_bytes(t)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            t = tensors[name]
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def _index_weight_map(folder: Path) -> dict[str, str]:
    """The weight map of ``model.safetensors.index.json``, checked: a JSON object whose ``weight_map`` maps
    tensor names to shard files inside `folder` and whose ``metadata`` is an object (transformers reads it)."""
    index = folder / INDEX_FILE
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index} is not valid JSON ({e}); re-create the checkpoint") from None
    fix = "fix the index or re-create the checkpoint"
    if not isinstance(data, dict):
        raise CheckpointError(f"{index} holds a JSON {type(data).__name__}, not an object with 'metadata' and "
                              f"'weight_map'; {fix}")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: 'weight_map' must be a non-empty object {{tensor name: shard file}}, "
                              f"found {_shown(weight_map)}; {fix}")
    if not isinstance(data.get("metadata"), dict):
        raise CheckpointError(f"{index}: 'metadata' must be an object (e.g. {{\"total_size\": BYTES}}), found "
                              f"{_shown(data.get('metadata'))}; {fix}")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise CheckpointError(f"{index}: the weight_map entry of {name!r:.100} is {_shown(file)}, not a shard file "
                                  f"name; {fix}")
        if Path(file).is_absolute() or ".." in Path(file).parts:  # by name: a shard may be a link (hub cache)
            raise CheckpointError(f"{index}: the weight_map places {name!r:.100} in {file!r:.100}, outside the model "
                                  f"folder (shards are named relative to the folder that holds the index); {fix}")
    return weight_map


def _shown(value, limit: int = 60) -> str:
    """A JSON value as an error message quotes it: its type, and its text cut to `limit` characters."""
    text = repr(value)
    return f"{text[:limit]}{'...' if len(text) > limit else ''} (a {type(value).__name__})"


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a model folder; raises CheckpointError when there are none, some are missing, or
    the index is malformed (see _index_weight_map)."""
    if (folder / INDEX_FILE).is_file():
        files = sorted({folder / f for f in _index_weight_map(folder).values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{folder}: shard(s) listed in {INDEX_FILE} are missing: {', '.join(missing)}")
        if (folder / SINGLE_FILE).exists() and folder / SINGLE_FILE not in files:
            raise CheckpointError(f"{folder} holds both {SINGLE_FILE} and the {len(files)} shard(s) {INDEX_FILE} "
                                  f"lists: transformers reads {SINGLE_FILE}, quantkit would read the shards, and "
                                  f"they need not hold the same weights; remove the one that is not the model")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
    hint = (
        f" (found {', '.join(pickles)}: quantkit never loads pickled weights; convert them to safetensors)"
        if pickles else ""
    )
    raise CheckpointError(f"{folder} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")


#: safetensors dtype name -> torch dtype, for every dtype safetensors' torch reader knows.
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
    "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64,
}
#: torch dtype -> its safetensors name.
SAFETENSORS_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}
#: The order of the dtypes in a safetensors file's data, as safetensors writes it (its Dtype enum, last first).
DATA_ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E5M2FNUZ",
              "F8_E4M3FNUZ", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
#: safetensors dtype names of the floating types, and their torch dtypes.
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class TensorHeader(NamedTuple):
    """One tensor as a safetensors header describes it: dtype name ("BF16", "I32", ...) and shape."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * TORCH_DTYPES[self.dtype].itemsize


def read_header(path: Path) -> dict[str, TensorHeader]:
    """{tensor name: TensorHeader} of one safetensors file, after checking that the file is whole and its
    header well formed: a JSON object whose ``__metadata__`` (optional) maps strings to strings and whose
    every other entry gives a known dtype, a shape of non-negative integers and the offsets of exactly the
    bytes that shape takes, the tensors tiling the data without gaps or overlaps. Raises CheckpointError."""
    fix = "re-create or re-download it"
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated ({size} bytes): {fix}")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CheckpointError(f"{path} is truncated or corrupt (header of {header_len} bytes in a {size}-byte "
                                  f"file): {fix}")
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{path} has a corrupt header (not JSON): {fix}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt header (not a JSON object): {fix}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: the header's __metadata__ must map names to strings, found "
                              f"{_shown(metadata)}; the file is corrupt: {fix}")
    tensors, spans = {}, []
    for name, info in header.items():
        entry = _header_entry(info)
        if entry is None:
            raise CheckpointError(f"{path}: the header entry of {name!r:.100} is malformed ({_shown(info)}; expected "
                                  f"{{\"dtype\": ..., \"shape\": [...], \"data_offsets\": [begin, end]}} with a dtype "
                                  f"of {', '.join(TORCH_DTYPES)}); {fix}")
        (dtype, shape), (begin, end) = entry
        tensors[name] = TensorHeader(dtype, shape)
        if end - begin != tensors[name].nbytes or begin < 0:
            raise CheckpointError(
                f"{path}: the header gives {name!r:.100} bytes {begin}..{end}, but its shape {list(shape)} in "
                f"{dtype} takes {tensors[name].nbytes} bytes; the file is corrupt: {fix}"
            )
        spans.append((begin, end, name))
    spans.sort()
    expected = 0
    for begin, end, name in spans:
        if begin != expected:
            what = "overlap the tensor before it" if begin < expected else f"leave a gap of {begin - expected} bytes"
            raise CheckpointError(f"{path}: the offsets the header gives {name!r:.100} {what}; the file is corrupt: "
                                  f"{fix}")
        expected = end
    if 8 + header_len + expected > size:
        raise CheckpointError(
            f"{path} is truncated: its header describes {8 + header_len + expected} bytes but the file has {size}; "
            f"{fix}"
        )
    return tensors


def _header_entry(info) -> tuple[tuple[str, tuple[int, ...]], tuple[int, int]] | None:
    """((dtype, shape), (begin, end)) of a well-formed header entry, else None."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        return None
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in TORCH_DTYPES or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        return None
    if not all(type(v) is int and v >= 0 for v in shape + offsets):
        return None
    return (dtype, tuple(shape)), (offsets[0], offsets[1])


def folder_tensors(folder: Path) -> dict[str, TensorHeader]:
    """{tensor name: TensorHeader} over every weight file of a model folder (read_header checks each file;
    a tensor stored in two files is refused)."""
    tensors: dict[str, TensorHeader] = {}
    where: dict[str, Path] = {}
    for path in safetensors_files(Path(folder)):
        for name, header in read_header(path).items():
            if name in tensors:
                raise CheckpointError(f"{folder}: {name!r:.100} is stored twice, in {where[name].name} and "
                                      f"{path.name}; the checkpoint is corrupt: re-create it")
            tensors[name], where[name] = header, path
    return tensors


def stored_float_dtype(folder: Path) -> torch.dtype | None:
    """The floating dtype holding most floating-point bytes of a model folder's weights as stored on
    disk (e.g. bfloat16 for weights saved in bf16, whatever config.json's dtype says); None when
    the folder has no floating tensors."""
    bytes_by_dtype: dict[str, int] = {}
    for header in folder_tensors(Path(folder)).values():
        if header.dtype in FLOAT_DTYPES:
            bytes_by_dtype[header.dtype] = bytes_by_dtype.get(header.dtype, 0) + header.nbytes
    if not bytes_by_dtype:
        return None
    return FLOAT_DTYPES[max(bytes_by_dtype, key=bytes_by_dtype.get)]


def read_state_dict(folder: Path, names: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a model folder (all, or those whose name `names` accepts), each file checked by
    read_header first."""
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        read_header(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if names is None or names(key):
                        state[key] = f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{path} could not be read ({e}); re-create or re-download it") from None
    return state
