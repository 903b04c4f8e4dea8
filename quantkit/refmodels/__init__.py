"""Built-in reference models: small Llama-architecture models trained on the Python standard library.

quantkit's tests and default demo cannot download models, so the project trains its own,
deterministically, on the running Python's standard-library source (train/held-out split by file).
The trained weights (bf16) and tokenizers are committed under ``quantkit/refmodels/weights/<name>/``;
``reference_model_path`` returns that folder, or trains the model into the user's cache when it is
missing or stale. ``python -m quantkit.refmodels build NAME`` regenerates one.

    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained(reference_model_path("tiny"))
"""

from .cli import add_build_arguments, run_build
from .corpus import heldout_text_path, train_text_path
from .registry import REFERENCE_MODELS, get_spec, reference_model_path, resolve_model_name
from .spec import RefModelSpec

__all__ = [
    "REFERENCE_MODELS",
    "RefModelSpec",
    "add_build_arguments",
    "get_spec",
    "heldout_text_path",
    "reference_model_path",
    "resolve_model_name",
    "run_build",
    "train_text_path",
]
