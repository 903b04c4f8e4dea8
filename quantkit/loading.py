"""Model folders in and out: resolve names, load float or quantized models, write checkpoints atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from .errors import CheckpointError
from .formats.safetensors_io import check_complete, safetensors_files, stored_float_dtype

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)


#: Attribute that load_float_model sets on a model: the floating dtype its source weights are stored in
#: on disk (the dtype quantkit.save writes by default), which may differ from the dtype it runs in.
SOURCE_DTYPE_ATTRIBUTE = "quantkit_source_dtype"


def source_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype a model's source weights were stored in (see SOURCE_DTYPE_ATTRIBUTE); for a
    model quantkit did not load, the dtype it holds."""
    stored = getattr(model, SOURCE_DTYPE_ATTRIBUTE, None)
    if isinstance(stored, torch.dtype):
        return stored
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def resolve_model_source(name: str | os.PathLike) -> str:
    """`ref:<name>` -> the built-in reference model's folder; a local path or hub id is returned as is."""
    from .refmodels import resolve_model_name

    return resolve_model_name(str(name))


def read_config_json(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a model folder: it has no config.json")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-create the checkpoint") from None


def is_quantized_checkpoint(source: str) -> bool:
    folder = Path(source)
    return folder.is_dir() and "quantization_config" in read_config_json(folder)


def load_float_model(
    source: str, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> nn.Module:
    """A transformers causal LM from a local folder or hub id, weights from safetensors only.

    dtype: the dtype to run in (default: config.json's). For a local folder the dtype its weights
    are stored in is recorded on the model (source_dtype(model)): checkpoints are saved in it.
    """
    from transformers import AutoModelForCausalLM

    source = resolve_model_source(source)
    local = Path(source)
    stored = None
    if local.exists():
        if not local.is_dir():
            raise CheckpointError(f"{source} is a file; pass the model folder (with config.json and *.safetensors)")
        read_config_json(local)
        for f in safetensors_files(local):
            check_complete(f)
        stored = stored_float_dtype(local)
    elif source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise CheckpointError(f"model folder {source} does not exist")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype or "auto", use_safetensors=True, trust_remote_code=trust_remote_code,
        )
    except ValueError as e:
        msg = str(e)
        if "Unrecognized configuration class" in msg or "model type" in msg:
            raise CheckpointError(
                f"{source}: unsupported architecture ({msg.splitlines()[0]}); quantkit quantizes causal LMs "
                f"that transformers can load with AutoModelForCausalLM (pass trust_remote_code only if you trust the code)"
            ) from None
        raise
    except OSError as e:
        raise CheckpointError(f"could not load {source!r}: {e}") from None
    if stored is not None:
        setattr(model, SOURCE_DTYPE_ATTRIBUTE, stored)
    return model.to(device).eval()


def empty_quantized_model(folder: Path, *, dtype: torch.dtype | None = None, trust_remote_code: bool = False):
    """The model a quantized checkpoint's config.json describes, on the meta device, its quantized linears
    replaced by QuantLinear layers: (model, parsed quantization config, dtype it is built in).

    dtype: default config.json's dtype (float32 if it has none).
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from .formats.compressed_tensors import parse_quantization_config
    from .modules.quant_linear import QuantLinear
    from .targets import set_submodule

    raw = read_config_json(folder)
    qcfg = parse_quantization_config(raw["quantization_config"], str(folder / "config.json"))
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise CheckpointError(f"{folder}: unsupported architecture ({str(e).splitlines()[0]})") from None
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            scheme = qcfg.scheme_for(name, module)
            if scheme is not None:
                q = QuantLinear(module.in_features, module.out_features, scheme, bias=module.bias is not None,
                                dtype=dtype, device="meta")
                set_submodule(model, name, q)
    return model, qcfg, dtype


@contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `out_dir`; on success it is renamed to `out_dir`.

    An existing `out_dir` is refused unless force; with force it is replaced only after the new
    folder is complete. On failure the temporary folder is removed and `out_dir` is untouched.
    """
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not force:
        raise FileExistsError(f"output folder {out} already exists; choose another --out or pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_tokenizer_files(source: str | None, dest: Path) -> list[str]:
    """Copy tokenizer files from a local model folder (or save a hub tokenizer); returns what was written."""
    if not source:
        return []
    src = Path(source)
    if src.is_dir():
        copied = []
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, dest / name)
                copied.append(name)
        return copied
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source).save_pretrained(dest)
        return sorted(p.name for p in dest.iterdir() if p.name in TOKENIZER_FILES)
    except (OSError, ValueError):
        return []


def folder_size_bytes(folder: Path, pattern: str = "*.safetensors") -> int:
    return sum(p.stat().st_size for p in Path(folder).glob(pattern))
