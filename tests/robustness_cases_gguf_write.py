"""GGUF outputs (`quantize --out FILE.gguf`, `export`): what they replace, cannot hold and say."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .robustness_cases import Case, checkpoint, float_folder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _quantize_gguf(work: Path, out: str = "out.gguf", recipe: str = "w4a16-rtn-q40", source: str = "ref:tiny"):
    return ["quantize", source, "--recipe", recipe, "--out", str(work / out)]


def _export(work: Path, out: str = "out.gguf", ckpt: Path | None = None) -> list[str]:
    return ["export", str(ckpt or checkpoint(work)), "--format", "gguf", "--out", str(work / out)]


def _metadata(path: Path) -> dict[str, str]:
    """The quantkit.* string entries of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("quantkit.")}


# -- outputs quantkit did not write ---------------------------------------------------------------------------

def _notes(work: Path) -> None:
    (work / "notes.gguf").write_text("my notes, not a model\n")


def _quantize_force_over_text(work):
    _notes(work)
    return [*_quantize_gguf(work, "notes.gguf"), "--force"]


def _export_force_over_text(work):
    _notes(work)
    return [*_export(work, "notes.gguf"), "--force"]


def foreign_gguf(path: Path) -> Path:
    """A valid GGUF file another tool wrote (no quantkit marker)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("not quantkit's")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _export_force_over_foreign_gguf(work):
    foreign_gguf(work / "theirs.gguf")
    return [*_export(work, "theirs.gguf"), "--force"]


def _export_over_foreign_gguf(work):
    foreign_gguf(work / "theirs.gguf")
    return _export(work, "theirs.gguf")


def _quantize_out_link(work):
    (work / "real.gguf").write_text("")
    (work / "link.gguf").symlink_to("real.gguf")
    return _quantize_gguf(work, "link.gguf")


def _export_dev_null(work):
    return ["export", str(checkpoint(work)), "--format", "gguf", "--out", os.devnull]


def stale_temporary(out: Path) -> Path:
    """A temporary file a killed run left beside the output `out` (its process is gone)."""
    import subprocess

    ended = subprocess.Popen(["true"])
    ended.wait()  # its process id names no process now
    tmp = out.with_name(f".{out.name}.tmp-{ended.pid}-0badc0de")
    tmp.write_bytes(b"\0" * 4096)
    return tmp


def _stale_temporary(work):
    stale_temporary(work / "out.gguf")
    return _export(work)


def _check_stale_removed(work, out):
    left = sorted(p.name for p in work.iterdir() if p.name.startswith(".out.gguf"))
    assert left == [], left
    return "the killed run's temporary file removed"


# -- what a GGUF file cannot hold -----------------------------------------------------------------------------

def _quantize_kv_fp8(work):
    return _quantize_gguf(work, recipe="kv-fp8")


def _kv_checkpoint(work: Path) -> Path:
    dest = work.parent / "_shared" / "tiny-w4-kv"
    if not dest.exists():
        import quantkit

        model = quantkit.load(float_folder(work))
        model = quantkit.quantize(model, "w4a16-gptq-kv-fp8", _calibration(), progress=False)
        quantkit.save(model, dest)
    return dest


def _calibration():
    from quantkit.calibration import CalibrationConfig

    return CalibrationConfig(source="ref", num_samples=2, seq_len=256)


def _export_kv_checkpoint(work):
    return _export(work, ckpt=_kv_checkpoint(work))


def _check_kv_warning(work, out):
    assert (work / "out.gguf").is_file()
    [line] = [line for line in out.splitlines() if "warning:" in line]
    assert "FP8 KV cache scales are not written" in line and "--cache-type-k" in line, line
    return "written, with a warning: the FP8 KV cache scales are not written"


def sliding_window_folder(work: Path, window: int = 64) -> Path:
    """A random Mistral model (context 256) with a sliding window of `window` tokens, with ref:tiny's tokenizer."""
    import transformers

    folder = work / f"mistral-swa-{window}"
    if not folder.exists():
        config = transformers.MistralConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                                            max_position_embeddings=256, sliding_window=window)
        transformers.MistralForCausalLM(config).save_pretrained(folder)
        for name in TOKENIZER_FILES:
            shutil.copy(float_folder(work) / name, folder / name)
    return folder


def _quantize_sliding_window(work):
    return _quantize_gguf(work, source=str(sliding_window_folder(work)))


def _export_sliding_window(work):
    return ["export", str(sliding_window_folder(work)), "--format", "gguf", "--out", str(work / "out.gguf")]


def _export_window_past_context(work):
    folder = sliding_window_folder(work, window=256)  # no shorter than the context: the same as full attention
    return ["export", str(folder), "--format", "gguf", "--out", str(work / "out.gguf")]


def _check_written(work, out):
    assert (work / "out.gguf").is_file() and "wrote" in out, out
    return "written"


# -- what a GGUF write says -----------------------------------------------------------------------------------

