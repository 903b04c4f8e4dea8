"""Writing outputs: a folder or file appears whole or not at all, with the user's umask; it replaces only
what quantkit itself wrote, only when asked, and never what the command reads.

- `check_writable(path, force=..., inputs=...)` before any long work: the output must not exist (unless
  force, and then `check_replaceable`), must not be, hold or lie in one of the command's inputs (a file
  it reads, a model folder), its names must fit the filesystem (with room for the temporary names written
  beside it), and its nearest existing parent must be a folder this process can write into.
- `check_replaceable(folder)`: what force may replace: an empty folder, or one whose marker
  (`.quantkit-output.json`, written into every output folder) lists every file in it. Never a symbolic
  link, a file, the working folder or a folder holding it, or a folder with files quantkit did not write.
- `atomic_output_dir(out, force=..., inputs=..., expect=..., size_hint=...)`: build a folder beside `out`
  (`.OUT.tmp-PID-XXXX`), write its marker and move it into place: a new `out` by a rename that never
  replaces, a forced replace by one atomic exchange of the two folders (renameat2 RENAME_EXCHANGE), so
  that `out` is the old or the new output at every instant. Where the filesystem cannot exchange, two
  renames: a `.OUT.old-PID` a killed run left between them is put back by the next run into the same place
  (`clean_stale`, which also removes temporary folders whose owner process is gone). The final step holds
  a lock on the parent folder and is refused when `out` changed since `expect` (default: since the call):
  an output another process finished meanwhile is never replaced, forced or not.
- `atomic_write_text(path, text)`: a file written beside `path`, then renamed over it; refused where `path` is
  anything but a regular file (a device, a pipe, a symbolic link, a folder): a rename would replace it.
- `check_output_file(path, inputs=...)` / `write_output_file(path, text)`: a file output a user names (`--json`).
  `-`, `/dev/stdout` and `/dev/stderr` are the process's own streams; a character device or a named pipe
  (`/dev/null`, `>(jq .)`) is written through, never replaced; a symbolic link to a regular file replaces the
  file it points to (the link stays); a link to nothing or to a folder, a block device and a socket are refused.
- Output names with control characters (a newline, a tab, an escape) are refused: they break the lines
  quantkit writes them into (recipe.yaml's comments, the messages).
- `atomic_output_file(path, force=..., owned=...)`: the same for a file a library writes (a GGUF file); refused
  likewise where `path` is not a regular file, and, with force, where `owned` says quantkit did not write the
  file there (a GGUF file carries its marker in its metadata); a killed run's temporary file is removed by the
  next run into the same place (`clean_stale`).
- `publish_files(out, names, force=...)`: files built in a temporary folder, then moved into an existing
  folder one by one (a report written into a folder that also holds its inputs).
- A full disk or quota (ENOSPC, EDQUOT) while writing, or too little free space for a size known up front:
  NoSpaceError naming the folder and the space needed; nothing half-written is left.

Folders are created with mode 0777 and files with 0666, less the umask, as any other tool's;
`give_default_mode` corrects files that a library wrote private (safetensors writes 0600).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
import secrets
import shutil
import stat
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import NoSpaceError, OutputExistsError, OutputRefusedError, UsageError, first_names
from ..core.units import human_bytes

try:
    import fcntl
except ImportError:  # not a POSIX system: no lock around the final rename
    fcntl = None

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
#: errno values of a full disk or quota
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
#: the file in every output folder that lists the files quantkit wrote there (JSON: written_by, id, files)
MARKER = ".quantkit-output.json"
_SHOWN = 5  # paths an error message lists


def _absolute(path: str | os.PathLike) -> Path:
    """`path` made absolute, `~` and `~user` expanded (a `~name` of no user stays as it is, as in a shell;
    pathlib's expanduser raises RuntimeError for it)."""
    return Path(os.path.abspath(os.path.expanduser(path)))


def _output_path(path: str | os.PathLike) -> Path:
    """The absolute path of an output; UsageError for an empty one (which would mean the working folder) or one
    with a control character."""
    text = os.fspath(path)
    if not text:
        raise UsageError("the output path is empty: name the file or folder to write")
    check_printable_name(text, "the output path")
    return _absolute(path)


def check_printable_name(text: str | bytes, what: str) -> None:
    """UsageError when `text` holds a control character (U+0000-U+001F, U+007F-U+009F): such a name breaks the
    one-line records quantkit writes it into (recipe.yaml's comments, messages) and the shell commands it prints."""
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    bad = next((c for c in text if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F), None)
    if bad is not None:
        raise UsageError(f"{what} {text!r} holds the control character {bad!r}; choose a name without control "
                         f"characters (newlines, tabs, escapes)")


def _listed(paths: list[str]) -> str:
    return first_names(paths, _SHOWN)


def check_writable(path: str | os.PathLike, *, force: bool = False, file: bool = False,
                   inputs: Iterable[str | os.PathLike | None] = (), known_files: Collection[str] = (),
                   owned: Callable[[Path], str | None] | None = None) -> Path:
    """Fail now, before any work, if `path` cannot be written: it exists (and not force; with force, a folder
    that `check_replaceable` refuses, or a file that is no regular file or that `owned` says quantkit did not
    write), it is a folder where a file is meant (file=True), it would overwrite or delete one of `inputs`
    (paths the command reads; None and names that are no local path are skipped), or its nearest existing
    parent is a file or is not writable. Returns the absolute path.
    owned: for a file output, the path -> None when quantkit wrote the file there, else why it did not (words)."""
    out = _output_path(path)
    _check_name_lengths(out)
    refuse_inputs(out, inputs, file=file)
    if os.path.lexists(out):
        if file and out.is_dir():
            raise UsageError(f"cannot write {out}: it is a folder; name a file to write")
        # what force could not replace is refused outright: never advise a force that fails
        if file:
            _refuse_unreplaceable_file(out)
            _refuse_foreign_file(out, owned)
        else:
            check_replaceable(out, known_files=known_files)
        if not force:
            raise OutputExistsError(out)
    parent = nearest_existing(out.parent)
    if not parent.is_dir():
        raise UsageError(f"cannot write {out}: {parent} is a file, not a folder; choose another output path")
    try:
        os.rmdir(_make_unique_dir(parent, f".{out.name}.probe-"))
    except OSError as e:
        raise UsageError(
            f"cannot write {out}: {parent} is not writable ({e.strerror}); choose another output path"
        ) from None
    return out


def nearest_existing(path: Path) -> Path:
    """`path` or its nearest parent that exists (os.path.exists: a name too long is one that does not)."""
    while not os.path.exists(path):
        path = path.parent
    return path


def _check_name_lengths(out: Path) -> None:
    """UsageError when a name in the absolute path `out` is longer than its filesystem allows (NAME_MAX bytes,
    usually 255): a folder to create, or the output's own name, which also needs room for the temporary
    names written beside it (`.NAME.probe-PID-XXXXXXXX`)."""
    existing = nearest_existing(out)
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):  # no such query here: the common limit
        limit = 255
    for part in out.parent.relative_to(nearest_existing(out.parent)).parts:
        if len(os.fsencode(part)) > limit:
            raise UsageError(f"cannot write {out}: the folder name {part!r} is {len(os.fsencode(part))} bytes, "
                             f"more than the {limit} this filesystem allows; choose a shorter path")
    extra = len(f"..probe-{os.getpid()}-{'0' * 8}")
    size = len(os.fsencode(out.name))
    if size + extra > limit:
        raise UsageError(f"cannot write {out}: its name is {size} bytes, and quantkit writes it through a temporary "
                         f"name {extra} bytes longer beside it, more than the {limit} bytes per name this "
                         f"filesystem allows; choose a name of at most {limit - extra} bytes")


