"""A full disk or quota while writing an output is a clear error naming the folder and the space needed,
found before writing where the size is known, and nothing half-written is left."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections import namedtuple

import pytest

import quantkit
import quantkit.formats.safetensors_io as safetensors_io
from quantkit.commands.cli import main
from quantkit.core.errors import NoSpaceError
from quantkit.files import outputs
from quantkit.files.outputs import atomic_write_text
from quantkit.quantization.summaries import human_bytes

_Usage = namedtuple("_Usage", "total used free")


@pytest.fixture(scope="module")
def w4_model():
    from tests.conftest import make_random_model

    return quantkit.quantize(make_random_model("llama"), "w4a16-rtn", progress=False)


def _state_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_too_little_free_space_is_found_before_anything_is_written(tmp_path, monkeypatch, w4_model):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(10**9, 10**9 - 1000, 1000))

    def no_write(*args, **kwargs):
        raise AssertionError("weights were written although the disk was known to be too full")

    monkeypatch.setattr(safetensors_io, "save_safetensors_file", no_write)
    with pytest.raises(NoSpaceError) as e:
        quantkit.save(w4_model, tmp_path / "ck")
    message = str(e.value)
    assert f"in {tmp_path} (about " in message and "1000 B free there" in message, message
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_a_disk_that_fills_while_writing_leaves_nothing(tmp_path, monkeypatch, w4_model):
    def fill_the_disk(tensors, path):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)  # what fitted before the disk filled
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(safetensors_io, "save_safetensors_file", fill_the_disk)
    (tmp_path / "ck").mkdir()  # an earlier, empty output: kept as it was
    with pytest.raises(NoSpaceError, match=rf"cannot write {tmp_path}/ck: No space left on device in {tmp_path} "
                                           rf"\(about .* needed"):
        quantkit.save(w4_model, tmp_path / "ck", force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"] and list((tmp_path / "ck").iterdir()) == []


def test_the_command_line_says_it_in_one_line_before_quantizing(tmp_path, monkeypatch, capsys):
    def no_work(*args, **kwargs):
        raise AssertionError("quantized although the checkpoint could not fit")

    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(10**9, 10**9 - 4096, 4096))
    monkeypatch.setattr(quantkit, "quantize", no_work)
    status = main(["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", str(tmp_path / "ck")])
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err, err
    [line] = [line for line in err.splitlines() if "error" in line]
    assert line.startswith(f"quantkit quantize: error: cannot write {tmp_path}/ck: not enough free space in {tmp_path}")
    assert "4.0 KiB free there" in line
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs (root only: skipped where mounting is refused)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    except OSError:
        pytest.skip("no mount command")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_real_full_disk(small_tmpfs, monkeypatch, w4_model):
    assert _state_bytes(w4_model) > 256 * 1024
    with pytest.raises(NoSpaceError, match="not enough free space"):
        quantkit.save(w4_model, small_tmpfs / "ck")
    with pytest.raises(NoSpaceError, match="not enough free space"):
        atomic_write_text(small_tmpfs / "eval.json", "x" * 300_000)
    monkeypatch.setattr(outputs, "check_free_space", lambda *args: None)  # let the disk fill up
    with pytest.raises(NoSpaceError, match="No space left on device"):
        quantkit.save(w4_model, small_tmpfs / "ck")
    with pytest.raises(NoSpaceError, match=f"cannot write {small_tmpfs}/eval.json: No space left on device"):
        atomic_write_text(small_tmpfs / "eval.json", "x" * 300_000)
    assert os.listdir(small_tmpfs) == [], "nothing half-written is left"
    assert shutil.disk_usage(small_tmpfs).used < 16 * 1024, human_bytes(shutil.disk_usage(small_tmpfs).used)
