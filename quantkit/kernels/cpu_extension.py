"""The C++ CPU kernels (``csrc/*.cpp``), compiled on first use and cached per user and machine.

``load_cpu_kernels()`` builds ``csrc/wna16_q8dot.cpp`` and ``csrc/decode_step.cpp`` (the C++ decode loop,
``torch.classes.quantkit.CpuDecoder``: quantkit.runtime.cpu_decoder) with ``torch.utils.cpp_extension.load`` the first
time a process needs it and registers its ops (``torch.ops.quantkit.wna16_cpu_q8dot`` and friends);
later processes load the cached library in milliseconds. Returns ``CpuKernels`` (``available`` and, if
not, the one-line ``reason``): callers fall back to PyTorch's own kernels when the build is impossible.

- Cache: ``$QUANTKIT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/quantkit`` or ``~/.cache/quantkit``)
  ``/cpu-kernels/<key>``, key = hash of the sources, the compiler flags, the compiler, torch's version
  and the CPU's flags: a new source, torch or CPU builds again, never a stale library.
- A build records its library's SHA-256 and size beside it (``<name>.so.sha256``); a cached library that
  does not match its record (truncated by a full disk or a killed copy: loading it would die with SIGBUS)
  is built again, saying so.
- One build at a time: an ``fcntl`` lock on ``<key>.lock`` (released by the OS if a build dies), and
  the others then load what it built.
- Flags: ``-O3 -fopenmp`` (``at::parallel_for`` is inline OpenMP code: without the flag it runs on one
  thread). The code paths (AVX-512 with BF16 and VBMI, AVX-512 with BF16, AVX-512 VNNI, AVX2, scalar) carry their own
  ``__attribute__((target(...)))``, and the path is chosen at run time from the CPU (``cpuid``), so the
  library is correct on any x86-64 CPU; ``-march=native`` is not needed.
- The "avx512-bf16" level is AVX-512 VNNI with AVX512_BF16: the decode attention reads bf16 and fp8 caches
  with bf16 dot products there (csrc/decode_attention_cpu.cpp); the quantized linear runs its AVX-512 code.
- The "avx512-bf16-vbmi" level adds AVX512_VBMI: the decode attention reads an fp8 cache by byte permutes
  there (the same results, fewer instructions).
- ``QUANTKIT_CPU_KERNEL_ISA=avx512-vnni`` (or ``avx2``, ``scalar``) makes the kernels take a lower code path than the
  CPU's best, for comparisons (capped at what the CPU runs).
- ``QUANTKIT_CPU_KERNELS=0`` turns the kernels off (the reason says so); no C++ compiler
  (``$CXX``, else ``c++``), no ninja or a failed build -> unavailable, with the reason, warned once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import struct
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .cpu_flags import cpu_flags

SOURCES = ("wna16_q8dot.cpp", "decode_step.cpp", "decode_attention_cpu.cpp", "gptq_walk.cpp")
HEADERS = ("q8dot.h", "decode_attention_cpu.h", "cpu_isa.h")
CFLAGS = ("-O3", "-std=c++17", "-fopenmp")  # -fopenmp: at::parallel_for is inline OpenMP, sequential without it
LDFLAGS = ("-fopenmp",)
ENV_SWITCH = "QUANTKIT_CPU_KERNELS"
ISA_NAMES = ("scalar", "avx2", "avx512-vnni", "avx512-bf16", "avx512-bf16-vbmi")  # indices: the C++ Isa enum (csrc/cpu_isa.h)
ISA_ENV = "QUANTKIT_CPU_KERNEL_ISA"  # force a code path (capped at what the CPU runs), e.g. to time AVX2 on AVX-512


@dataclass(frozen=True)
class CpuKernels:
    """Whether the C++ CPU kernels are loaded (their ops registered), and why not."""

    available: bool
    reason: str = ""
    build_dir: str = ""


def _csrc() -> Path:
    return Path(__file__).resolve().parent / "csrc"


def cache_root() -> Path:
    """quantkit's cache folder (kernel builds, the reference models and their corpus):
    ``$QUANTKIT_CACHE_DIR`` (or its older name ``$QUANTKIT_CACHE``), else ``$XDG_CACHE_HOME/quantkit``,
    else ``~/.cache/quantkit``."""
    base = os.environ.get("QUANTKIT_CACHE_DIR") or os.environ.get("QUANTKIT_CACHE")
    if base:
        return Path(base).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "quantkit"


def _cpu_flags() -> str:
    """The CPU's feature flags as one string, for the build key (cpu_flags reads them)."""
    flags = cpu_flags()
    return " ".join(sorted(flags)) if flags else platform.processor() or platform.machine()


def compiler() -> str | None:
    """The C++ compiler cpp_extension will call ($CXX, else c++), if it exists."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _ninja_on_path() -> bool:
    """cpp_extension runs `ninja`; the pip package's binary is not on PATH when the venv is not activated."""
    if shutil.which("ninja"):
        return True
    try:
        import ninja  # optional: the pip package, whose binary may be off PATH
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja") is not None


