"""Model folders in: resolve names (reference models, local paths, hub ids), read config.json, load float models."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ..core.device import resolve_device
from ..core.errors import CheckpointError, QuantkitError, first_names
from ..files.source_check import check_source, source_mismatch
from ..modules.targets import set_submodule
from ..refmodels import resolve_model_name
from .safetensors_io import folder_tensors, stored_float_dtype

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


# A hub id: "name" or "owner/name" of letters, digits, "-", "_", "."; anything else can only be a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def resolve_model_source(name: str | os.PathLike) -> str:
    """`ref:<name>` -> the built-in reference model's folder; an existing local path (`~` expanded) or a hub
    id is returned as is. A missing path that can only be local (starts with `.`, `/` or `~`, its parent
    folder exists, it names a .json/.safetensors file, or it is no valid hub id) raises CheckpointError at
    once instead of asking the hub."""
    source = resolve_model_name(str(name))
    local = Path(os.path.expanduser(source))
    if local.exists():
        return str(local) if source.startswith("~") else source
    parent = local.parent
    looks_local = (
        source.startswith((".", "/", "~", os.sep)) or (str(parent) not in ("", ".") and parent.is_dir())
        or not _HUB_ID.fullmatch(source) or source.endswith((".json", ".safetensors"))
    )
    if looks_local:
        raise CheckpointError(
            f"model folder {source} does not exist (a local path, so the hub was not asked); check the path"
        )
    return source


def read_config_json(folder: Path) -> dict:
    """The model folder's config.json as a dict; CheckpointError if it is missing, not JSON or not an object."""
    path = folder / "config.json"
    if folder.is_file():
        raise CheckpointError(f"{folder} is not a model folder but a file; give the folder that holds the model "
                              f"({folder.expanduser().resolve().parent})")
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a model folder: it has no config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested thousands of levels deep
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-create the checkpoint") from None
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(config).__name__}, not an object of model settings; "
            f"re-create it (e.g. with model.config.save_pretrained)"
        )
    return config


def is_quantized_checkpoint(source: str) -> bool:
    folder = Path(source)
    return folder.is_dir() and "quantization_config" in read_config_json(folder)


def refuse_quantized_tensors(folder: Path, tensor_names: Iterable[str]) -> None:
    """CheckpointError when a folder whose config.json has no quantization_config holds quantized tensors
    (weight_packed, weight_scale, ...): a checkpoint whose config.json was replaced or edited, which
    transformers would load as a float model with random weights in every quantized linear."""
    # import time: it loads the kernels, which reading a config or a float model never needs
    from ..modules.quant_linear import CHECKPOINT_TENSORS

    quantized = sorted((name for name in tensor_names if name.rpartition(".")[2] in CHECKPOINT_TENSORS),
                       key=lambda name: (not name.endswith(".weight_packed"), name))
    if quantized:
        shown = first_names(quantized, 3)
        raise CheckpointError(
            f"{folder} holds quantized tensors ({shown}) but its config.json has no quantization_config: the "
            f"config was replaced or edited, and without it every quantized linear would load as random weights; "
            f"restore the config.json written with the checkpoint, or re-create the checkpoint (quantkit quantize)"
        )


