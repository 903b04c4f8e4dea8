"""GGUF writes replace only GGUF files quantkit wrote, leave nothing behind when killed or out of space, refuse
what llama.cpp would run otherwise, and say what the file holds (fixtures/robustness_cases_gguf_write.py has the
command-line cases)."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
from collections import namedtuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

import quantkit  # noqa: E402
from quantkit.files import outputs  # noqa: E402
from quantkit.commands.cli import main  # noqa: E402
from quantkit.core.errors import UsageError  # noqa: E402
from quantkit.gguf import writing as gguf_format  # noqa: E402
from quantkit.gguf.writing import MARKER_KEY, export_gguf, not_written_by_quantkit  # noqa: E402

from fixtures.robustness_cases_gguf_write import TOKENIZER_FILES, foreign_gguf, stale_temporary  # noqa: E402
from .test_disk_full import small_tmpfs  # noqa: E402, F401  (a fixture: a 256 KiB tmpfs)

_Usage = namedtuple("_Usage", "total used free")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """ref:tiny quantized with w4a16-rtn-g32 (Q4_0 blocks), saved."""
    folder = tmp_path_factory.mktemp("ck") / "tiny-g32"
    quantkit.save(quantkit.quantize(quantkit.load("ref:tiny"), "w4a16-rtn-g32", progress=False), folder)
    return folder


def _export(ckpt, out, *extra) -> int:
    return main(["export", str(ckpt), "--format", "gguf", "--out", str(out), *extra])


def _hidden(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# -- replace only what quantkit wrote ------------------------------------------------------------------------

def test_force_keeps_a_users_file_and_replaces_quantkits_own(ckpt, tmp_path, capsys):
    notes = tmp_path / "notes.gguf"
    notes.write_text("my notes\n")
    assert _export(ckpt, notes, "--force") == 2
    assert notes.read_text() == "my notes\n"
    assert "it is not a GGUF file" in capsys.readouterr().err
    theirs = foreign_gguf(tmp_path / "theirs.gguf")
    before = theirs.read_bytes()
    assert _export(ckpt, theirs, "--force") == 2
    assert theirs.read_bytes() == before
    assert f"its metadata has no {MARKER_KEY}" in capsys.readouterr().err
    ours = tmp_path / "ours.gguf"
    assert _export(ckpt, ours) == 0
    assert not_written_by_quantkit(ours) is None
    assert _export(ckpt, ours) == 2 and "pass --force" in capsys.readouterr().err  # only where --force works
    assert _export(ckpt, ours, "--force", "--name", "again") == 0
    assert gguf.GGUFReader(ours).fields["general.name"].contents() == "again"
    assert _hidden(tmp_path) == []


def test_the_marker_follows_the_architecture(ckpt, tmp_path):
    assert _export(ckpt, tmp_path / "a.gguf") == 0
    keys = list(gguf.GGUFReader(tmp_path / "a.gguf").fields)
    assert keys[keys.index("general.architecture") + 1] == MARKER_KEY


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=96))
def test_no_bytes_make_the_marker_check_fail(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("any") / "x.gguf"
    path.write_bytes(b"GGUF" + data)
    assert isinstance(not_written_by_quantkit(path), str)


def test_the_marker_check_reads_only_a_marker_at_the_start(tmp_path):
    def entry(key: str, value: str) -> bytes:
        k, v = key.encode(), value.encode()
        return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, len(v)) + v

    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
    path = tmp_path / "x.gguf"
    path.write_bytes(head + entry("general.architecture", "llama") + entry(MARKER_KEY, "quantkit 0"))
    assert not_written_by_quantkit(path) is None
    path.write_bytes(head + entry("general.architecture", "llama") + entry(MARKER_KEY, "quantkit 0")[:-3])
    assert not_written_by_quantkit(path) is None  # the key is whole: a truncated value does not hide it
    path.write_bytes(head + entry("general.architecture", "llama")[:-2])
    assert "quantkit did not write" in not_written_by_quantkit(path)


# -- killed, full disk -----------------------------------------------------------------------------------------

_KILLED_WRITE = """
import os, signal, sys
import gguf
from quantkit.commands.cli import main

