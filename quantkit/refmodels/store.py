"""Where reference models live: the committed folders in the package, else the user's cache.

A folder is usable when it holds every file of ``REQUIRED_FILES`` and its ``training.json`` names the
current spec's hash (so weights trained under an older spec are never returned for a newer one).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from ..errors import QuantkitError
from . import corpus
from .spec import TRAINING_RECORD, WEIGHTS_FILE, RefModelSpec

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    WEIGHTS_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    TRAINING_RECORD,
)

COMMITTED_WEIGHTS = Path(__file__).resolve().parent / "weights"
REF_PREFIX = "ref:"


def committed_folder(spec: RefModelSpec) -> Path:
    return COMMITTED_WEIGHTS / spec.name


def cache_folder(spec: RefModelSpec) -> Path:
    """``<cache>/refmodels/<name>-<spec hash>`` (cache: ``$QUANTKIT_CACHE`` or ``~/.cache/quantkit``)."""
    return corpus.cache_root() / "refmodels" / spec.folder_name()


def is_complete(folder: Path, spec: RefModelSpec) -> bool:
    """True when ``folder`` holds a whole model built from exactly ``spec``."""
    folder = Path(folder)
    if not all((folder / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        record = json.loads((folder / TRAINING_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return record.get("spec_hash") == spec.spec_hash()


class NotAModelFolderError(QuantkitError, FileExistsError):
    """The output path exists and is not a model folder (a file, or a folder of other files)."""


def _check_replaceable(destination: Path) -> None:
    """Refuse to replace anything but an empty folder or a (stale or partial) model folder."""
    if not destination.exists():
        return
    if not destination.is_dir():
        raise NotAModelFolderError(f"{destination} is a file, not a model folder: choose another --out")
    entries = {p.name for p in destination.iterdir()}
    if entries and not entries & {TRAINING_RECORD, "config.json"}:
        raise NotAModelFolderError(
            f"{destination} holds files that are not a model folder ({', '.join(sorted(entries)[:5])}); "
            f"refusing to replace it: choose an empty or new folder for --out"
        )


def build_atomically(spec: RefModelSpec, destination: Path, *, force: bool = False,
                     num_threads: int | None = None, progress: bool = True,
                     heldout_max_bytes: int | None = None) -> Path:
    """Train ``spec`` into ``destination``: built in a temporary sibling folder, then renamed.

    An existing complete ``destination`` is kept unless ``force``; a stale or partial model folder
    (or an empty folder) is replaced; any other existing path raises NotAModelFolderError (a FileExistsError).
    ``heldout_max_bytes`` caps the held-out text scored for ``training.json`` (None: all of it).
    """
    destination = Path(destination)
    if not force and is_complete(destination, spec):
        return destination
    _check_replaceable(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=destination.parent, prefix=f".{destination.name}.building."))
    staging.chmod(0o755)  # mkdtemp makes it private; the finished model folder is an ordinary one
    try:
        from .train import build_into  # torch and transformers: only when a model is trained

        build_into(staging, spec, num_threads=num_threads, progress=progress, heldout_max_bytes=heldout_max_bytes)
        if destination.exists():
            retired = Path(tempfile.mkdtemp(dir=destination.parent, prefix=f".{destination.name}.old."))
            destination.rename(retired / destination.name)
            shutil.rmtree(retired, ignore_errors=True)
        try:
            staging.rename(destination)
        except OSError:
            # Another process finished the same build first: keep its folder if it is complete.
            if not is_complete(destination, spec):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return destination