def load_float_model(
    source: str, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
    trust_remote_code: bool = False, strict: bool = True,
) -> nn.Module:
    """A transformers causal LM from a local folder or hub id, weights from safetensors only.

    dtype: the dtype to run in (default: config.json's). For a local folder the dtype its weights
    are stored in is recorded on the model (source_dtype(model)): checkpoints are saved in it.
    strict: refuse (CheckpointError naming the tensors) a source the model would not reproduce: tensors
    missing, unexpected or of another shape than config.json describes, float weights stored as integers
    or fp8 (quantkit.files.source_check); False loads it as transformers does, with a warning.
    """
    from transformers import AutoModelForCausalLM  # import time: transformers loads only where it is used

    device = resolve_device(device)
    source = resolve_model_source(source)
    local = Path(source)
    stored = dtypes = None
    if local.exists():
        if local.suffix.lower() == ".gguf":
            raise CheckpointError(
                f"{source} is a GGUF file, not a float model folder (config.json and *.safetensors); its weights are "
                f"on a quantization grid already, unless it is an F16/F32 file, and quantizing them again rounds "
                f"rounded weights: quantize the float model it was made from (quantkit.load and `quantkit eval` run "
                f"the file as it is)")
        if not local.is_dir():
            raise CheckpointError(f"{source} is a file; pass the model folder (with config.json and *.safetensors)")
        if "quantization_config" in read_config_json(local):
            raise CheckpointError(
                f"{source} is already a quantized checkpoint; quantize the float model it was made from "
                f"(quantkit.load / `quantkit eval` run it as it is)"
            )
        headers = folder_tensors(local)  # checks every weight file
        refuse_quantized_tensors(local, headers)
        stored = stored_float_dtype(local)
        dtypes = {name: header.dtype for name, header in headers.items()}
    config = load_model_config(source, trust_remote_code=trust_remote_code)
    try:
        with _quiet_loading_report():  # check_source names what it reports
            model, info = AutoModelForCausalLM.from_pretrained(
                source, config=config, dtype=dtype or "auto", use_safetensors=True, trust_remote_code=trust_remote_code,
                output_loading_info=True, ignore_mismatched_sizes=True,
            )
    except (ValueError, KeyError, TypeError) as e:  # the model's code refusing its config (e.g. an unknown rope_type)
        msg = str(e)
        if "Unrecognized configuration class" in msg or "model type" in msg:
            raise CheckpointError(
                f"{source}: unsupported architecture ({msg.splitlines()[0]}); quantkit quantizes causal LMs "
                f"that transformers can load with AutoModelForCausalLM (pass trust_remote_code only if you trust the code)"
            ) from None
        raise CheckpointError(f"{source}: transformers could not build the model ({type(e).__name__}: "
                              f"{_one_line(e)}); check config.json, or re-download the model") from None
    except OSError as e:
        raise CheckpointError(f"could not load {source!r}: {e}") from None
    except RuntimeError as e:  # transformers' own report of weights it cannot place (e.g. a failed conversion)
        raise CheckpointError(f"{source}: transformers could not load the weights ({_one_line(e)}); "
                              f"check config.json against the weights, or re-download the model") from None
    check_source(source, source_mismatch(model, info, dtypes), strict=strict)
    if stored is not None:
        setattr(model, SOURCE_DTYPE_ATTRIBUTE, stored)
    return model.to(device).eval()


def load_model_config(source: str, *, trust_remote_code: bool = False):
    """transformers' config of a model folder or hub id. CheckpointError when config.json is invalid (a value
    of the wrong type, an impossible size, no model_type) or names model code (auto_map) that
    trust_remote_code does not allow."""
    from transformers import AutoConfig  # import time: transformers loads only where it is used

    from ..modules.moe import moe_config_problem  # import time: it loads the kernels

    try:
        with config_errors(source):
            config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise CheckpointError(f"could not load {source!r}: {e}") from None
    problem = moe_config_problem(config)
    if problem:
        raise CheckpointError(f"{source}: {problem}")
    return config


@contextlib.contextmanager
def config_errors(source: str):
    """Turn transformers' errors about a model config (a value of the wrong type, an impossible size, no
    model_type, model code that may not run) into a CheckpointError naming `source`."""
    # transformers' own dependency, loaded only where it is used
    from huggingface_hub.errors import StrictDataclassError

    try:
        yield
    except QuantkitError:
        raise
    except (StrictDataclassError, ValueError, TypeError, KeyError, AttributeError) as e:
        if "trust_remote_code" in str(e):
            raise CheckpointError(
                f"{source} needs its own model code (config.json's auto_map), which quantkit runs only when asked: "
                f"pass --trust-remote-code (Python: trust_remote_code=True) if you trust that code"
            ) from None
        raise CheckpointError(f"{source}: invalid model config ({_one_line(e)}); correct config.json or "
                              f"re-download the model") from None


