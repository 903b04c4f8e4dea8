"""The Linux permission a process needs before it runs AMX tile instructions, asked for once.

On Linux (>= 5.16) AMX's tile data is an XSTATE component that a process must ask for with
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; until it has, the first tile instruction of any
of its threads traps and the kernel kills the process with SIGILL. The permission is per process: every
thread has it, fork keeps it, exec drops it. PyTorch's oneDNN and the oneDNN bundled in vLLM's CPU build
ask for it before their own AMX kernels run. vLLM 0.32's own CPU kernels do not: its attention
(``cpu_attention_with_kv_cache``, ISA "amx": bf16 models with blocks of a multiple of 32 on AMX CPUs)
runs tile instructions whether or not anything in the process asked, and its bundled oneDNN asks only
when an unquantized linear of more than 1 MiB of weights reaches it (smaller ones run vLLM's SGL kernels:
``check_cpu_sgl_kernel`` in vllm/model_executor/layers/utils.py). A model whose every unquantized linear
is smaller (quantkit's small MoE test models: a 256 KiB lm_head and 8-row routers) or quantized therefore
reaches vLLM's AMX attention without the permission. quantkit's vLLM plugin asks for it in every process
vLLM loads the plugin in (quantkit/engines/vllm_wna16.py).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

from ..kernels.cpu_flags import amx_tiles

SYS_ARCH_PRCTL = 158  # x86-64 system call number of arch_prctl
ARCH_GET_XCOMP_PERM = 0x1022  # writes the process's permitted XSTATE components (a u64 bit mask)
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18  # the AMX tile data component

_WHY_REFUSED = {
    errno.EINVAL: "the kernel has no ARCH_REQ_XCOMP_PERM (Linux < 5.16)",
    errno.EOPNOTSUPP: "the kernel offers no AMX tile data (no AMX, or AMX switched off in this kernel or VM)",
    errno.ENOSPC: "a thread's alternate signal stack (sigaltstack) is too small for the tile state",
    errno.EPERM: "the process may not enable dynamic XSTATE features",
}


@dataclass(frozen=True)
class AmxPermission:
    """The outcome of ``request_amx_tile_permission``: whether it ``asked`` (a Linux x86-64 CPU with AMX),
    whether the process holds the tile-data permission now (``granted``), and in words why or why not."""

    asked: bool
    granted: bool
    reason: str


def _arch_prctl(code: int, arg: int) -> tuple[int, int]:
    """syscall(SYS_arch_prctl, code, arg) through libc: (return value, errno)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), ctypes.c_ulong(arg))
    return result, ctypes.get_errno()


def holds_amx_tile_permission(arch_prctl: Callable[[int, int], tuple[int, int]] = _arch_prctl) -> bool:
    """Whether this process may run AMX tile instructions now (ARCH_GET_XCOMP_PERM's mask has bit 18)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    mask = ctypes.c_uint64(0)
    result, _ = arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.addressof(mask))
    return result == 0 and bool(mask.value >> XFEATURE_XTILEDATA & 1)


def cpu_has_amx_tiles() -> bool:
    """Whether this CPU has AMX tiles, by PyTorch's probe: the one vLLM picks its AMX kernels by
    (``quantkit.kernels.cpu_flags.amx_tiles``)."""
    return amx_tiles()


def request_amx_tile_permission(amx: bool | None = None,
                                arch_prctl: Callable[[int, int], tuple[int, int]] = _arch_prctl) -> AmxPermission:
    """Ask Linux for AMX tile data for this process, where the CPU has AMX tiles; elsewhere do nothing.

    amx: whether the CPU has AMX tiles (default: ``cpu_has_amx_tiles()``). arch_prctl: the system call,
    (code, arg) -> (return value, errno). Idempotent: asking again after a grant succeeds at once.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return AmxPermission(False, False, f"not asked: AMX's permission is a Linux x86-64 matter "
                                    f"({platform.system()} {platform.machine()})")
    if not (cpu_has_amx_tiles() if amx is None else amx):
        return AmxPermission(False, False, "not asked: this CPU has no AMX tiles (torch.cpu._is_amx_tile_supported())")
    result, code = arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if result != 0:
        why = _WHY_REFUSED.get(code, os.strerror(code))
        return AmxPermission(True, False, f"refused: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed with "
                                    f"{errno.errorcode.get(code, code)}: {why}")
    return AmxPermission(True, True, "granted: this process may run AMX tile instructions")
