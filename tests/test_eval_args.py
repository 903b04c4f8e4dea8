"""Evaluation arguments out of range are errors naming the flag and the allowed range (exit 2)."""

import json

import pytest
import torch

from quantkit.commands.cli import main
from quantkit.core.errors import EvaluationError
from quantkit.harness.quality import token_windows


@pytest.mark.parametrize("args, message", [
    (["--window", "0"], "argument --window: must be an integer >= 2"),
    (["--window", "1"], "argument --window: must be an integer >= 2"),
    (["--window", "-5"], "argument --window: must be an integer >= 2"),
    (["--max-tokens", "-3"], "argument --max-tokens: must be an integer >= 2"),
    (["--max-tokens", "0"], "argument --max-tokens: must be an integer >= 2"),
    (["--batch-size", "0"], "argument --batch-size: must be an integer >= 1"),
    (["--window", "many"], "argument --window: expected an integer >= 2, got 'many'"),
])
def test_out_of_range_values_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "ref:tiny", "--baseline", "ref:tiny", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("window", ["257", "100000"])
def test_window_longer_than_the_context_is_refused(window, capsys):
    """ref:tiny has a context of 256 tokens; a longer window used to run (or hang) and print a wrong perplexity."""
    assert main(["eval", "ref:tiny", "--baseline", "ref:tiny", "--window", window, "--max-tokens", "2048"]) == 2
    err = capsys.readouterr().err
    assert f"--window {window} is longer than the model's context of 256 tokens" in err
    assert "use --window 256 or less" in err and "Traceback" not in err


def test_window_equal_to_the_context_runs(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["eval", "ref:tiny", "--baseline", "ref:tiny", "--window", "256", "--max-tokens", "512",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["window"], result["windows"], result["kl_divergence"]) == (256, 2, 0.0)


def test_too_little_text_for_one_window_exits_2(capsys):
    assert main(["eval", "ref:tiny", "--baseline", "ref:tiny", "--window", "128", "--max-tokens", "100"]) == 2
    assert "--max-tokens 100 is less than one window of 128 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("window, max_tokens", [(0, None), (1, None), (-4, None), (4, 0), (4, -3)])
def test_token_windows_rejects_bad_values(window, max_tokens):
    ids = torch.arange(100)
    with pytest.raises(EvaluationError):
        token_windows(ids, window, max_tokens)


def test_evaluate_quality_refuses_windows_longer_than_the_context():
    from quantkit.harness.quality import evaluate_quality

    from .conftest import make_random_model

    model = make_random_model("llama")  # max_position_embeddings 256
    windows = torch.randint(0, 512, (1, 257), generator=torch.Generator().manual_seed(0))
    with pytest.raises(EvaluationError, match="windows of 257 tokens are longer than the model's context of 256"):
        evaluate_quality(model, model, windows, progress=False)