def _export_float_type_q4k(work):
    return [*_export(work), "--float-type", "q4_k"]


def _check_fallback_line(work, out):
    [line] = [line for line in out.splitlines() if "q4_k asked" in line]
    assert "token_embd.weight" in line and "written as Q5_0" in line and "128 inputs" in line, line
    return line.strip()


def _quantize_provenance(work):
    return _quantize_gguf(work, recipe="w4a16-gptq-q40") + ["--calib-samples", "2", "--calib-seq-len", "256",
                                                             "--float-type", "q8_0"]


def _check_provenance(work, out):
    made = _metadata(work / "out.gguf")
    assert made["quantkit.written_by"].startswith("quantkit "), made
    assert Path(made["quantkit.source"]).name == "tiny", made
    assert "name: gptq" in made["quantkit.recipe"], made["quantkit.recipe"]
    assert "2 samples x 256 tokens" in made["quantkit.calibration"], made
    command = made["quantkit.command"]
    assert "--recipe w4a16-gptq-q40" in command and "--calib-samples 2" in command and "--float-type q8_0" in command
    [line] = [line for line in out.splitlines() if line.strip().startswith("calibration")]
    assert "2 samples x 256 tokens" in line, line
    return "quantkit.recipe, .calibration, .command in the file; the calibration line printed"


def _check_export_provenance(work, out):
    made = _metadata(work / "out.gguf")
    assert "# recipe     : w4a16-rtn" in made["quantkit.recipe"], made
    assert made["quantkit.command"].startswith("quantkit export "), made
    return "the checkpoint's recipe.yaml and the export command in the file"


CASES = [
    # outputs quantkit did not write
    Case("gguf-quantize-force-over-text", "`quantize --out notes.gguf --force` over a user's text file (was: "
         "replaced by the GGUF file)", _quantize_force_over_text, "it is not a GGUF file", absent="--force"),
    Case("gguf-export-force-over-text", "`export --out notes.gguf --force` over a user's text file (was: replaced)",
         _export_force_over_text, "it is not a GGUF file", absent="--force"),
    Case("gguf-export-force-over-foreign-gguf", "`export --out F.gguf --force` over a GGUF file another tool wrote "
         "(was: replaced)", _export_force_over_foreign_gguf, "a GGUF file quantkit did not write", absent="--force"),
    Case("gguf-export-over-foreign-gguf", "`export --out F.gguf` over a GGUF file another tool wrote (was: --force "
         "advised, which would replace it)", _export_over_foreign_gguf, "quantkit did not write", absent="--force"),
    Case("gguf-quantize-out-link", "`quantize --out LINK.gguf`, a symbolic link (was: --force advised, then "
         "refused)", _quantize_out_link, "it is a symbolic link", absent="--force"),
    Case("gguf-export-dev-null", "`export --out /dev/null` (was: --force advised, then refused)", _export_dev_null,
         "it is a character device", absent="--force"),
    Case("gguf-export-stale-temporary", "a temporary file a killed export left beside the output (was: never "
         "removed)", _stale_temporary, "temporary file removed", status=0, check=_check_stale_removed),
    # what a GGUF file cannot hold
    Case("gguf-quantize-kv-fp8", "`quantize --recipe kv-fp8 --out F.gguf` (was: a BF16 file, the KV cache "
         "dropped silently)", _quantize_kv_fp8, "which a GGUF file cannot hold", creates="out.gguf"),
    Case("gguf-export-kv-checkpoint", "`export` of a checkpoint with an FP8 KV cache (was: dropped silently)",
         _export_kv_checkpoint, "with a warning", status=0, check=_check_kv_warning),
    Case("gguf-quantize-sliding-window", "`quantize --out F.gguf` of a Mistral model with a sliding window of 64 "
         "(was: written with full attention)", _quantize_sliding_window, "has no sliding window", creates="out.gguf"),
    Case("gguf-export-sliding-window", "`export` of a Mistral model with a sliding window of 64 (was: written with "
         "full attention)", _export_sliding_window, "set \"sliding_window\": null", creates="out.gguf"),
    Case("gguf-export-window-of-the-context", "`export` of a Mistral model whose window is its whole context",
         _export_window_past_context, "written", status=0, check=_check_written),
    # what a GGUF write says
    Case("gguf-export-float-type-q4k", "`export --float-type q4_k` of a model 128 wide (was: Q5_0 without a word)",
         _export_float_type_q4k, "q4_k asked", status=0, check=_check_fallback_line),
    Case("gguf-quantize-provenance", "`quantize --recipe w4a16-gptq-q40 --out F.gguf` (was: no provenance, no "
         "calibration line)", _quantize_provenance, "calibration line printed", status=0, check=_check_provenance),
    Case("gguf-export-provenance", "`export` of a checkpoint (was: no provenance in the file)", lambda w: _export(w),
         "recipe.yaml and the export command", status=0, check=_check_export_provenance),
]