def refuse_inputs(out: Path, inputs: Iterable[str | os.PathLike | None], *, file: bool) -> None:
    """OutputRefusedError if writing `out` would overwrite or delete an input: `out` is an input (also through
    a link), a folder output holds one, or a file output is an existing file inside an input folder."""
    real_out = out.resolve()
    for given in inputs:
        if given is None or not os.path.lexists(_absolute(given)):
            continue  # a hub id, a built-in name: nothing local to protect
        real_in = _absolute(given).resolve()
        same = real_out == real_in or (os.path.exists(out) and os.path.samefile(out, real_in))
        if same:
            raise OutputRefusedError(f"refusing to write {out}: it is {given}, an input of this command; "
                                     f"choose another output path")
        if not file and real_out in real_in.parents:
            raise OutputRefusedError(f"refusing to write {out}: it holds {given}, an input of this command; "
                                     f"choose another output path")
        if file and os.path.lexists(out) and real_in in real_out.parents:
            raise OutputRefusedError(f"refusing to overwrite {out}: it is a file of {given}, an input of this "
                                     f"command; write the output elsewhere")


def check_replaceable(folder: str | os.PathLike, *, known_files: Collection[str] = ()) -> None:
    """OutputRefusedError unless a forced write may replace `folder`: an empty folder, a folder quantkit
    wrote (its marker lists every file in it), or one holding exactly the files `known_files` names (and
    maybe a marker: an output recognised by its files, such as a reference model written before markers
    existed). Never a symbolic link, a file, the working folder or a folder holding it."""
    out = _absolute(folder)
    if out.is_symlink():
        raise OutputRefusedError(f"refusing to replace {out}: it is a symbolic link; name the folder itself, "
                                 f"or choose another output path")
    if not out.is_dir():
        raise OutputRefusedError(f"refusing to replace {out}: it is a file, not an output folder quantkit wrote; "
                                 f"choose another output path")
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the working folder was removed
        cwd = None
    if cwd is not None and (out.resolve() == cwd or out.resolve() in cwd.parents):
        raise OutputRefusedError(f"refusing to replace {out}: it is the working folder or holds it; "
                                 f"choose another output path")
    files, folders = _entries(out)
    if not files and not folders:
        return
    if not folders and known_files and set(files) - {MARKER} == set(known_files):
        return
    marker = read_marker(out)
    if marker is None:
        raise OutputRefusedError(
            f"refusing to replace {out}: quantkit did not write it (it has no {MARKER} listing its files), and "
            f"replacing it would delete {_listed(sorted(files + folders))}; delete it yourself if it should go, "
            f"or choose another output path")
    listed = set(marker["files"])
    parents = {str(p) for f in listed for p in Path(f).parents}
    others = sorted([f for f in files if f not in listed and f != MARKER] + [d for d in folders if d not in parents])
    if others:
        raise OutputRefusedError(
            f"refusing to replace {out}: it holds files quantkit did not write ({_listed(others)}); move them "
            f"out of the folder, or choose another output path")


