"""The reference models quantkit ships, and how a name becomes a model folder."""

from __future__ import annotations

from pathlib import Path

from ..core.errors import UsageError
from .spec import RefModelSpec
from .store import REF_PREFIX, build_atomically, cache_folder, committed_folder, is_complete

REFERENCE_MODELS: dict[str, RefModelSpec] = {
    # ~0.9M parameters; trains in about a minute on 2 cores. For tests and quick demos.
    "tiny": RefModelSpec(
        name="tiny",
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        context_length=256,
        steps=200,
        batch_size=16,
        lr=3e-3,
        warmup_steps=20,
        seed=0,
        max_train_bytes=3_000_000,
    ),
    # 5.3M parameters, on the whole train split (~0.6 epoch). For demos and reports.
    "small": RefModelSpec(
        name="small",
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        context_length=512,
        steps=700,
        batch_size=4,
        lr=2e-3,
        warmup_steps=40,
        seed=0,
    ),
}


def get_spec(name: str) -> RefModelSpec:
    """The spec registered as ``name``; an unknown name raises UsageError (a ValueError) listing the known ones."""
    try:
        return REFERENCE_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(REFERENCE_MODELS))
        raise UsageError(f"unknown reference model {name!r}: choose one of {known}") from None


def reference_model_path(name: str, *, rebuild: bool = False) -> Path:
    """The folder of reference model ``name``, ready for ``from_pretrained``.

    The committed folder inside the package when it is complete and matches the current spec;
    otherwise (or with ``rebuild=True``) the model is trained into the user's cache folder
    (``<cache>/refmodels/<name>-<spec hash>``; written atomically) and that folder is returned.
    """
    spec = get_spec(name)
    committed = committed_folder(spec)
    if not rebuild and is_complete(committed, spec):
        return committed
    return build_atomically(spec, cache_folder(spec), force=rebuild)


def resolve_model_name(name: str) -> str:
    """Map ``ref:<name>`` to that reference model's folder; return any other name unchanged."""
    if isinstance(name, str) and name.startswith(REF_PREFIX):
        return str(reference_model_path(name[len(REF_PREFIX):]))
    return name
