"""Writing outputs: a folder or file appears whole or not at all, with the user's umask, and replaces
what exists only when asked.

- `check_writable(path, force=...)` before any long work: the output must not exist (unless force) and
  its nearest existing parent must be a folder this process can write into.
- `atomic_output_dir(out, force=...)`: build a folder beside `out` (`.OUT.tmp-PID-XXXX`) and rename it
  into place; the rename never replaces a folder another process finished meanwhile (unless force).
  Temporary folders of killed runs (owner process gone) are removed on the next run into the same
  place; a `.OUT.old-PID` left between the two renames of a forced replace is put back when `out` is
  missing, else removed.
- `atomic_write_text(path, text)`: a file written beside `path`, then renamed over it.
- `publish_files(out, names, force=...)`: files built in a temporary folder, then moved into an existing
  folder one by one (a report written into a folder that also holds its inputs).

Folders are created with mode 0777 and files with 0666, less the umask, as any other tool's;
`give_default_mode` corrects files that a library wrote private (safetensors writes 0600).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import OutputExistsError, UsageError

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _absolute(path: str | os.PathLike) -> Path:
    return Path(os.path.abspath(Path(path).expanduser()))


def check_writable(path: str | os.PathLike, *, force: bool = False, file: bool = False) -> Path:
    """Fail now, before any work, if `path` cannot be written: it exists (and not force), it is a folder
    where a file is meant (file=True), or its nearest existing parent is a file or is not writable.
    Returns the absolute path."""
    out = _absolute(path)
    if out.exists() and not force:
        raise OutputExistsError(out)
    if file and out.is_dir():
        raise UsageError(f"cannot write {out}: it is a folder; name a file to write")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"cannot write {out}: {parent} is a file, not a folder; choose another output path")
    try:
        os.rmdir(_make_unique_dir(parent, f".{out.name}.probe-"))
    except OSError as e:
        raise UsageError(
            f"cannot write {out}: {parent} is not writable ({e.strerror}); choose another output path"
        ) from None
    return out


def current_umask() -> int:
    """This process's umask (read from /proc where possible: setting it to read it is not thread-safe)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_default_mode(path: str | os.PathLike) -> None:
    """Set a file's mode to 0666 less the umask, as if created by open()."""
    os.chmod(path, 0o666 & ~current_umask())


def _make_unique_dir(parent: Path, prefix: str) -> Path:
    """A new folder `parent/PREFIX<pid>-<random>` with mode 0777 less the umask."""
    while True:
        path = parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue


@contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `out_dir`; on success it is renamed to `out_dir`.

    An existing `out_dir` is refused unless force, also when another process creates it while this one
    works; with force it is replaced only after the new folder is complete. On failure the temporary
    folder is removed and `out_dir` is untouched.
    """
    out = _absolute(out_dir)
    if out.parent.is_dir():
        clean_stale(out)
    check_writable(out, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _make_unique_dir(out.parent, f".{out.name}.tmp-")
    try:
        yield tmp
        if force and os.path.lexists(out):
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
            try:
                rename_noreplace(tmp, out)
            except BaseException:
                os.rename(old, out)
                raise
            _remove(old)
        else:
            rename_noreplace(tmp, out)
    except BaseException:
        _remove(tmp)
        raise


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; raise OutputExistsError if `dst` exists (atomically where the OS allows)."""
    libc = _libc()
    if libc is not None:
        if libc.renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise OutputExistsError(dst, " (another process wrote it while this one worked)")
        if err not in (errno.ENOSYS, errno.EINVAL, errno.EPERM):  # else: the filesystem lacks the flag
            raise OSError(err, os.strerror(err), str(src), None, str(dst))
    if os.path.lexists(dst):
        raise OutputExistsError(dst, " (another process wrote it while this one worked)")
    try:
        os.rename(src, dst)  # a folder onto a non-empty folder fails: never a silent replace of a checkpoint
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise OutputExistsError(dst, " (another process wrote it while this one worked)") from None
        raise


_LIBC: list = []


def _libc():
    """The C library if it has renameat2 (Linux, glibc >= 2.28), else None."""
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _LIBC.append(libc)
        except (OSError, AttributeError, TypeError):
            _LIBC.append(None)
    return _LIBC[0]


def _owner_alive(name: str, marker: str) -> bool:
    """Whether the process whose id follows `marker` in `name` runs (unknown names count as alive)."""
    try:
        pid = int(name.rsplit(marker, 1)[1].split("-")[0])
    except (IndexError, ValueError):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def clean_stale(out: Path) -> list[Path]:
    """Remove what killed runs left beside `out`; put back a replaced `out` a killed forced run had moved
    aside. Returns the paths removed or restored."""
    done = []
    prefix = glob.escape(f".{out.name}")
    for tmp in out.parent.glob(f"{prefix}.tmp-*"):
        if not _owner_alive(tmp.name, ".tmp-"):
            _remove(tmp)
            done.append(tmp)
    for old in out.parent.glob(f"{prefix}.old-*"):
        if not _owner_alive(old.name, ".old-"):
            if os.path.lexists(out):
                _remove(old)
            else:
                os.rename(old, out)
            done.append(old)
    return done


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` (UTF-8) through a temporary file renamed over it; parents are created."""
    path = _absolute(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


@contextmanager
def publish_files(out_dir: str | os.PathLike, names: Iterable[str], *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder inside `out_dir`; on success move each file in it into `out_dir`.

    names: files whose presence in `out_dir` means a previous output would be overwritten: refused
    unless force. Other files of `out_dir` are kept.
    """
    out = _absolute(out_dir)
    existing = [n for n in names if os.path.lexists(out / n)]
    if existing and not force:
        raise OutputExistsError(out / existing[0])
    check_writable(out / ".probe", force=True)
    out.mkdir(parents=True, exist_ok=True)
    clean_stale(out / ".publish")
    tmp = _make_unique_dir(out, "..publish.tmp-")
    try:
        yield tmp
        files = sorted(tmp.iterdir())
        clash = [f.name for f in files if os.path.lexists(out / f.name)]
        if clash and not force:
            raise OutputExistsError(out / clash[0])
        for f in files:
            os.replace(f, out / f.name)
    finally:
        _remove(tmp)
