"""Finished quantized blocks kept in a file's pages instead of the process's memory.

Quantizing walks the model one decoder block (or, for RTN, one linear) at a time, but each quantized
block stays in memory until the model is saved: at 4 bits about 28% of its bf16 bytes, so an 8B model
would hold ~4 GB of quantized tensors on top of the block being calibrated. A BlockSpill writes each
finished module's tensors to a file and replaces them by views of that file mapped privately into memory
(a later in-place write copies the page and never reaches the file); the file is unlinked at once, so
nothing is left on disk whatever happens to the process, and its space is freed when the model is.

The mapped pages are the kernel's page cache, not the process's anonymous memory: they are read back
when the model is saved or runs, and dropped first when memory is short. With the source weights
memory-mapped as well (from_pretrained of safetensors in their stored dtype), the process itself holds
one float block, its calibration activations and the algorithm's statistics, whatever the depth.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from ..core.errors import QuantizationError

ALIGN = 64  # bytes: every tensor of a spill file starts at a cache line


class BlockSpill:
    """Moves modules' tensors into unlinked files in `folder` (which should be on a disk, not a tmpfs)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder).expanduser()
        if not self.folder.is_dir() or not os.access(self.folder, os.W_OK | os.X_OK):
            raise QuantizationError(f"spill_folder {self.folder}: not a folder this process can write in; give an "
                                    f"existing writable folder on a disk (the output's parent is a good one)")
        self.bytes = 0  # written so far: disk space held until the model is freed

    def keep(self, module: nn.Module) -> int:
        """Replace every CPU parameter and buffer of `module` (and its sub-modules) by a view of a file with
        the same values; returns the bytes written. Tensors on another device or already file-backed
        by an earlier keep are left as they are."""
        slots, tensors, seen = [], [], {}
        for owner in module.modules():
            for kind in ("_parameters", "_buffers"):
                for attr, t in getattr(owner, kind).items():
                    if t is None or t.device.type != "cpu" or getattr(t, "_quantkit_spilled", False):
                        continue
                    key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
                    if key not in seen:
                        seen[key] = len(tensors)
                        tensors.append(t.detach().contiguous())
                    slots.append((owner, kind, attr, seen[key]))
        if not tensors:
            return 0
        offsets, size = [], 0
        for t in tensors:
            size = -(-size // ALIGN) * ALIGN
            offsets.append(size)
            size += t.numel() * t.element_size()
        fd, name = tempfile.mkstemp(prefix=".quantkit-block-", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                for t, offset in zip(tensors, offsets):
                    f.seek(offset)
                    if t.numel():
                        f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                f.truncate(max(size, 1))
            storage = torch.UntypedStorage.from_file(name, shared=False, nbytes=max(size, 1))
        finally:
            os.unlink(name)
        views = []
        for t, offset in zip(tensors, offsets):
            view = torch.empty(0, dtype=t.dtype).set_(storage, offset // t.element_size(), t.shape)
            view._quantkit_spilled = True
            views.append(view)
        for owner, kind, attr, i in slots:
            old = getattr(owner, kind)[attr]
            if isinstance(old, nn.Parameter):
                old.data = views[i]
                old._quantkit_spilled = True
            else:
                getattr(owner, kind)[attr] = views[i]
        self.bytes += size
        return size
