"""No command deletes or overwrites what the user did not name as an output: --force replaces only an output
quantkit wrote, never an input, the working folder or other files; a forced replace that another writer or a
SIGKILL interrupts never loses the output, and never leaves a process reporting a checkpoint that is gone."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import quantkit
from quantkit.commands.cli import main
from quantkit.core.errors import OutputRefusedError
from quantkit.files.outputs import MARKER, atomic_output_dir, clean_stale, read_marker

from fixtures.robustness_cases_safety import CASES


def _snapshot(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file below `folder` (folders as "dir")."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        out[rel] = "dir" if path.is_dir() and not path.is_symlink() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def cases_root(tmp_path_factory):
    return tmp_path_factory.mktemp("safety")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_nothing_the_user_had_is_lost(case, cases_root, monkeypatch, capsys):
    """Each command of fixtures/robustness_cases_safety.py is refused and leaves every file as it was."""
    work = cases_root / case.name
    work.mkdir()
    monkeypatch.chdir(work)
    argv = case.setup(work)
    before = _snapshot(work)
    assert main(argv) == 2
    assert case.expect in capsys.readouterr().err
    assert _snapshot(work) == before


@pytest.fixture(scope="module")
def w4_model():
    return quantkit.quantize(quantkit.load("ref:tiny"), "w4a16-rtn", progress=False)


def test_save_never_replaces_the_folder_the_model_came_from(tmp_path, monkeypatch):
    import shutil

    from quantkit.formats.loading import resolve_model_source

    source = tmp_path / "wrap" / "m"
    shutil.copytree(resolve_model_source("ref:tiny"), source)
    model = quantkit.quantize(quantkit.load(source), "w4a16-rtn", progress=False)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("the user's notes")
    before = _snapshot(tmp_path)
    for out in (source, source.parent):
        with pytest.raises(OutputRefusedError, match="an input of this command"):
            quantkit.save(model, out, force=True)
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(OutputRefusedError, match="working folder"):
        quantkit.save(model, ".", force=True)
    assert _snapshot(tmp_path) == before


def test_force_replaces_an_output_quantkit_wrote_and_nothing_else(tmp_path, w4_model):
    out = quantkit.save(w4_model, tmp_path / "ck")
    marker = read_marker(out)
    assert sorted(marker["files"]) == sorted(p.name for p in out.iterdir() if p.name != MARKER)
    quantkit.save(w4_model, out, force=True)  # an earlier checkpoint: replaced
    assert read_marker(out)["id"] != marker["id"]
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(OutputRefusedError, match=r"files quantkit did not write \(notes.txt\)"):
        quantkit.save(w4_model, out, force=True)
    (out / "notes.txt").unlink()
    (out / "sub").mkdir()
    with pytest.raises(OutputRefusedError, match=r"files quantkit did not write \(sub\)"):
        quantkit.save(w4_model, out, force=True)
    (out / "sub").rmdir()
    os.symlink(out, tmp_path / "link")
    with pytest.raises(OutputRefusedError, match="symbolic link"):
        quantkit.save(w4_model, tmp_path / "link", force=True)
    assert (out / "model.safetensors").is_file() and (tmp_path / "link").is_symlink()


def test_a_forced_run_never_replaces_what_another_process_finished_meanwhile(tmp_path, monkeypatch, capsys):
    """`quantize --force` over an earlier output: another writer finishes OUT while this run quantizes. This
    run must not exit 0 with OUT holding someone else's checkpoint, nor replace the other's result silently:
    it fails and says so, and OUT keeps the other writer's checkpoint."""
    out = tmp_path / "out"
    assert main(["quantize", "ref:tiny", "--recipe", "w8a16-rtn", "--out", str(out)]) == 0
    real_quantize = quantkit.quantize

    def quantize_while_another_writes(model, recipe, *args, **kwargs):
        other = real_quantize(quantkit.load("ref:tiny"), "w8a16-rtn", progress=False)
        quantkit.save(other, out, force=True)  # the other process finishes first
        return real_quantize(model, recipe, *args, **kwargs)

    monkeypatch.setattr(quantkit, "quantize", quantize_while_another_writes)
    capsys.readouterr()
    status = main(["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", str(out), "--force"])
    err = capsys.readouterr().err
    assert status == 2 and "was written by another process while this one worked: that output is kept" in err, err
    assert "w8a16-rtn" in (out / "recipe.yaml").read_text(), "the other writer's checkpoint is kept"
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "nothing left beside it"


def test_the_last_of_two_writers_is_told_when_the_first_finished_while_it_worked(tmp_path):
    from quantkit.files.outputs import output_state

    out = tmp_path / "out"
    with atomic_output_dir(out) as tmp:
        (tmp / "first.txt").write_text("first")
    seen = output_state(out)  # what a second forced writer saw when it started
    with atomic_output_dir(out, force=True) as tmp:  # a third writer replaces it meanwhile
        (tmp / "third.txt").write_text("third")
    with pytest.raises(OutputRefusedError, match="written by another process while this one worked"):
        with atomic_output_dir(out, force=True, expect=seen) as tmp:
            (tmp / "second.txt").write_text("second")
    assert (out / "third.txt").read_text() == "third"


_KILLED_REPLACE = """
import os, signal, sys
from pathlib import Path
from quantkit.files import outputs

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

outputs.rename_noreplace = die  # a rename that would follow moving the old output aside
outputs._remove = die  # removing what was replaced
with outputs.atomic_output_dir(sys.argv[1], force=True) as tmp:
    (Path(tmp) / "new.txt").write_text("new")
"""


def test_a_forced_replace_killed_at_any_step_leaves_the_old_or_the_new_output(tmp_path):
    out = tmp_path / "out"
    with atomic_output_dir(out) as tmp:
        (tmp / "old.txt").write_text("old")
    proc = subprocess.run([sys.executable, "-c", _KILLED_REPLACE, str(out)], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert (out / "new.txt").is_file() or (out / "old.txt").is_file(), \
        f"no output after the kill: {sorted(p.name for p in tmp_path.iterdir())}"
    clean_stale(out)  # what the next run into the same place does first
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
