"""The rotated-basis KV scales of a checkpoint whose FP8 cache applies a Hadamard rotation of head_dim.

``k_scale`` / ``v_scale`` in model.safetensors stay the scales of the unrotated keys and values, which
vLLM and transformers read (an engine that does not rotate reads correct scales). The rotated-basis
scales go to a file of their own beside the weights, in the safetensors format but named
``quantkit_kv_rotation.st``: engines load ``*.safetensors`` (vLLM globs the folder when there is no
index), so this suffix keeps them from loading tensors their models have no parameter for. config.json
names the file and the rotation under a top-level key of quantkit's, which other readers keep as an
unused config attribute:

    "quantkit_kv_cache_rotation": {"rotation": "hadamard", "scales_file": "quantkit_kv_rotation.st"}

The file holds ``<attention module>.k_scale`` / ``.v_scale`` ([1] or [num_kv_heads], checkpoint dtype)
of every attention layer, in the rotated basis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..core.errors import CheckpointError
from .safetensors_io import read_header, save_safetensors_file

CONFIG_KEY = "quantkit_kv_cache_rotation"
SCALES_FILE = "quantkit_kv_rotation.st"


def write_rotated_scales(folder: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write {name: scale} into folder/SCALES_FILE; returns the config.json entry (CONFIG_KEY's value)."""
    save_safetensors_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, folder / SCALES_FILE)
    return {"rotation": "hadamard", "scales_file": SCALES_FILE}


def read_rotated_scales(folder: Path, entry: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """config.json's CONFIG_KEY entry -> (rotation, {name: scale}) from the file it names, header checked;
    CheckpointError naming the problem for a malformed entry or a missing file."""
    fix = "restore the files written with the checkpoint, or re-create it"
    if not isinstance(entry, dict) or entry.get("rotation") != "hadamard" or entry.get("scales_file") != SCALES_FILE:
        raise CheckpointError(f"{folder}: config.json's {CONFIG_KEY} must be {{'rotation': 'hadamard', "
                              f"'scales_file': '{SCALES_FILE}'}}, found {str(entry)[:80]}; {fix}")
    path = folder / SCALES_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder}: config.json says the KV cache is rotated but {SCALES_FILE} is missing; {fix}")
    read_header(path)
    with safe_open(str(path), framework="pt") as f:
        return entry["rotation"], {name: f.get_tensor(name) for name in f.keys()}