def build_key() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((_csrc() / name).read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    h.update(str(compiler()).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    h.update(platform.machine().encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(path: Path):
    import fcntl  # POSIX only: imported where a build takes its lock

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


#: beside each built library: "<sha256> <size>" of the library as its build wrote it
RECORD_SUFFIX = ".sha256"


def _fingerprint(library: Path) -> str:
    h = hashlib.sha256()
    with open(library, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return f"{h.hexdigest()} {library.stat().st_size}"


def _record(library: Path) -> Path:
    return library.with_name(library.name + RECORD_SUFFIX)


def _elf_complete(library: Path) -> bool:
    """Whether a 64-bit little-endian ELF file holds all it says it holds: every segment its program headers
    name, and its section header table (which the linker writes last), end within the file."""
    data = library.read_bytes()
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return False
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    if shnum == 0 or shoff + shentsize * shnum > len(data) or phoff + phentsize * phnum > len(data):
        return False
    for i in range(phnum):  # p_offset at +8, p_filesz at +32 of each program header
        (offset,) = struct.unpack_from("<Q", data, phoff + i * phentsize + 8)
        (size,) = struct.unpack_from("<Q", data, phoff + i * phentsize + 32)
        if offset + size > len(data):
            return False
    return True


def _discard_if_damaged(library: Path) -> None:
    """Empty the build folder of a cached library that is not the one its build recorded (truncated by a full
    disk or a killed copy, or edited): loading a truncated library dies with SIGBUS, so it is built again
    instead. A library built before records were kept is recorded when it is a whole ELF file. Called under
    the build lock."""
    if not library.exists():
        return
    record = _record(library)
    try:
        if record.is_file() and record.read_text().strip() == _fingerprint(library):
            return
        if not record.exists() and _elf_complete(library):
            _write_record(library)
            return
    except OSError:
        pass
    print(f"quantkit: the cached CPU kernels {library} do not match their build record (damaged or incomplete); "
          f"building them again", file=sys.stderr, flush=True)
    for entry in library.parent.iterdir():  # the objects too: whatever truncated the library may have hit them
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _write_record(library: Path) -> None:
    """Record the library a build just wrote (atomically: a record is whole or absent)."""
    record = _record(library)
    tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
    tmp.write_text(_fingerprint(library) + "\n")
    os.replace(tmp, record)


@functools.cache
def load_cpu_kernels() -> CpuKernels:
    """Build (first time on this machine) and load the C++ CPU kernels; never raises."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return CpuKernels(False, f"turned off by {ENV_SWITCH}={os.environ[ENV_SWITCH]}")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return CpuKernels(False, f"the C++ CPU kernels are written for x86-64, this is {platform.machine()}")
    if compiler() is None:
        return CpuKernels(False, f"no C++ compiler ({os.environ.get('CXX', 'c++')} not found; install g++ or set CXX)")
    if not _ninja_on_path():
        return CpuKernels(False, "ninja is not installed (pip install ninja)")
    key = build_key()
    build_dir = cache_root() / "cpu-kernels" / key
    name = f"quantkit_cpu_{key}"
    try:
        from torch.utils import cpp_extension  # import time: loaded only when the kernels build

        build_dir.mkdir(parents=True, exist_ok=True)
        library = build_dir / f"{name}.so"
        with _build_lock(build_dir.parent / f"{key}.lock"):
            _discard_if_damaged(library)
            built = library.exists()
            if not built:
                print(f"quantkit: compiling the CPU kernels (once per machine, about a minute) in {build_dir} ...",
                      file=sys.stderr, flush=True)
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cpp_extension.load(
                    name=name, sources=[str(_csrc() / s) for s in SOURCES], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                    build_directory=str(build_dir), is_python_module=False, verbose=False,
                )
            _write_record(library)  # also after a load: ninja relinks in place when a source's mtime changed
            if not built:
                print(f"quantkit: CPU kernels built in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    except Exception as e:  # a failed build must never stop a model from running: report and fall back
        detail = " ".join(str(e).split())[-300:]
        reason = f"the C++ CPU kernels did not build ({type(e).__name__}: {detail})"
        warnings.warn(f"quantkit: {reason}; using PyTorch's CPU kernels instead", stacklevel=2)
        return CpuKernels(False, reason, str(build_dir))
    from . import wna16_cpu_q8  # noqa: F401  (fake implementations of the ops just registered)

    wna16_cpu_q8.register_fakes()
    forced = os.environ.get(ISA_ENV, "").strip()
    if forced:
        if forced not in ISA_NAMES + ("auto",):
            warnings.warn(f"quantkit: {ISA_ENV}={forced!r} is none of {ISA_NAMES}; using the CPU's best", stacklevel=2)
        else:
            torch.ops.quantkit.wna16_cpu_q8dot_isa(-1 if forced == "auto" else ISA_NAMES.index(forced))
    return CpuKernels(True, "", str(build_dir))


def cpu_kernel_isa(force: str | None = None) -> str:
    """The code path the C++ kernels take on this CPU (one of ISA_NAMES, e.g. "avx512-bf16" or "avx2"); ``force``
    ("auto" or one of those) switches it for this process (capped at what the CPU can run)."""
    if not load_cpu_kernels().available:
        return "unavailable"
    if force is None:
        return ISA_NAMES[torch.ops.quantkit.wna16_cpu_q8dot_isa(-2)]
    code = -1 if force == "auto" else ISA_NAMES.index(force)
    return ISA_NAMES[torch.ops.quantkit.wna16_cpu_q8dot_isa(code)]
