"""Every bad input of tests/robustness_cases.py: exit status 2, the message on stderr, no traceback,
nothing written."""

from __future__ import annotations

import os

import pytest

from quantkit.cli import main

from .robustness_cases import CASES


@pytest.fixture(scope="module")
def cases_root(tmp_path_factory):
    return tmp_path_factory.mktemp("robustness")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_a_clear_error(case, cases_root, monkeypatch, capsys):
    if case.needs_non_root and os.geteuid() == 0:
        pytest.skip("permissions do not stop root")
    work = cases_root / case.name
    work.mkdir()
    monkeypatch.chdir(work)
    argv = case.setup(work)
    try:
        status = main(argv)
    except SystemExit as e:  # argparse rejects a bad option value itself
        status = e.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert case.expect in err, err
    assert f"quantkit {argv[0]}: error:" in err and "Traceback" not in err
    if case.creates:
        assert not (work / case.creates).exists(), f"{case.creates} was written despite the error"
