"""GGUF files read by eval, inspect, bench and quantkit.load: corrupt headers and metadata, tensors llama.cpp would refuse, vocabularies and baselines that are not the file's"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from quantkit.errors import CheckpointError, QuantizationError, UsageError

from .robustness_cases import Case, PythonCase, checkpoint, float_folder

EVAL = ["--baseline", "ref:tiny", "--max-tokens", "512", "--window", "256"]


# -- GGUF files to read, and ways to tamper with them (the gguf package's reader and writer) -----------------

def gguf_file(work: Path, float_type: str = "auto") -> Path:
    """The tiny reference model quantized with w4a16-rtn, exported to GGUF (Q4_0; the embedding BF16, or
    `float_type`)."""
    dest = work.parent / "_shared" / f"tiny-{float_type}.gguf"
    if not dest.exists():
        import quantkit
        from quantkit.gguf.writing import export_gguf

        ckpt = checkpoint(work)
        part = dest.with_suffix(".part")
        export_gguf(quantkit.load(ckpt, backend="reference"), ckpt, part, float_type=float_type)
        part.rename(dest)
    return dest


def set_field(src: Path, dest: Path, key: str, value) -> Path:
    """A copy of `src` with the scalar metadata `key` changed in place to `value`."""
    import gguf

    shutil.copyfile(src, dest)
    reader = gguf.GGUFReader(str(dest), "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    reader.data.flush()
    return dest


def rewrite(src: Path, dest: Path, *, fields: dict | None = None, tensors=None) -> Path:
    """`src` written again as `dest` with the metadata values of `fields` (key -> value; None: left out) and the
    tensor list `tensors` makes of [(name, data, type)] (default: as they are)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dest), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind, value = field.types[0], (fields or {}).get(field.name, field.contents())
        if value is not None:
            writer.add_key_value(field.name, value, kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    listed = [(t.name, t.data, t.tensor_type) for t in reader.tensors]
    listed = tensors(listed) if tensors else listed
    for name, data, kind in listed:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in listed:
        writer.write_tensor_data(data)
    writer.close()
    return dest


def _eval(path: Path, *extra: str) -> list[str]:
    return ["eval", str(path), *EVAL, *extra]


def _edited(key: str, value):
    return lambda work: _eval(set_field(gguf_file(work), work / "bad.gguf", key, value))


def _nan_norm(work):
    import gguf
    import numpy as np

    path = work / "bad.gguf"
    shutil.copyfile(gguf_file(work), path)
    reader = gguf.GGUFReader(str(path), "r+")
    next(t for t in reader.tensors if t.name == "output_norm.weight").data[3] = np.nan
    reader.data.flush()
    return _eval(path)


def _tensor_count(work):
    path = work / "bad.gguf"
    data = bytearray(gguf_file(work).read_bytes())
    data[8:16] = (10**12).to_bytes(8, "little")
    path.write_bytes(data)
    return _eval(path)


def _unreadable(work):
    path = work / "locked.gguf"
    shutil.copyfile(gguf_file(work), path)
    path.chmod(0)
    return _eval(path)


def _truncated(work):
    path = work / "bad.gguf"
    path.write_bytes(gguf_file(work).read_bytes()[:600_000])
    return _eval(path)


def _not_gguf(work):
    (work / "notes.gguf").write_text("not a model\n")
    return _eval(work / "notes.gguf")


def _dropped(work):
    return _eval(rewrite(gguf_file(work), work / "bad.gguf",
                         tensors=lambda ts: [t for t in ts if t[0] != "blk.1.ffn_down.weight"]))


def _renamed(work):
    return _eval(rewrite(gguf_file(work), work / "bad.gguf",
                         tensors=lambda ts: [(n.replace("blk.1.ffn_down", "blk.1.ffn_dn"), d, k) for n, d, k in ts]))


def shuffled_vocabulary(src: Path, dest: Path) -> Path:
    import gguf

    tokens = list(gguf.GGUFReader(str(src)).fields["tokenizer.ggml.tokens"].contents())
    random.Random(0).shuffle(tokens)
    return rewrite(src, dest, fields={"tokenizer.ggml.tokens": tokens})


def _shuffled(work):
    return _eval(shuffled_vocabulary(gguf_file(work), work / "bad.gguf"))


def other_weights(work: Path) -> Path:
    """A model of the tiny reference model's shapes and tokenizer with other (random) weights."""
    dest = work.parent / "_shared" / "tiny-other"
    if not dest.exists():
        import torch
        import transformers

        torch.manual_seed(1)
        config = transformers.AutoConfig.from_pretrained(float_folder(work))
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(dest)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(float_folder(work) / name, dest / name)
    return dest


def _other_baseline(work):
    return ["eval", str(gguf_file(work, "q8_0")), "--baseline", str(other_weights(work)), "--max-tokens", "512"]


def _gguf_baseline(work):
    return ["eval", str(checkpoint(work)), "--baseline", str(gguf_file(work)), "--max-tokens", "512"]


def _inspect(work):
    return ["inspect", str(gguf_file(work))]


def _check_inspect(work, out):
    rows = [line.split() for line in out.splitlines()]
    assert "architecture llama, file type Q4_0)" in out and ["blk.1.ffn_down.weight", "Q4_0", "[384,", "128]", "27.0",
                                                            "KiB"] in rows, out[:600]
    return "architecture, shapes and each tensor's type and size"


def _inspect_file(work):
    shutil.copyfile(gguf_file(work), work / "model.bin")
    return ["inspect", "model.bin"]


def _bench_variant(work):
    return ["bench", "ref:tiny", "--variants", str(gguf_file(work)), "--prompt-lens", "8", "--context-lens", "8"]


def _bench_model(work):
    return ["bench", str(gguf_file(work)), "--variants", "w4a16-rtn", "--prompt-lens", "8", "--context-lens", "8"]


CASES = [
    Case("gguf-tensor-count", "a GGUF header that counts 10^12 tensors", _tensor_count, "more than a file of"),
    Case("gguf-head-count-0", "GGUF metadata attention.head_count 0", _edited("llama.attention.head_count", 0),
         "llama.attention.head_count = 0 is not a positive integer"),
    Case("gguf-embedding-129", "GGUF metadata embedding_length 129 (the tensors are 128 wide)",
         _edited("llama.embedding_length", 129), "embedding_length 129"),
    Case("gguf-kv-heads", "GGUF metadata head_count_kv 3, which does not divide 4 heads",
         _edited("llama.attention.head_count_kv", 3), "does not divide attention.head_count 4"),
    Case("gguf-rotary-odd", "GGUF metadata rope.dimension_count 33 (heads of 32)",
         _edited("llama.rope.dimension_count", 33), "not an even number of at most the head size 32"),
    Case("gguf-epsilon", "GGUF metadata layer_norm_rms_epsilon -1",
         _edited("llama.attention.layer_norm_rms_epsilon", -1.0), "is not a positive finite number"),
    Case("gguf-vocab-size", "GGUF metadata vocab_size 5000 beside 4096 tokens", _edited("llama.vocab_size", 5000),
         "differs from the 4096 tokens"),
    Case("gguf-bos-id", "GGUF metadata bos_token_id beyond the vocabulary",
         _edited("tokenizer.ggml.bos_token_id", 99999), "is no token id of the vocabulary of 4096"),
    Case("gguf-truncated", "a GGUF file cut short", _truncated, "truncated"),
    Case("gguf-nan", "a GGUF file with a NaN in a float tensor", _nan_norm, "1 NaN/Inf value"),
    Case("gguf-not-gguf", "a text file named notes.gguf", _not_gguf, "not a GGUF file"),
    Case("gguf-unreadable", "a GGUF file without read permission", _unreadable, "cannot be read", needs_non_root=True),
    Case("gguf-missing", "a .gguf path that does not exist (not asked of the hub)",
         lambda work: _eval(work / "nope.gguf"), "does not exist"),
    Case("gguf-dropped-tensor", "a GGUF file without one of its tensors (llama.cpp refuses it)", _dropped,
         "missing blk.1.ffn_down.weight"),
    Case("gguf-renamed-tensor", "a GGUF file with a tensor renamed (llama.cpp refuses it)", _renamed,
         "unexpected blk.1.ffn_dn.weight"),
    Case("gguf-shuffled-vocabulary", "a GGUF file whose vocabulary was shuffled (llama.cpp reads text with it)",
         _shuffled, "carries its own vocabulary, which is not the baseline's"),
    Case("gguf-other-baseline", "a baseline of other weights of the same shapes, the GGUF embedding quantized (Q8_0)",
         _other_baseline, "more than rounding to the GGUF file's grid leaves"),
    Case("gguf-as-baseline", "a quantized GGUF file as the baseline", _gguf_baseline, "the baseline is itself quantized"),
    Case("gguf-inspect", "inspect of a GGUF file", _inspect, "each tensor's type", status=0, check=_check_inspect),
    Case("gguf-inspect-other-file", "inspect of a file that is no model folder, by a bare name (the advice names the folder's whole path: `.` in this table)", _inspect_file, "not a model folder but a file",
         absent="(.)"),
    Case("gguf-quantize", "a GGUF file as the model to quantize", lambda work: [
        "quantize", str(gguf_file(work)), "--recipe", "w4a16-rtn", "--out", "out"], "on a quantization grid already",
        creates="out"),
    Case("gguf-bench-variant", "a GGUF file as a bench variant", _bench_variant, "llama-bench", absent="YAML"),
    Case("gguf-bench-model", "a GGUF file as bench's float model", _bench_model, "a GGUF file loads as float weights"),
]


def _save_dequantized(work):
    import quantkit

    quantkit.save(quantkit.load(gguf_file(work)), work / "out")


PYTHON_CASES = [
    PythonCase("gguf-load-backend", "quantkit.load(F.gguf, backend='bogus')",
               lambda work: __import__("quantkit").load(gguf_file(work), backend="bogus"), UsageError,
               "backend 'bogus' is unknown"),
    PythonCase("gguf-save-dequantized", "quantkit.save(quantkit.load(F.gguf), DIR)", _save_dequantized,
               QuantizationError, "dequantized to float weights", creates="out"),
    PythonCase("load-int-dtype", "quantkit.load(F.gguf, dtype=torch.int8)",
               lambda work: __import__("quantkit").load(gguf_file(work), dtype=__import__("torch").int8), UsageError,
               "is no dtype quantkit.load runs a model in"),
    PythonCase("gguf-load-missing", "quantkit.load of a .gguf path that does not exist",
               lambda work: __import__("quantkit").load(work / "nope.gguf"), CheckpointError, "does not exist"),
]
