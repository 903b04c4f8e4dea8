"""Outputs appear whole, never replace what another process finished, honour the umask, and killed runs'
leftovers are cleaned on the next run."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

import quantkit
from quantkit.core.errors import OutputExistsError, OutputRefusedError, UsageError
from quantkit.files.outputs import MARKER, atomic_output_dir, atomic_write_text, check_writable, clean_stale, publish_files


def _dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_final_rename_does_not_replace_an_output_finished_meanwhile(tmp_path):
    out = tmp_path / "ckpt"
    with pytest.raises(OutputExistsError, match="another process"):
        with atomic_output_dir(out) as tmp:
            (tmp / "mine.txt").write_text("mine")
            out.mkdir()  # another process finished first
            (out / "theirs.txt").write_text("theirs")
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "the temporary folder is removed"


def test_an_empty_folder_created_meanwhile_is_not_replaced_either(tmp_path):
    out = tmp_path / "ckpt"
    with pytest.raises(OutputExistsError):
        with atomic_output_dir(out) as tmp:
            (tmp / "mine.txt").write_text("mine")
            out.mkdir()
    assert list(out.iterdir()) == []


def test_force_replaces_only_after_the_new_folder_is_complete(tmp_path):
    out = tmp_path / "ckpt"
    with atomic_output_dir(out) as tmp:
        (tmp / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out, force=True) as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("killed halfway")
    assert (out / "old.txt").read_text() == "old" and not (out / "new.txt").exists()
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_leftovers_of_killed_runs_are_cleaned(tmp_path):
    out = tmp_path / "ckpt"
    dead, alive = _dead_pid(), os.getpid()
    stale_tmp = tmp_path / f".ckpt.tmp-{dead}-abcd1234"
    live_tmp = tmp_path / f".ckpt.tmp-{alive}-abcd1234"
    other = tmp_path / f".other.tmp-{dead}-abcd1234"
    for d in (stale_tmp, live_tmp, other):
        d.mkdir()
    with atomic_output_dir(out) as tmp:
        (tmp / "a.txt").write_text("a")
    assert not stale_tmp.exists(), "a killed run's temporary folder is removed"
    assert live_tmp.exists(), "a running process's temporary folder is left alone"
    assert other.exists(), "another output's temporary folder is left alone"


def test_a_checkpoint_moved_aside_by_a_killed_forced_run_is_put_back(tmp_path):
    out = tmp_path / "ckpt"
    old = tmp_path / f".ckpt.old-{_dead_pid()}"
    old.mkdir()
    (old / "weights").write_text("the only copy")
    assert clean_stale(out) == [old]
    assert (out / "weights").read_text() == "the only copy"
    old.mkdir()  # and when the new checkpoint did land, the old copy is removed
    assert clean_stale(out) == [old] and not old.exists() and (out / "weights").is_file()


@pytest.mark.parametrize("umask, dir_mode, file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_checkpoints_follow_the_umask(tmp_path, umask, dir_mode, file_mode):
    from tests.conftest import make_random_model

    model = quantkit.quantize(make_random_model("llama"), "w8a16-rtn", progress=False)
    previous = os.umask(umask)
    try:
        out = quantkit.save(model, tmp_path / "ckpt")
        report = atomic_write_text(tmp_path / "eval.json", "{}\n")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == dir_mode
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == file_mode, f.name
    assert stat.S_IMODE(report.stat().st_mode) == file_mode


def test_api_error_names_the_api_argument_not_cli_flags(tmp_path):
    from tests.conftest import make_random_model

    model = quantkit.quantize(make_random_model("llama"), "w8a16-rtn", progress=False)
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FileExistsError) as e:
        quantkit.save(model, tmp_path / "ckpt")
    assert "force=True" in str(e.value) and "--" not in str(e.value)


def test_publish_files_keeps_other_files_and_refuses_to_overwrite(tmp_path):
    (tmp_path / "bench.json").write_text("input")
    with publish_files(tmp_path, ["report.md"]) as tmp:
        (tmp / "report.md").write_text("first")
    with pytest.raises(OutputExistsError):
        with publish_files(tmp_path, ["report.md"]) as tmp:
            (tmp / "report.md").write_text("second")
    with publish_files(tmp_path, ["report.md"], force=True) as tmp:
        (tmp / "report.md").write_text("third")
    assert (tmp_path / "report.md").read_text() == "third" and (tmp_path / "bench.json").read_text() == "input"
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "bench.json", "report.md"]


def test_publish_files_never_overwrites_a_file_it_did_not_write(tmp_path):
    (tmp_path / "report.md").write_text("the user's own report")
    (tmp_path / "plot.png").write_text("the user's own plot")
    with pytest.raises(OutputRefusedError, match="report.md: quantkit did not write it"):
        with publish_files(tmp_path, ["report.md"], force=True) as tmp:
            (tmp / "report.md").write_text("new")
    (tmp_path / "report.md").unlink()
    with pytest.raises(OutputRefusedError, match="plot.png: quantkit did not write it"):
        with publish_files(tmp_path, ["report.md"], force=True) as tmp:
            (tmp / "report.md").write_text("new")
            (tmp / "plot.png").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
    assert (tmp_path / "plot.png").read_text() == "the user's own plot"


def test_a_missing_local_path_never_asks_the_hub(tmp_path, monkeypatch):
    import transformers

    from quantkit.core.errors import CheckpointError
    from quantkit.formats.loading import resolve_model_source

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for path in ("./missing", str(tmp_path / "missing"), "~/quantkit-missing-model", "models/missing",
                 "a/b/c", "name with spaces", "llama-config.json"):
        with pytest.raises(CheckpointError, match="does not exist"):
            quantkit.load(path)
    assert resolve_model_source("org/model-name") == "org/model-name", "a hub id stays a hub id"
    assert resolve_model_source("gpt2") == "gpt2"


def test_an_unwritable_output_is_found_before_any_work(tmp_path, monkeypatch, capsys):
    """As root a read-only folder is writable, so the refusal is simulated where the probe folder is made."""
    import quantkit.formats.loading
    from quantkit.commands.cli import main

    real_mkdir = os.mkdir

    def read_only_mkdir(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "locked")):
            raise PermissionError(13, "Permission denied", str(path))
        return real_mkdir(path, *args, **kwargs)

    def no_work(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    (tmp_path / "locked").mkdir()
    monkeypatch.setattr(os, "mkdir", read_only_mkdir)
    monkeypatch.setattr(quantkit.formats.loading, "load_float_model", no_work)
    assert main(["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", str(tmp_path / "locked" / "out")]) == 2
    assert "is not writable (Permission denied)" in capsys.readouterr().err


def test_names_too_long_for_the_filesystem_are_named_before_any_work(tmp_path):
    """The longest output name accepted is written (with the temporary names beside it); one byte more, or a
    folder name over NAME_MAX on the way, is refused with the limit (not as an unwritable folder)."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    longest = next(n for n in range(limit, 0, -1) if _accepted(tmp_path / ("a" * n)))
    assert limit - 30 < longest < limit
    with atomic_output_dir(tmp_path / ("a" * longest)) as tmp:
        (tmp / "x.txt").write_text("x")
    atomic_write_text(tmp_path / ("b" * longest), "x")
    assert {p.name for p in tmp_path.iterdir()} == {"a" * longest, "b" * longest}
    with pytest.raises(UsageError, match=f"{limit} bytes per name this filesystem allows; choose a name of at most "
                                         f"{longest} bytes"):
        atomic_output_dir(tmp_path / ("c" * (longest + 1))).__enter__()
    with pytest.raises(UsageError, match=f"the folder name 'dd*' is {limit + 1} bytes, more than the {limit}"):
        check_writable(tmp_path / ("d" * (limit + 1)) / "out.json", file=True)


