"""Where reference models live: the committed folders in the package, else the user's cache.

A folder is usable when it holds every file of ``REQUIRED_FILES`` and its ``training.json`` names the
current spec's hash (so weights trained under an older spec are never returned for a newer one).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..files.outputs import atomic_output_dir
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
    """``<cache>/refmodels/<name>-<spec hash>`` (cache: corpus.cache_root())."""
    return corpus.cache_root() / "refmodels" / spec.folder_name()


def is_complete(folder: Path, spec: RefModelSpec) -> bool:
    """True when ``folder`` holds a whole model built from exactly ``spec``."""
    folder = Path(folder)
    try:  # OSError: a path that cannot be a folder (a name too long, a file on the way) holds no model
        if not all((folder / name).is_file() for name in REQUIRED_FILES):
            return False
        record = json.loads((folder / TRAINING_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return record.get("spec_hash") == spec.spec_hash()


def build_atomically(spec: RefModelSpec, destination: Path, *, force: bool = False,
                     num_threads: int | None = None, progress: bool = True,
                     heldout_max_bytes: int | None = None) -> Path:
    """Train ``spec`` into ``destination``: built in a temporary sibling folder, then moved into place.

    An existing complete ``destination`` is kept unless ``force``; otherwise an existing ``destination``
    is replaced only when it is an output quantkit wrote (an empty folder, a reference model folder, see
    quantkit.files.outputs.check_replaceable), else FileExistsError. When another process finishes a build of
    the same model there meanwhile, its folder is kept.
    ``heldout_max_bytes`` caps the held-out text scored for ``training.json`` (None: all of it).
    """
    destination = Path(destination)
    if not force and is_complete(destination, spec):
        return destination
    try:
        with atomic_output_dir(destination, force=True, known_files=REQUIRED_FILES) as staging:
            from .train import build_into  # torch and transformers: only when a model is trained

            build_into(staging, spec, num_threads=num_threads, progress=progress, heldout_max_bytes=heldout_max_bytes)
    except FileExistsError:  # refused, or another process wrote it meanwhile: keep that if it is this model
        if not is_complete(destination, spec):
            raise
    return destination
