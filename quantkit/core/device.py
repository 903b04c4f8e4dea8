"""Device names given by users, checked against this machine before any work."""

from __future__ import annotations

import os

import torch

from .errors import UsageError


def resolve_device(device: "str | torch.device", *, option: str = "device") -> torch.device:
    """A torch.device for `device` ("cpu", "cuda", "cuda:1", ...); UsageError when the name is malformed,
    names the meta device (shapes without data: nothing can be computed or saved there) or the device is
    not on this machine. option: how the caller names the setting in messages."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"{option} {device!r} is not a device name; use cpu, cuda or cuda:N") from None
    if d.type == "meta":
        raise UsageError(f"{option} {device!r}: the meta device holds tensor shapes without their values, so "
                         f"nothing can be computed or saved there; use cpu or cuda")
    if d.type == "cpu":
        return d
    backend = getattr(torch, d.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise UsageError(f"{option} {device!r}: this machine has no {d.type.upper()} device (or PyTorch was built "
                         f"without {d.type.upper()} support); use cpu")
    count = getattr(backend, "device_count", lambda: 1)()
    if d.index is not None and d.index >= count:
        raise UsageError(f"{option} {device!r}: this machine has {count} {d.type.upper()} device(s), numbered from 0")
    return d


def check_cpu_threads(threads: int, *, option: str = "--threads") -> int:
    """`threads` (CPU threads for torch) when 1 <= threads <= this machine's CPUs; UsageError otherwise
    (OpenMP aborts, or crashes, creating thousands of threads)."""
    cpus = os.cpu_count() or 1
    if not 1 <= threads <= cpus:
        raise UsageError(f"{option} {threads}: this machine has {cpus} CPUs; give {option} 1 to {cpus}")
    return threads


def check_backend(name: str, device=None) -> str:
    """`--backend` value, checked before any work (UsageError listing the backends, or saying why the
    backend cannot run on `device` when one is given)."""
    # triton loads with the kernels: only once a backend is checked
    from ..kernels.backend_choice import BACKENDS, resolve_backend

    if name not in BACKENDS:
        raise UsageError(f"--backend {name!r} is unknown; choose one of {', '.join(BACKENDS)}")
    if device is not None:
        try:
            resolve_backend(name, device)
        except ValueError as e:
            raise UsageError(f"--backend {name}: {e}") from None
    return name