def _entries(folder: Path) -> tuple[list[str], list[str]]:
    """(files, folders) below `folder`, as POSIX paths relative to it; links count as files."""
    files, folders = [], []
    for root, dirnames, filenames in os.walk(folder):
        here = Path(root).relative_to(folder)
        for name in list(dirnames):
            if os.path.islink(os.path.join(root, name)):
                dirnames.remove(name)
                filenames.append(name)
            else:
                folders.append((here / name).as_posix())
        files += [(here / name).as_posix() for name in filenames]
    return files, folders


def write_marker(folder: Path, files: Iterable[str] | None = None) -> str:
    """Write `folder`/MARKER listing `files` (paths relative to `folder`; default: every file below it);
    returns the marker's unique id."""
    if files is None:
        files, _ = _entries(folder)
    ident = f"{os.getpid()}-{time.time_ns()}-{secrets.token_hex(4)}"
    record = {"written_by": "quantkit", "id": ident, "files": sorted(f for f in files if f != MARKER)}
    atomic_write_text(folder / MARKER, json.dumps(record, indent=1) + "\n")
    return ident


def read_marker(folder: Path) -> dict | None:
    """`folder`'s marker as {"id": str, "files": [str]}, or None when it has none or it is unreadable."""
    try:
        record = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (not isinstance(record, dict) or not isinstance(record.get("id"), str)
            or not isinstance(record.get("files"), list) or not all(isinstance(f, str) for f in record["files"])):
        return None
    return record


@dataclass(frozen=True)
class OutputState:
    """What an output path held at one moment: nothing (key None), or the entry at (device, inode) with its
    marker's id (None without one). Two states differ when something replaced the path in between."""

    key: tuple[int, int, str | None] | None


