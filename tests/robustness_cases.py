"""Bad inputs a user can give the command line, each with the message it must get.

More sets of cases live beside this file as `robustness_cases_<topic>.py`, each with a `CASES` list of
its own (built with `Case` and the shared models below, imported relatively); `all_cases()` gathers
them all. Used twice: tests/test_robustness.py runs every case in process (exit status 2, the message
on stderr, no traceback, nothing written), and evals/robustness.py runs every case as a real `quantkit`
process to write the table in evals/robustness.md (a topic's in evals/robustness-<topic>.md). A case builds what it needs under its own work folder (the
current folder while it runs; models shared by all cases go beside it, in `_shared/`) and returns the
command's arguments.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    name: str  # short id (test id)
    bad_input: str  # what the user got wrong, in words
    setup: Callable[[Path], list[str]]  # work folder -> argv (without "quantkit")
    expect: str  # a fragment of the error message (status 0: of what `check` returns)
    needs_non_root: bool = False  # permissions do not stop root
    creates: str | None = None  # a path (relative to the work folder) that must not exist afterwards
    skip: Callable[[], str | None] | None = None  # a reason not to run it in this process, or None
    absent: str | None = None  # a fragment the error message must not hold (advice that would not work)
    status: int = 2  # 0: an odd input that is valid and must be handled right (then `check` says how)
    check: Callable[[Path, str], str] | None = None  # (work folder, stdout) -> what happened; asserts it was right


@dataclass(frozen=True)
class PythonCase:
    """A bad input of the Python API: `call(work)` must raise `error` with `expect` in its message (and not
    `absent`), and leave `creates` unwritten."""

    name: str
    bad_input: str
    call: Callable[[Path], object]
    error: type
    expect: str
    absent: str | None = None
    creates: str | None = None


# -- inputs built on the committed tiny reference model --------------------------------------------------

def float_folder(work: Path) -> Path:
    """A copy of the tiny reference model's folder (float, with tokenizer)."""
    dest = work.parent / "_shared" / "tiny-float"
    if not dest.exists():
        from quantkit.loading import resolve_model_source

        shutil.copytree(resolve_model_source("ref:tiny"), dest)
    return dest


def checkpoint(work: Path) -> Path:
    """The tiny reference model quantized with w4a16-rtn."""
    dest = work.parent / "_shared" / "tiny-w4"
    if not dest.exists():
        import quantkit

        model = quantkit.quantize(quantkit.load(float_folder(work)), "w4a16-rtn", progress=False)
        quantkit.save(model, dest)
    return dest