def write_then_die(self, *args, **kwargs):
    for fout in self.fout:
        fout.write(b"\\0" * 65536)
        fout.flush()
    os.kill(os.getpid(), signal.SIGKILL)

gguf.GGUFWriter.write_tensors_to_file = write_then_die
main(sys.argv[1:])
"""


def test_a_write_killed_by_sigkill_is_cleaned_by_the_next_run(ckpt, tmp_path):
    out = tmp_path / "m.gguf"
    done = subprocess.run([sys.executable, "-c", _KILLED_WRITE, "export", str(ckpt), "--format", "gguf", "--out",
                           str(out)], capture_output=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    [left] = _hidden(tmp_path)
    assert left.startswith(".m.gguf.tmp-")
    assert _export(ckpt, out) == 0
    assert _hidden(tmp_path) == [] and out.is_file()


def test_quantize_removes_a_killed_runs_temporary_before_measuring_the_space(tmp_path, monkeypatch):
    from quantkit.core.errors import NoSpaceError

    stale = stale_temporary(tmp_path / "m.gguf")
    seen = []

    def measure(out, needed):
        seen.append(stale.exists())
        raise NoSpaceError("no room")

    monkeypatch.setattr(outputs, "check_free_space", measure)
    assert main(["quantize", "ref:tiny", "--recipe", "w4a16-rtn-q40", "--out", str(tmp_path / "m.gguf")]) == 1
    assert seen == [False]


def test_too_little_space_is_found_before_writing(ckpt, tmp_path, monkeypatch, capsys):
    import shutil

    def no_write(*args, **kwargs):
        raise AssertionError("the file was written although the disk was known to be too full")

    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(10**9, 10**9 - 4096, 4096))
    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", no_write)
    assert _export(ckpt, tmp_path / "m.gguf") == 1
    [line] = capsys.readouterr().err.splitlines()
    assert f"cannot write {tmp_path}/m.gguf: not enough free space in {tmp_path}" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("free", [0, 10**9], ids=["disk-full", "room-left"])
def test_a_short_write_is_one_line(ckpt, tmp_path, monkeypatch, capsys, free):
    import shutil

    def short_write(self, *args, **kwargs):
        for fout in self.fout:
            fout.write(b"\0" * 1000)
        raise OSError("1048576 requested and 469504 written")  # numpy's tofile: no errno

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", short_write)
    monkeypatch.setattr(outputs, "check_free_space", lambda *args: None)  # the disk fills while writing
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(10**10, 10**10 - free, free))
    assert _export(ckpt, tmp_path / "m.gguf") == 1
    err = capsys.readouterr().err
    [line] = err.splitlines()
    assert "Traceback" not in err and line.startswith("quantkit export: error: ")
    if free == 0:
        assert f"cannot write {tmp_path}/m.gguf: No space left on device" in line, line
    else:
        assert "Input/output error (a short write: 1048576 requested and 469504 written)" in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_real_full_disk(ckpt, small_tmpfs, monkeypatch, capsys):
    assert _export(ckpt, small_tmpfs / "m.gguf") == 1
    assert "not enough free space" in capsys.readouterr().err
    monkeypatch.setattr(outputs, "check_free_space", lambda *args: None)  # let the disk fill up
    assert _export(ckpt, small_tmpfs / "m.gguf") == 1
    [line] = capsys.readouterr().err.splitlines()
    assert f"cannot write {small_tmpfs}/m.gguf: No space left on device" in line, line
    assert os.listdir(small_tmpfs) == [], "nothing half-written is left"


# -- what llama.cpp would run otherwise -----------------------------------------------------------------------

def _model_folder(tmp_path, config):
    import shutil

    import transformers

    from quantkit.formats.loading import resolve_model_source

    folder = tmp_path / config.model_type
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(resolve_model_source("ref:tiny"), name), folder / name)
    return folder


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=4352, max_position_embeddings=256)  # room for added tokens


@pytest.mark.parametrize("family, extra, refused", [
    ("mistral", dict(sliding_window=64), True),
    ("mistral", dict(sliding_window=None), False),
    ("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1), True),
    ("qwen2", dict(use_sliding_window=False, sliding_window=64), False),
])
def test_a_sliding_window_is_refused_in_python_too(tmp_path, family, extra, refused):
    import transformers

    config = transformers.AutoConfig.for_model(family, **SMALL, **extra)
    folder = _model_folder(tmp_path, config)
    model = quantkit.load(folder)
    out = tmp_path / "m.gguf"
    if refused:
        with pytest.raises(UsageError, match="has no sliding window"):
            export_gguf(model, folder, out)
        with pytest.raises(UsageError, match="has no sliding window"):
            gguf_format.check_exportable(folder)
        assert not out.exists()
    else:
        gguf_format.check_exportable(folder)
        assert export_gguf(model, folder, out).bytes > 0


# -- what a write says ------------------------------------------------------------------------------------------

def test_no_stray_lines_from_the_libraries(ckpt, tmp_path):
    """As a user sees it: a process of its own, whose library warnings reach stderr (pytest's log capture
    and transformers' handlers would hide them in process)."""
    cli = "import sys; from quantkit.commands.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", cli, "export", str(ckpt), "--format", "gguf", "--out",
                           str(tmp_path / "m.gguf")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.replace("\r", "\n").splitlines() if line and "it/s]" not in line]
    assert lines == [], lines


