"""The reference models' corpus: the running Python's standard-library source, split by file.

Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, except ``site-packages``, any
``test``/``tests`` directory, ``idlelib``, ``lib2to3``, ``__pycache__`` and files over 200 kB
(generated tables). Relative paths use ``/`` on every platform.

Split: a file is held out iff ``zlib.crc32(relative_path) % 10 == 0`` (about 10% of files). The split
depends on the path only, so a held-out file stays held out under every Python version.

Text: files are read as UTF-8 (undecodable bytes replaced) with line endings normalised to ``\\n``,
each file ending in exactly one ``\\n``, and joined with a blank line between files.
"""

from __future__ import annotations

import errno
import hashlib
import os
import sys
import sysconfig
import tempfile
import zlib
from pathlib import Path

from ..core.errors import NoSpaceError, UsageError

MAX_FILE_BYTES = 200_000
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
HELDOUT_MODULUS = 10
# Bump when the file selection, split or text layout changes: it keys the cached text files.
CORPUS_VERSION = 1
FILE_SEPARATOR = "\n"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str) -> bool:
    """True for the ~10% of files held out from training (decided by the path alone)."""
    return zlib.crc32(relative_path.encode("utf-8")) % HELDOUT_MODULUS == 0


def corpus_files(root: Path | None = None) -> list[str]:
    """Sorted ``/``-separated paths (relative to ``root``) of every corpus file."""
    root = stdlib_root() if root is None else Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for filename in filenames:
            if not filename.endswith(".py"):
                continue
            path = Path(dirpath) / filename
            if path.is_symlink() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            found.append(path.relative_to(root).as_posix())
    if not found:
        raise FileNotFoundError(f"no .py files found under the standard-library folder {root}")
    return sorted(found)


def split_files(root: Path | None = None) -> tuple[list[str], list[str]]:
    """(train, heldout) relative paths, each sorted; disjoint, and together every corpus file."""
    files = corpus_files(root)
    train = [f for f in files if not is_heldout(f)]
    heldout = [f for f in files if is_heldout(f)]
    return train, heldout


def read_source(root: Path, relative_path: str) -> str:
    """One file's text: UTF-8 (bad bytes replaced), ``\\n`` line endings, ending in one ``\\n``."""
    raw = (root / relative_path).read_bytes().decode("utf-8", errors="replace")
    text = raw.replace("\r\n", "\n").replace("\r", "\n")
    return text.rstrip("\n") + "\n"


def _mixed_order(paths: list[str]) -> list[str]:
    """A deterministic shuffle (by SHA-1 of the path), so a byte cap samples the whole library."""
    return sorted(paths, key=lambda p: hashlib.sha1(p.encode("utf-8")).hexdigest())


def _take(paths: list[str], root: Path, max_bytes: int | None) -> list[str]:
    """Texts of ``paths`` in order, stopping before the first file that would pass ``max_bytes``.

    Always returns at least one file, so a tiny cap still yields some text.
    """
    texts, total = [], 0
    for path in paths:
        text = read_source(root, path)
        size = len(text.encode("utf-8"))
        if max_bytes is not None and texts and total + size > max_bytes:
            break
        texts.append(text)
        total += size
    return texts


def train_documents(max_bytes: int | None = None, root: Path | None = None) -> list[str]:
    """Train-split file texts in a fixed mixed order; with ``max_bytes``, a prefix of that order."""
    root = stdlib_root() if root is None else Path(root)
    train, _ = split_files(root)
    return _take(_mixed_order(train), root, max_bytes)


def heldout_documents(max_bytes: int | None = None, root: Path | None = None) -> list[str]:
    """Held-out file texts in sorted path order; with ``max_bytes``, a prefix of it."""
    root = stdlib_root() if root is None else Path(root)
    _, heldout = split_files(root)
    return _take(heldout, root, max_bytes)


def train_text(max_bytes: int | None = None, root: Path | None = None) -> str:
    return FILE_SEPARATOR.join(train_documents(max_bytes, root))


def heldout_text(max_bytes: int | None = None, root: Path | None = None) -> str:
    return FILE_SEPARATOR.join(heldout_documents(max_bytes, root))


def cache_root() -> Path:
    """quantkit's cache folder, the one the kernel builds use too (quantkit.kernels.cpu_extension.cache_root:
    ``$QUANTKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/quantkit``, else ``~/.cache/quantkit``)."""
    from ..kernels.cpu_extension import cache_root as root  # torch: only once a cache path is needed

    return root()


def _python_tag() -> str:
    return "py" + ".".join(str(v) for v in sys.version_info[:3])


def write_text_atomically(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _cached_split_path(split: str) -> Path:
    """The cached text file of `split`, written first if missing; UsageError naming the folder (and
    QUANTKIT_CACHE_DIR, the fix) when it cannot be written there (no permission, a name too long, ...),
    NoSpaceError when the disk is full."""
    path = cache_root() / "corpus" / f"stdlib-{split}-{_python_tag()}-v{CORPUS_VERSION}.txt"
    try:
        if not path.is_file():
            text = heldout_text() if split == "heldout" else train_text()
            write_text_atomically(path, text)
    except OSError as e:
        problem = f"the corpus cache {path.parent} cannot be written ({e.strerror or e})"
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpaceError(f"{problem}: free some space, or set QUANTKIT_CACHE_DIR to a folder on "
                               f"another disk") from None
        raise UsageError(f"{problem}: set QUANTKIT_CACHE_DIR to a writable folder with a short path") from None
    return path


def heldout_text_path() -> Path:
    """A UTF-8 file with the whole held-out text (written once into the cache, then reused).

    This is quantkit's default evaluation text: no reference model saw any of its files in training.
    """
    return _cached_split_path("heldout")


def train_text_path() -> Path:
    """A UTF-8 file with the whole train-split text (written once into the cache, then reused)."""
    return _cached_split_path("train")