def output_state(path: str | os.PathLike) -> OutputState:
    out = _absolute(path)
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return OutputState(None)
    marker = read_marker(out) if out.is_dir() and not out.is_symlink() else None
    return OutputState((st.st_dev, st.st_ino, marker["id"] if marker else None))


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
def atomic_output_dir(out_dir: str | os.PathLike, *, force: bool = False,
                      inputs: Iterable[str | os.PathLike | None] = (), expect: OutputState | None = None,
                      size_hint: int | None = None, known_files: Collection[str] = ()) -> Iterator[Path]:
    """Yield a temporary folder beside `out_dir`; on success its marker is written and it becomes `out_dir`.

    An existing `out_dir` is refused unless force; with force it must pass `check_replaceable` (with
    `known_files`) and is replaced only after the new folder is complete. Either way the write is refused
    (OutputExistsError; with force, OutputRefusedError) when `out_dir` is no longer what `expect` recorded
    (default: what it held at this call): another process wrote it meanwhile. `inputs`: paths the caller
    reads, never overwritten.
    `size_hint`: bytes the output will take, checked against the free space before anything is written.
    On failure the temporary folder is removed and `out_dir` is untouched.
    """
    out = _output_path(out_dir)
    if os.path.isdir(out.parent):  # False for a name too long, which check_writable names
        clean_stale(out)
    check_writable(out, force=force, inputs=inputs, known_files=known_files)
    before = output_state(out) if expect is None else expect
    if output_state(out) != before:
        raise _written_meanwhile(out, force)
    if size_hint is not None:
        check_free_space(out, size_hint)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _make_unique_dir(out.parent, f".{out.name}.tmp-")
    try:
        with _no_space_named(out, out.parent, lambda: size_hint or _bytes_below(tmp), exact=size_hint is not None):
            yield tmp
            write_marker(tmp)
        with _locked(out.parent):
            if output_state(out) != before:
                raise _written_meanwhile(out, force)
            if before.key is None:
                rename_noreplace(tmp, out)
            else:
                check_replaceable(out, known_files=known_files)  # nothing was added to it meanwhile
                _replace(tmp, out)
    except BaseException:
        _remove(tmp)
        raise


def _written_meanwhile(out: Path, force: bool) -> FileExistsError:
    """The error of a writer that finds `out` written by another process since its work began."""
    if not force:
        return OutputExistsError(out, " (another process wrote it while this one worked)")
    return OutputRefusedError(f"{out} was written by another process while this one worked: that output is kept "
                              f"and this one's is discarded; run again to replace it")


def _replace(new: Path, out: Path) -> None:
    """Put folder `new` in place of folder `out`. One atomic exchange where the filesystem can (then the old
    folder, now at `new`, is removed; a killed run leaves it for clean_stale); else two renames, between
    which `out` is missing for an instant (a killed run's `.OUT.old-PID` is put back by clean_stale)."""
    if _exchange(new, out):
        _remove(new)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, old)
    try:
        rename_noreplace(new, out)
    except BaseException:
        os.rename(old, out)
        raise
    _remove(old)


def _renameat2(src: Path, dst: Path, flags: int) -> int:
    """0 when renameat2 did it, else its errno (ENOSYS where the C library lacks it)."""
    libc = _libc()
    if libc is None:
        return errno.ENOSYS
    if libc.renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return 0
    return ctypes.get_errno()


# errno of renameat2 when the kernel, the filesystem or a sandbox does not support a flag
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.EPERM, errno.ENOTSUP)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; False where the OS or the filesystem cannot."""
    err = _renameat2(a, b, _RENAME_EXCHANGE)
    if err in _UNSUPPORTED:
        return False
    if err:
        raise OSError(err, os.strerror(err), str(a), None, str(b))
    return True


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; raise OutputExistsError if `dst` exists (atomically where the OS allows)."""
    err = _renameat2(src, dst, _RENAME_NOREPLACE)
    if err == 0:
        return
    if err == errno.EEXIST:
        raise OutputExistsError(dst, " (another process wrote it while this one worked)")
    if err not in _UNSUPPORTED:
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


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock (flock) on `folder` while the body runs: the last steps of two quantkit writers
    into one folder never interleave. Where the system has no flock for folders, no lock."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                pass
        yield
    finally:
        os.close(fd)  # releases the lock (so does the end of a killed process)


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


def check_free_space(out: str | os.PathLike, needed: int) -> None:
    """NoSpaceError, before anything is written, when the filesystem that will hold `out` has fewer than
    `needed` bytes free (unknown free space passes; a quota is only found when it is hit)."""
    out = _absolute(out)
    parent = nearest_existing(out.parent)
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        return
    if free < needed:
        raise _no_space_error(out, parent, "not enough free space", needed, True, free)