def test_the_fallback_line_names_every_tensor_that_took_it(ckpt, tmp_path, capsys):
    assert _export(ckpt, tmp_path / "m.gguf", "--float-type", "q6_k") == 0
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if "asked" in line]
    assert line.strip().startswith("token_embd.weight: q6_k asked, written as Q8_0 (128 inputs"), line
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["token_embd.weight"] == "Q8_0"


def _llama3_rope(tmp_path):
    import json
    import shutil

    from quantkit.formats.loading import resolve_model_source

    folder = tmp_path / "llama3-rope"
    shutil.copytree(resolve_model_source("ref:tiny"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(config))
    return ["quantize", str(folder), "--recipe", "w4a16-rtn-q40"]


def _unknown_pre_tokenizer(tmp_path):
    import json
    import shutil

    from quantkit.formats.loading import resolve_model_source

    folder = tmp_path / "whitespace-split"
    shutil.copytree(resolve_model_source("ref:tiny"), folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "WhitespaceSplit"}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return ["quantize", str(folder), "--recipe", "w4a16-rtn-q40"]


def _int8_asymmetric(tmp_path):
    recipe = tmp_path / "a8.yaml"
    recipe.write_text("weights: {num_bits: 8, type: int, symmetric: false, strategy: group, group_size: 32}\n")
    return ["quantize", "ref:tiny", "--recipe", str(recipe)]


@pytest.mark.parametrize("make, expect", [(_llama3_rope, "rope type 'llama3' is not written to GGUF"),
                                          (_int8_asymmetric, "int8 g32 asym has no GGUF block type"),
                                          (_unknown_pre_tokenizer, "pre-tokenizer is not one llama.cpp knows")],
                         ids=["llama3-rope", "int8-asymmetric", "unknown-pre-tokenizer"])
def test_what_a_gguf_file_cannot_hold_is_refused_before_quantizing(tmp_path, monkeypatch, capsys, make, expect):
    def no_work(*args, **kwargs):
        raise AssertionError("quantized although the GGUF file could not hold the result")

    monkeypatch.setattr(quantkit, "quantize", no_work)
    assert main([*make(tmp_path), "--out", str(tmp_path / "m.gguf")]) == 2
    assert expect in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()