def _accepted(path) -> bool:
    try:
        check_writable(path)
        return True
    except UsageError:
        return False


def test_file_outputs_write_through_streams_devices_and_links_and_replace_only_regular_files(tmp_path, capsys):
    from quantkit.files.outputs import check_output_file, write_output_file

    (tmp_path / "real.json").write_text("old\n")
    (tmp_path / "link.json").symlink_to("real.json")
    for name in ("-", "/dev/stdout", os.devnull, tmp_path / "link.json"):
        check_output_file(name)
        write_output_file(name, "{}\n")
    assert capsys.readouterr().out == "{}\n{}\n"
    assert stat.S_ISCHR(os.lstat(os.devnull).st_mode)
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "real.json").read_text() == "{}\n"
    (tmp_path / "to-folder").symlink_to(tmp_path)
    with pytest.raises(UsageError, match="it is a folder"):
        check_output_file(tmp_path / "to-folder")
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(OutputRefusedError, match="a named pipe"):
        atomic_write_text(tmp_path / "pipe", "{}\n")  # the low-level writer never renames over it
    assert stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode)


def test_recipe_yaml_comments_escape_control_characters():
    import yaml

    from quantkit.quantization.provenance import Provenance, recipe_file_text

    text = recipe_file_text(Provenance(quantkit.load_recipe("w4a16-rtn")), "models/a\nb\x1b", "out/ck")
    comments = [line for line in text.splitlines() if line.startswith("#")]
    assert any("models/a\\nb\\x1b" in line for line in comments), comments
    assert yaml.safe_load(text)["weights"]["num_bits"] == 4  # no stray line became YAML