def _bytes_below(folder: Path) -> int:
    """Bytes of the files below `folder` (what a write put there before it failed)."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _no_space_error(out: Path, where: Path, why: str, needed: int, exact: bool, free: int | None) -> NoSpaceError:
    size = f"about {human_bytes(needed)}" if exact else f"more than the {human_bytes(needed)} written before it failed"
    room = "" if free is None else f", {human_bytes(free)} free there"
    error = NoSpaceError(f"cannot write {out}: {why} in {where} ({size} needed{room}); free some space or choose "
                         f"another output path (nothing was written)")
    error.errno = errno.ENOSPC
    return error


@contextmanager
def _no_space_named(out: Path, where: Path, needed: Callable[[], int], *, exact: bool) -> Iterator[None]:
    """Turn a full disk or quota (ENOSPC, EDQUOT) met while writing `out` into folder `where` into a
    NoSpaceError naming them and `needed()` bytes (exact: an estimate made beforehand; else what was
    written before the failure)."""
    try:
        yield
    except OSError as e:
        if isinstance(e, NoSpaceError) or e.errno not in _NO_SPACE:
            raise
        try:
            free = shutil.disk_usage(where).free
        except OSError:
            free = None
        raise _no_space_error(out, where, e.strerror or "no space left", needed(), exact, free) from None


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` (UTF-8) through a temporary file renamed over it; parents are created."""
    path = _absolute(path)
    _refuse_unreplaceable_file(path)
    data = text.encode("utf-8")
    check_free_space(path, len(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with _no_space_named(path, path.parent, lambda: len(data), exact=True):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _kind(mode: int) -> str:
    """What a file of this st_mode is, in words."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse_foreign_file(path: Path, owned: Callable[[Path], str | None] | None) -> None:
    """OutputRefusedError when `owned` says quantkit did not write the file `path`."""
    why = owned(path) if owned is not None else None
    if why:
        raise OutputRefusedError(f"refusing to replace {path}: {why}; delete it yourself if it should go, or choose "
                                 f"another output path")


def _refuse_unreplaceable_file(path: Path) -> None:
    """OutputRefusedError when `path` exists and is not a regular file: renaming a file over it would replace
    a device, a pipe, a link or a folder."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise OutputRefusedError(f"refusing to replace {path}: it is {_kind(mode)}, not a file quantkit may replace; "
                                 f"choose another output path")


#: the names a file output takes for the process's own streams (written to, never opened or replaced)
_STREAMS = {"-": 1, "/dev/stdout": 1, "/dev/fd/1": 1, "/proc/self/fd/1": 1,
            "/dev/stderr": 2, "/dev/fd/2": 2, "/proc/self/fd/2": 2}


def output_stream(path: str | os.PathLike | None) -> int | None:
    """1 or 2 when a file output names standard output or standard error (`-`, /dev/stdout, /dev/stderr), else
    None. A command that prints its JSON to standard output prints its summary to standard error."""
    if path is None:
        return None
    text = os.fspath(path)
    return _STREAMS.get(text if text == "-" else os.path.normpath(os.path.abspath(text)))


def _file_target(path: str | os.PathLike) -> tuple[str, Path]:
    """How a file output is written: ("stream", _), ("through", device or pipe) or ("replace", regular file).

    A symbolic link is followed: to a regular file (or a new file in an existing folder) it replaces that file,
    to a device or a pipe it writes through; a link to nothing that could be created, or to a folder, is refused."""
    if output_stream(path) is not None:
        return "stream", Path(os.fspath(path))
    out = _output_path(path)
    target = out
    if out.is_symlink():
        target = out.resolve()
        if not os.path.lexists(target) and not target.parent.is_dir():
            raise OutputRefusedError(f"refusing to write {out}: it is a symbolic link to {target}, which does not "
                                     f"exist (nor its folder); name a file to write, or fix the link")
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return "replace", target
    if stat.S_ISREG(mode):
        return "replace", target
    if stat.S_ISDIR(mode):
        raise UsageError(f"cannot write {out}: it is a folder; name a file to write")
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        return "through", target
    raise OutputRefusedError(f"refusing to write {out}: it is {_kind(mode)}; name a file, a character device or "
                             f"a pipe to write")


def check_output_file(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike | None] = ()) -> None:
    """Before any work, for a file output a user names (`--json FILE`): refuse what `write_output_file` would
    refuse, a file that is one of `inputs` (files the command reads), and a folder that cannot be written."""
    how, target = _file_target(path)
    if how == "replace":
        check_writable(target, force=True, file=True, inputs=inputs)