def _one_line(error: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (transformers' messages span several), at most `limit` characters."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def _quiet_loading_report():
    """Hold back transformers' table of missing/unexpected/mismatched keys while a model loads (a filter, not a
    level: transformers logs other tables when its logger's level changes)."""
    logger = logging.getLogger("transformers.modeling_utils")
    only_others = _DropLoadReport()
    logger.addFilter(only_others)
    try:
        yield
    finally:
        logger.removeFilter(only_others)


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


def empty_quantized_model(folder: Path, *, dtype: torch.dtype | None = None, trust_remote_code: bool = False):
    """The model a quantized checkpoint's config.json describes, on the meta device, its quantized linears
    replaced by QuantLinear layers: (model, parsed quantization config, dtype it is built in).

    dtype: default config.json's dtype (float32 if it has none).
    """
    from accelerate import init_empty_weights  # import time: accelerate loads only where it is used
    from transformers import AutoModelForCausalLM  # import time: transformers loads only where it is used

    # import time: it loads the kernels, which reading a config or a float model never needs
    from ..modules.quant_linear import QuantLinear
    from .compressed_tensors import parse_quantization_config

    raw = read_config_json(folder)
    qcfg = parse_quantization_config(raw["quantization_config"], str(folder / "config.json"))
    config = load_model_config(str(folder), trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    import transformers  # import time: transformers loads only where it is used

    arch = (getattr(config, "architectures", None) or [""])[0]
    named = getattr(transformers, arch, None)  # the class config.json names: BertModel, *ForSequenceClassification
    try:
        with init_empty_weights():
            model = (named._from_config(config, dtype=dtype) if isinstance(named, type) and hasattr(named, "_from_config")
                     else AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code))
    except ValueError as e:
        raise CheckpointError(f"{folder}: unsupported architecture ({str(e).splitlines()[0]})") from None
    # import time: it loads the kernels, which reading a config or a float model never needs
    from ..modules.moe import model_type, to_disk_name, unfuse_experts

    unfuse_experts(model)  # MoE: per-expert linears, as the checkpoint stores them
    mtype = model_type(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            scheme = qcfg.scheme_for(to_disk_name(name, mtype), module)
            if scheme is not None:
                q = QuantLinear(module.in_features, module.out_features, scheme, bias=module.bias is not None,
                                dtype=dtype, device="meta")
                set_submodule(model, name, q)
    return model, qcfg, dtype


def copy_tokenizer_files(source: str | None, dest: Path) -> list[str]:
    """Copy tokenizer files from a local model folder (or save a hub tokenizer); returns what was written."""
    if not source:
        return []
    src = Path(source)
    if src.is_dir():
        copied = []
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, dest / name)  # new file, the user's umask
                copied.append(name)
        return copied
    try:
        from transformers import AutoTokenizer  # import time: transformers loads only where it is used

        AutoTokenizer.from_pretrained(source).save_pretrained(dest)
        return sorted(p.name for p in dest.iterdir() if p.name in TOKENIZER_FILES)
    except (OSError, ValueError):
        return []


def tokenizer_bytes(source: str | None) -> int:
    """Bytes of the tokenizer files copy_tokenizer_files would copy from a local folder (0 for a hub id)."""
    if not source or not Path(source).is_dir():
        return 0
    return sum((Path(source) / name).stat().st_size for name in TOKENIZER_FILES if (Path(source) / name).is_file())


def folder_size_bytes(folder: Path, pattern: str = "*.safetensors") -> int:
    return sum(p.stat().st_size for p in Path(folder).glob(pattern))