def _copy(src: Path, dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    return dest


def _rewrite_header(path: Path, edit: Callable[[dict], None]) -> None:
    """Change a safetensors file's JSON header in place (the tensor bytes stay as they are)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _overlapping_offsets(header: dict) -> None:
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    begin, end = header[names[1]]["data_offsets"]
    header[names[1]]["data_offsets"] = [0, end - begin]  # the second tensor claims the first one's bytes


def _wrong_size_offsets(header: dict) -> None:
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end + 4]


def _recipe(work: Path, name: str, text: str) -> str:
    path = work / f"{name}.yaml"
    path.write_text(text)
    return str(path)


W4 = "weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}\n"


def _out(work: Path) -> str:
    return str(work / "out")


# -- the cases ---------------------------------------------------------------------------------------------

def _device_cuda(work):
    return ["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", _out(work), "--device", "cuda:99"]


def _bench_device(work):
    return ["bench", "ref:tiny", "--device", "cuda:99"]


def _baseline_ref_nothing(work):
    return ["eval", str(checkpoint(work)), "--baseline", "ref:nothing"]


def _other_baseline(work):
    return ["eval", str(checkpoint(work)), "--baseline", "ref:small", "--max-tokens", "1024"]


def _quantize_quantized(work):
    return ["quantize", str(checkpoint(work)), "--recipe", "w4a16-rtn", "--out", _out(work)]


def _float_bits(work):
    recipe = _recipe(work, "float-bits", W4.replace("num_bits: 4", "num_bits: 4.0"))
    return ["quantize", "ref:tiny", "--recipe", recipe, "--out", _out(work)]


def _string_bool(work):
    recipe = _recipe(work, "string-bool", W4.replace("symmetric: true", 'symmetric: "false"'))
    return ["quantize", "ref:tiny", "--recipe", recipe, "--out", _out(work)]


def _targets_nothing(work):
    recipe = _recipe(work, "no-targets", W4 + "targets: [attention_of_nothing]\n")
    return ["quantize", "ref:tiny", "--recipe", recipe, "--out", _out(work)]


def _bad_regex(work):
    recipe = _recipe(work, "bad-regex", W4 + 'targets: ["re:.*(proj"]\n')
    return ["quantize", "ref:tiny", "--recipe", recipe, "--out", _out(work)]


def _config_list(work):
    folder = _copy(float_folder(work), work / "config-list")
    (folder / "config.json").write_text("[1, 2, 3]\n")
    return ["quantize", str(folder), "--recipe", "w4a16-rtn", "--out", _out(work)]


def _overlapping(work):
    folder = _copy(float_folder(work), work / "overlapping")
    _rewrite_header(folder / "model.safetensors", _overlapping_offsets)
    return ["quantize", str(folder), "--recipe", "w4a16-rtn", "--out", _out(work)]


def _wrong_size(work):
    folder = _copy(checkpoint(work), work / "wrong-size")
    _rewrite_header(folder / "model.safetensors", _wrong_size_offsets)
    return ["eval", str(folder), "--baseline", "ref:tiny"]


def _out_under_file(work):
    (work / "a-file").write_text("not a folder\n")
    return ["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", str(work / "a-file" / "out")]


def _read_only_out(work):
    locked = work / "read-only"
    locked.mkdir(exist_ok=True)
    os.chmod(locked, 0o555)
    return ["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", str(locked / "out")]


def _unknown_gpu(work):
    return ["bench", "ref:tiny", "--gpu", "rtx9999", "--device", "cpu"]


def _repeats_zero(work):
    return ["bench", "ref:tiny", "--repeats", "0"]


def _memory_negative(work):
    return ["advise", "ref:tiny", "--gpu", "h200", "--prompt-len", "512", "--output-len", "64", "--memory", "-1"]


def _binary_data(work):
    path = work / "binary.txt"
    path.write_bytes(bytes(range(256)) * 16)
    return ["eval", str(checkpoint(work)), "--baseline", "ref:tiny", "--data", str(path)]


def _data_unknown_type(work):
    path = work / "text.docx"
    path.write_bytes(b"PK\x03\x04")
    return ["eval", str(checkpoint(work)), "--baseline", "ref:tiny", "--data", str(path)]


def _missing_dot_path(work):
    return ["quantize", "./no-such-model", "--recipe", "w4a16-rtn", "--out", _out(work)]


def _missing_in_existing_folder(work):
    (work / "models").mkdir(exist_ok=True)
    return ["quantize", "models/no-such-model", "--recipe", "w4a16-rtn", "--out", _out(work)]


def _existing_out(work):
    (work / "out").mkdir(exist_ok=True)
    return ["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", _out(work)]


def _report_over_report(work):
    quality = work / "quality.json"
    quality.write_text(json.dumps({"recipe": "w4a16-rtn", "perplexity": 12.0, "baseline_perplexity": 11.0}) + "\n")
    previous = work / "report"
    from quantkit.cli import main

    assert main(["report", "--quality", str(quality), "--out", str(previous)]) == 0  # an earlier report
    return ["report", "--quality", str(quality), "--out", str(previous)]


def _report_binary_quality(work):
    path = work / "quality.bin"
    path.write_bytes(bytes(range(256)))
    return ["report", "--quality", str(path), "--out", str(work / "report-b")]


def _json_into_folder(work):
    (work / "results").mkdir(exist_ok=True)
    return ["eval", str(checkpoint(work)), "--baseline", "ref:tiny", "--json", str(work / "results")]


def _malformed_device(work):
    return ["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", _out(work), "--device", "banana"]


def _unknown_backend(work):
    return ["eval", str(checkpoint(work)), "--baseline", "ref:tiny", "--backend", "fastest"]


def _unknown_recipe(work):
    return ["quantize", "ref:tiny", "--recipe", "w4a16-magic", "--out", _out(work)]


def _no_tokenizer(work):
    folder = _copy(float_folder(work), work / "no-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    return ["eval", str(checkpoint(work)), "--baseline", str(folder)]


def _inspect_file(work):
    (work / "model.safetensors").write_bytes(b"\0" * 16)
    return ["inspect", str(work / "model.safetensors")]


CASES = [
    Case("device-cuda", "`--device` names a CUDA device this machine lacks", _device_cuda, "CUDA device", creates="out"),
    Case("bench-device-cuda", "`bench --device` names a CUDA device this machine lacks", _bench_device, "CUDA device"),
    Case("baseline-ref-nothing", "`--baseline ref:nothing` (no such reference model)", _baseline_ref_nothing,
         "unknown reference model 'nothing'"),
    Case("other-baseline", "a checkpoint evaluated against another model's baseline", _other_baseline,
         "vocabulary of 4096 tokens but the baseline has 8192"),
    Case("quantize-quantized", "quantizing an already quantized checkpoint", _quantize_quantized,
         "already a quantized checkpoint", creates="out"),
    Case("recipe-float-bits", "recipe `num_bits: 4.0`", _float_bits, "num_bits must be an integer", creates="out"),
    Case("recipe-string-bool", "recipe `symmetric: \"false\"` (a string)", _string_bool,
         "symmetric must be true or false", creates="out"),
    Case("targets-match-nothing", "recipe targets that match no layer", _targets_nothing,
         "no nn.Linear module matches", creates="out"),
    Case("bad-regex", "recipe target `re:.*(proj` (not a regular expression)", _bad_regex,
         "not a valid regular expression", creates="out"),
    Case("config-json-list", "config.json holding a JSON list", _config_list, "holds a JSON list", creates="out"),
    Case("safetensors-overlap", "safetensors header whose offsets overlap", _overlapping, "overlap the tensor before it",
         creates="out"),
    Case("safetensors-size", "safetensors header whose offsets do not match a tensor's size", _wrong_size,
         "the file is corrupt"),
    Case("out-under-file", "`--out` inside a regular file", _out_under_file, "is a file, not a folder"),
    Case("out-read-only", "`--out` in a read-only folder (checked before any work)", _read_only_out,
         "is not writable", needs_non_root=True),
    Case("bench-unknown-gpu", "`bench --gpu rtx9999`", _unknown_gpu, "unknown GPU 'rtx9999'"),
    Case("bench-repeats-zero", "`bench --repeats 0`", _repeats_zero, "--repeats: must be an integer >= 1"),
    Case("advise-negative-memory", "`advise --memory -1`", _memory_negative, "--memory: must be > 0"),
    Case("eval-binary-data", "binary `--data` file", _binary_data, "could not be read as UTF-8 text"),
    Case("eval-data-unknown-type", "`--data` of an unknown file type", _data_unknown_type,
         "evaluation file"),
    Case("missing-dot-path", "missing model folder `./no-such-model` (no hub retries)", _missing_dot_path,
         "does not exist", creates="out"),
    Case("missing-in-existing-folder", "missing `models/no-such-model` where `models/` exists (no hub retries)",
         _missing_in_existing_folder, "does not exist", creates="out"),
    Case("existing-out", "`quantize --out` that exists, without `--force`", _existing_out,
         "choose another --out, or pass --force"),
    Case("report-over-report", "`report --out` holding a report, without `--force`", _report_over_report,
         "report.md already exists"),
    Case("report-binary-quality", "`report --quality` of a binary file", _report_binary_quality,
         "cannot read quality results", creates="report-b"),
    Case("eval-json-folder", "`eval --json` naming a folder", _json_into_folder, "is a folder"),
    Case("device-malformed", "`--device banana`", _malformed_device, "is not a device name", creates="out"),
    Case("eval-unknown-backend", "`eval --backend fastest`", _unknown_backend, "choose one of auto, triton"),
    Case("unknown-recipe", "`--recipe w4a16-magic` (no such recipe)", _unknown_recipe, "built-in recipes:",
         creates="out"),
    Case("baseline-without-tokenizer", "a baseline folder without tokenizer files", _no_tokenizer,
         "needs its tokenizer files"),
    Case("inspect-a-file", "`inspect` of a weights file instead of its folder", _inspect_file,
         "is not a model folder"),
]


def all_cases(kind: str = "CASES") -> list:
    """CASES here, then those of every `robustness_cases_<topic>.py` beside this file, by file name
    (kind="PYTHON_CASES": the Python API's cases of the topics that have some)."""
    import importlib

    cases = list(globals().get(kind, []))
    for path in sorted(Path(__file__).parent.glob("robustness_cases_*.py")):
        cases += getattr(importlib.import_module(f"{__package__}.{path.stem}"), kind, [])
    return cases
