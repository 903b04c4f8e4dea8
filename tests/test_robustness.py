"""Every bad input of fixtures/robustness_cases*.py: exit status 2, the message on stderr, no traceback,
nothing written."""

from __future__ import annotations

import os

import pytest

from quantkit.commands.cli import main

from fixtures.robustness_cases import all_cases

CASES = all_cases()
PYTHON_CASES = all_cases("PYTHON_CASES")


@pytest.fixture(scope="module")
def cases_root(tmp_path_factory):
    return tmp_path_factory.mktemp("robustness")


@pytest.fixture(autouse=True)
def quiet_transformers():
    """transformers' logger keeps the stderr of the test that first used it; once that capture is closed,
    a warning prints a logging traceback that is not quantkit's. Its warnings are not what is tested here."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_a_clear_error(case, cases_root, monkeypatch, capsys):
    if case.needs_non_root and os.geteuid() == 0:
        pytest.skip("permissions do not stop root")
    if case.skip and case.skip():
        pytest.skip(case.skip())
    work = cases_root / case.name
    work.mkdir()
    monkeypatch.chdir(work)
    argv = case.setup(work)
    try:
        status = main(argv)
    except SystemExit as e:  # argparse rejects a bad option value itself
        status = e.code
    captured = capsys.readouterr()
    err = captured.err
    assert status == case.status, err
    assert "Traceback" not in err, err
    if case.status == 0:
        assert case.expect in case.check(work, captured.out)
        return
    assert case.expect in err, err
    assert f"quantkit {argv[0]}: error:" in err
    assert len([line for line in err.splitlines() if ": error: " in line]) == 1 and "usage:" not in err, err
    if case.absent:
        assert case.absent not in err, err
    if case.creates:
        assert not os.path.lexists(work / case.creates), f"{case.creates} was written despite the error"


@pytest.mark.parametrize("case", PYTHON_CASES, ids=[c.name for c in PYTHON_CASES])
def test_python_api_bad_input_gets_a_clear_error(case, cases_root, monkeypatch):
    work = cases_root / case.name
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(case.error) as caught:
        case.call(work)
    message = str(caught.value)
    assert case.expect in message and "\n" not in message, message
    if case.absent:
        assert case.absent not in message, message
    if case.creates:
        assert not os.path.lexists(work / case.creates), f"{case.creates} was written despite the error"


def test_the_python_api_names_the_same_mistakes():
    import quantkit
    from quantkit.core.device import resolve_device
    from quantkit.core.errors import ConfigError, QuantizationError, UsageError

    from .conftest import make_random_model

    model = quantkit.quantize(make_random_model("llama"), "w8a16-rtn", progress=False)
    with pytest.raises(QuantizationError, match="already quantized"):
        quantkit.quantize(model, "w4a16-rtn", progress=False)
    with pytest.raises(ValueError, match="num_bits must be an integer"):
        quantkit.QuantScheme(num_bits=4.0, strategy="channel")
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
    for bad, message in [({"num_bits": True}, "num_bits must be an integer"), ({"group_size": "128"}, "group_size"),
                         ({"symmetric": 1}, "symmetric must be true or false")]:
        with pytest.raises(ConfigError, match=message):
            quantkit.load_recipe({"weights": weights | bad})
    with pytest.raises(ConfigError, match="gptq"):
        quantkit.load_recipe({"weights": weights, "algorithm": {"name": "gptq", "block_size": 128.5}})
    with pytest.raises(UsageError, match="cuda:99"):
        resolve_device("cuda:99")