def write_output_file(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to a file output: to standard output or error for `-`, /dev/stdout, /dev/stderr;
    through a character device or a pipe; else atomically in place of the regular file (the file a symbolic
    link points to, the link kept)."""
    how, target = _file_target(path)
    if how == "stream":
        stream = sys.stdout if output_stream(path) == 1 else sys.stderr
        stream.write(text)
        stream.flush()
    elif how == "through":
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        atomic_write_text(target, text)


@contextmanager
def atomic_output_file(path: str | os.PathLike, *, force: bool = False,
                       inputs: Iterable[str | os.PathLike | None] = (),
                       owned: Callable[[Path], str | None] | None = None) -> Iterator[Path]:
    """Yield a temporary file path beside `path` (`.NAME.tmp-PID-XXXX`) for the caller to write; on success it
    is renamed to `path` (with the umask's mode). An existing `path` is refused unless force, and with force
    when it is no regular file or `owned` (as check_writable's) says quantkit did not write it, checked again
    at the rename; on failure the temporary file is removed and `path` is untouched. Temporary files of killed
    runs beside `path` are removed first (clean_stale)."""
    if os.path.isdir(_output_path(path).parent):
        clean_stale(_output_path(path))
    out = check_writable(path, force=force, file=True, inputs=inputs, owned=owned)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with _no_space_named(out, out.parent, lambda: tmp.stat().st_size if tmp.exists() else 0, exact=False):
            yield tmp
        give_default_mode(tmp)
        with _locked(out.parent):
            if force and os.path.lexists(out):
                _refuse_unreplaceable_file(out)
                _refuse_foreign_file(out, owned)  # another process put a file there meanwhile
                os.replace(tmp, out)
            else:
                rename_noreplace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def publish_files(out_dir: str | os.PathLike, names: Iterable[str], *, force: bool = False,
                  inputs: Iterable[str | os.PathLike | None] = (), owned: Collection[str] = ()) -> Iterator[Path]:
    """Yield a temporary folder inside `out_dir`; on success move each file in it into `out_dir`, and
    add them to `out_dir`'s marker.

    names: files whose presence in `out_dir` means a previous output would be overwritten: refused
    unless force. With force, only regular files an earlier publish listed in the marker are overwritten,
    and the files of `owned` (every name this kind of output can have) that the marker lists but the new
    output lacks are removed: a replaced output leaves nothing of the old one behind. Other files of `out_dir`
    are kept; none of `inputs` (files the caller reads) is ever overwritten. A folder this call created is
    removed again when the body fails.
    """
    out = _output_path(out_dir)
    inputs = list(inputs)
    names = list(names)
    for name in names:
        refuse_inputs(out / name, inputs, file=True)
    _check_overwrite(out, [*names, *owned], force)  # an earlier output of this kind, whole
    check_writable(out / ".probe", force=True, file=True)
    created = not os.path.lexists(out)
    out.mkdir(parents=True, exist_ok=True)
    clean_stale(out / ".publish")
    tmp = _make_unique_dir(out, "..publish.tmp-")
    try:
        with _no_space_named(out, out, lambda: _bytes_below(tmp), exact=False):
            yield tmp
            files = sorted(p.name for p in tmp.iterdir())
            for name in files:
                refuse_inputs(out / name, inputs, file=True)
            with _locked(out):
                _check_overwrite(out, files, force)
                marker = read_marker(out)
                listed = set(marker["files"]) if marker else set()
                stale = sorted(n for n in listed & set(owned) - set(files) if os.path.lexists(out / n)) \
                    if any(os.path.lexists(out / n) for n in names) else []
                for name in stale:
                    _refuse_unreplaceable_file(out / name)
                for name in files:
                    os.replace(tmp / name, out / name)
                for name in stale:
                    (out / name).unlink()
                write_marker(out, [f for f in listed | set(files) if os.path.lexists(out / f)])
    except BaseException:
        _remove(tmp)
        if created:
            try:
                os.rmdir(out)  # only if empty: nothing else was put there meanwhile
            except OSError:
                pass
        raise
    _remove(tmp)


def _check_overwrite(out: Path, names: Iterable[str], force: bool) -> None:
    """OutputRefusedError, even with force, for a file of `names` in `out` that `out`'s marker does not list
    (quantkit did not write it) or that is no regular file; then OutputExistsError for one that exists (unless
    force). In that order: the advice to pass --force is given only where --force would work."""
    existing = [n for n in dict.fromkeys(names) if os.path.lexists(out / n)]
    marker = read_marker(out) if existing else None
    foreign = [n for n in existing if marker is None or n not in marker["files"]]
    if foreign:
        raise OutputRefusedError(f"refusing to overwrite {_listed([str(out / n) for n in foreign])}: quantkit did not "
                                 f"write it (no {MARKER} in {out} lists it); move it away, or choose another output "
                                 f"path")
    for name in existing:
        _refuse_unreplaceable_file(out / name)
    if existing and not force:
        raise OutputExistsError(out / existing[0])
