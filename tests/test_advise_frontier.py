"""`quantkit advise --max-size / --max-bits-per-weight --frontier`: sizes as people write them, the frontier file
checked at the edge, the type of lowest measured KL that fits, and the command line around them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit.core.errors import UsageError
from quantkit.core.units import UNITS, format_bytes, parse_byte_size
from quantkit.harness.frontier import (Frontier, FrontierRecord, SizeBudget, choose_by_size, format_size_choice,
                                       load_frontier, parse_frontier)

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "evals" / "quality" / "frontier" / "ref-small" / "frontier.json"


def record(type_: str, method: str, file_bytes: int, kl: float, bits: float | None = None) -> dict:
    return {"type": type_, "method": method, "recipe": f"{type_.lower()}-{method.lower()}", "file_bytes": file_bytes,
            "bits_per_weight": bits if bits is not None else file_bytes / 1e6, "kl_divergence": kl,
            "perplexity": 90.0, "top1_agreement": 0.9, "quantize_seconds": 1.0}


RECORDS = [record("Q2_K", "RTN", 3_000_000, 0.007), record("Q2_K", "GPTQ", 3_000_000, 0.003),
           record("Q3_K_M", "GPTQ", 3_400_000, 0.0005), record("Q4_K_M", "GPTQ", 3_700_000, 0.0002),
           record("Q8_0", "RTN", 5_100_000, 0.00001)]


def frontier_data(records=RECORDS, model="ref:small") -> dict:
    return {"format": "quantkit-frontier", "version": 1, "model": model, "records": records}


def frontier(records=RECORDS) -> Frontier:
    return parse_frontier(frontier_data(records), "frontier.json")


# -- sizes -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [("60MB", 60_000_000), ("1.5GB", 1_500_000_000), ("500MiB", 500 << 20),
                                            ("60 mb", 60_000_000), ("2KiB", 2048), ("1e3kB", 10**6), ("7B", 7),
                                            (".5MiB", 1 << 19), ("1.5 TiB", 3 << 39)])
def test_sizes_as_people_write_them(text, expected):
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize("text, says", [("60", "no unit"), ("1.5", "no unit"), ("60 MQ", "unknown unit"),
                                        ("MB", "not a size"), ("-5MB", "not a size"), ("0MB", "less than one byte"),
                                        ("0.5B", "less than one byte"), ("1e400GB", "too large"), ("", "not a size"),
                                        ("nan MB", "not a size"), ("5 M B", "not a size")])
def test_sizes_refused_name_the_units(text, says):
    with pytest.raises(ValueError) as e:
        parse_byte_size(text)
    message = str(e.value)
    assert says in message and "MB" in message and "MiB" in message and "\n" not in message


@given(n=st.integers(1, 10**6), unit=st.sampled_from(sorted(UNITS)), upper=st.booleans())
def test_a_whole_number_and_any_unit_is_that_many_units(n, unit, upper):
    assert parse_byte_size(f"{n}{unit.upper() if upper else unit}") == n * UNITS[unit]


@given(st.one_of(st.integers(0, 10**15).map(str), st.floats(0, 1e15, allow_nan=False).map(str)))
def test_a_bare_number_is_always_refused_with_the_units(text):
    with pytest.raises(ValueError, match="unit"):
        parse_byte_size(text)


@given(n=st.integers(1, 10**15))
def test_a_printed_size_reads_back_within_its_rounding(n):
    decimal = format_bytes(n).split(" (")[0].replace(" ", "")
    assert abs(parse_byte_size(decimal) - n) <= max(1, n * 0.006)  # three significant digits


# -- the frontier file, checked at the edge ---------------------------------------------------------

def write(tmp_path: Path, data, name="frontier.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def one_line_error(path: Path) -> str:
    with pytest.raises(UsageError) as e:
        load_frontier(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    return message


def test_a_missing_file_names_how_to_make_one(tmp_path):
    assert "no such file" in one_line_error(tmp_path / "nope.json") and "frontier.py" in one_line_error(
        tmp_path / "nope.json")


def test_bad_json_is_named(tmp_path):
    message = one_line_error(write(tmp_path, "{\"records\": [1, 2"))
    assert "not JSON" in message and "frontier.py" in message


@pytest.mark.parametrize("data, says", [
    ([1, 2], "the file is [1, 2]"),
    ({"records": RECORDS}, "format is None"),
    ({"format": "quantkit-frontier", "records": []}, "records is []"),
    ({"format": "quantkit-frontier", "model": 3, "records": RECORDS}, "model is 3"),
    (frontier_data([{k: v for k, v in RECORDS[0].items() if k != "kl_divergence"}]), "has no 'kl_divergence'"),
    (frontier_data([{k: v for k, v in RECORDS[0].items() if k != "recipe"}]), "has no 'recipe'"),
    (frontier_data([{**RECORDS[0], "file_bytes": "3MB"}]), "records[0].file_bytes is '3MB'"),
    (frontier_data([{**RECORDS[0], "file_bytes": 3.5e6}]), "records[0].file_bytes is 3500000.0"),
    (frontier_data([RECORDS[0], {**RECORDS[1], "bits_per_weight": True}]), "records[1].bits_per_weight is True"),
    (frontier_data([{**RECORDS[0], "kl_divergence": -0.5}]), "records[0].kl_divergence is -0.5"),
    (frontier_data([{**RECORDS[0], "kl_divergence": float("nan")}]), "records[0].kl_divergence is nan"),
    (frontier_data([{**RECORDS[0], "top1_agreement": 1.5}]), "records[0].top1_agreement is 1.5"),
    (frontier_data([{**RECORDS[0], "type": ""}]), "records[0].type is ''"),
    (frontier_data([{**RECORDS[0], "float_type": "q8_0; rm -rf"}]), "records[0].float_type is 'q8_0; rm -rf'"),
    (frontier_data(["Q4_K_M"]), "records[0] is 'Q4_K_M'"),
    (frontier_data([RECORDS[0], RECORDS[0]]), "Q2_K RTN is measured twice"),
    (frontier_data([{**RECORDS[0], "quantizer": ""}]), "records[0].quantizer is ''"),
    (frontier_data([{**RECORDS[0], "quantizer": "llama.cpp; rm"}]), "records[0].quantizer is 'llama.cpp; rm'"),
    (frontier_data([{**RECORDS[0], "quantizer": "llama.cpp"}]), "at least one file quantkit writes"),
])
def test_each_wrong_key_or_type_is_named(tmp_path, data, says):
    assert says in one_line_error(write(tmp_path, data))


def test_a_good_file_reads_into_records(tmp_path):
    loaded = load_frontier(write(tmp_path, frontier_data()))
    assert loaded.model == "ref:small" and len(loaded.records) == len(RECORDS)
    assert loaded.records[2] == FrontierRecord("Q3_K_M", "GPTQ", "q3_k_m-gptq", 3_400_000, 3.4, 0.0005, 90.0, 0.9, 1.0)


@pytest.mark.parametrize("path", sorted(COMMITTED.parent.parent.glob("*/frontier.json")),
                         ids=lambda p: p.parent.name)
def test_the_committed_frontiers_are_what_advise_reads(path):
    """The script's own output (evals/quality/frontier/frontier.py) passes the loader, and names built-in recipes."""
    from quantkit.quantization.recipe import builtin_recipes

    loaded = load_frontier(path)
    assert loaded.model and {"RTN", "GPTQ"} <= {r.method for r in loaded.records} <= {"RTN", "GPTQ", "GPTQ refined"}
    assert {r.recipe for r in loaded.records} <= set(builtin_recipes())
    assert {r.quantizer for r in loaded.records} == {"quantkit"}
    assert all((r.quantizer, r.recipe.split()[0]) in {("llama.cpp", "llama-quantize"), ("auto-round", "auto-round")}
               for r in loaded.others)


def test_the_ref_small_frontier_is_committed():
    loaded = load_frontier(COMMITTED)
    assert loaded.model == "ref:small"
    # llama-quantize and auto-round beside quantkit
    assert {r.method for r in loaded.others} == {"llama.cpp", "llama.cpp+imatrix", "auto-round"}
    assert {r.type for r in loaded.others} == {r.type for r in loaded.records}


LLAMA = [{**record("Q3_K_M", "llama.cpp+imatrix", 3_400_000, 0.0001), "recipe": "llama-quantize --imatrix Q3_K_M",
          "quantizer": "llama.cpp"},
         {**record("Q2_K", "llama.cpp", 3_000_000, 0.002), "recipe": "llama-quantize Q2_K", "quantizer": "llama.cpp"}]


def test_other_quantizers_are_read_apart_and_never_recommended(tmp_path):
    """llama-quantize's own files (measured for comparison) are read, but the choice is among quantkit's: a
    llama.cpp file of lower KL within the budget is not recommended."""
    loaded = load_frontier(write(tmp_path, frontier_data(RECORDS + LLAMA)))
    assert [r.label for r in loaded.records] == [r.label for r in frontier().records]
    assert [(r.label, r.quantizer) for r in loaded.others] == [("Q3_K_M llama.cpp+imatrix", "llama.cpp"),
                                                               ("Q2_K llama.cpp", "llama.cpp")]
    choice = choose_by_size(loaded, SizeBudget(max_bytes=3_500_000))
    assert choice.chosen.label == "Q3_K_M GPTQ"  # not the llama.cpp file of KL 0.0001
    assert all(r.quantizer == "quantkit" for r in choice.fitting + choice.too_large)
    assert choose_by_size(loaded, SizeBudget(max_bytes=3_000_000)).chosen.label == "Q2_K GPTQ"
    lines = format_size_choice(choice)
    assert lines[-1].startswith("not candidates: 2 files of llama.cpp")
    assert not any("llama-quantize" in line for line in lines)
    assert choice.to_dict()["not_candidates"] == ["Q3_K_M llama.cpp+imatrix (llama.cpp)", "Q2_K llama.cpp (llama.cpp)"]


# -- the choice ------------------------------------------------------------------------------------

def test_the_lowest_kl_that_fits_is_chosen():
    choice = choose_by_size(frontier(), SizeBudget(max_bytes=3_500_000))
    assert choice.chosen.label == "Q3_K_M GPTQ"
    assert [r.label for r in choice.fitting] == ["Q3_K_M GPTQ", "Q2_K GPTQ", "Q2_K RTN"]
    assert [r.label for r in choice.too_large] == ["Q4_K_M GPTQ", "Q8_0 RTN"]  # the nearest to fitting first


def test_a_limit_is_inclusive_and_both_limits_must_hold():
    assert choose_by_size(frontier(), SizeBudget(max_bytes=3_700_000)).chosen.label == "Q4_K_M GPTQ"
    assert choose_by_size(frontier(), SizeBudget(max_bytes=3_699_999)).chosen.label == "Q3_K_M GPTQ"
    assert choose_by_size(frontier(), SizeBudget(max_bits_per_weight=3.0)).chosen.label == "Q2_K GPTQ"
    both = choose_by_size(frontier(), SizeBudget(max_bytes=10**9, max_bits_per_weight=3.4))
    assert both.chosen.label == "Q3_K_M GPTQ"


def test_equal_kl_goes_to_the_smaller_file_then_by_name():
    tied = [record("Q4_K_S", "GPTQ", 3_600_000, 0.001), record("Q4_0", "GPTQ", 3_500_000, 0.001),
            record("Q4_K_M", "RTN", 3_500_000, 0.001), record("Q4_1", "GPTQ", 3_500_000, 0.001)]
    choice = choose_by_size(frontier(tied), SizeBudget(max_bytes=10**9))
    assert [r.label for r in choice.fitting] == ["Q4_0 GPTQ", "Q4_1 GPTQ", "Q4_K_M RTN", "Q4_K_S GPTQ"]
    reordered = choose_by_size(frontier(tied[::-1]), SizeBudget(max_bytes=10**9))
    assert reordered.chosen == choice.chosen


def test_nothing_fits_names_the_smallest_file():
    choice = choose_by_size(frontier(), SizeBudget(max_bytes=2_000_000))
    assert choice.chosen is None and not choice.fitting
    assert "nothing fits" in choice.reason and "Q2_K" in choice.reason and "3 MB" in choice.reason
    assert choice.smallest.file_bytes == 3_000_000
    assert "recommendation: none" in format_size_choice(choice)[-1]


def test_a_budget_needs_a_limit():
    with pytest.raises(UsageError, match="--max-size"):
        SizeBudget()


@settings(max_examples=60)
@given(kls=st.lists(st.floats(0, 1, allow_nan=False), min_size=1, max_size=12),
       sizes=st.lists(st.integers(1, 10**8), min_size=12, max_size=12), limit=st.integers(1, 10**8))
def test_the_choice_fits_and_nothing_that_fits_is_better(kls, sizes, limit):
    records = [record(f"T{i}", "GPTQ", sizes[i], kl) for i, kl in enumerate(kls)]
    choice = choose_by_size(frontier(records), SizeBudget(max_bytes=limit))
    assert {r.label for r in choice.fitting} | {r.label for r in choice.too_large} == {f"T{i} GPTQ" for i in
                                                                                      range(len(kls))}
    assert all(r.file_bytes <= limit for r in choice.fitting) and all(r.file_bytes > limit for r in choice.too_large)
    if choice.chosen is None:
        assert not choice.fitting and choice.smallest.file_bytes == min(sizes[:len(kls)]) > limit
    else:
        assert choice.chosen.file_bytes <= limit
        assert all(r.kl_divergence >= choice.chosen.kl_divergence for r in choice.fitting)


# -- the command line ------------------------------------------------------------------------------

def test_advise_names_the_type_that_fits(tmp_path, capsys):
    from quantkit.commands.cli import main

    path = write(tmp_path, frontier_data())
    out = tmp_path / "choice.json"
    assert main(["advise", "ref:small", "--max-size", "3.5MB", "--frontier", str(path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recommendation: Q3_K_M GPTQ" in text and "fits:" in text and "too large:" in text and "Q8_0" in text
    written = json.loads(out.read_text())
    assert written["recommended"]["type"] == "Q3_K_M" and written["budget"]["max_bytes"] == 3_500_000
    assert [r["type"] for r in written["too_large"]] == ["Q4_K_M", "Q8_0"]
    assert "make it: quantkit quantize ref:small --recipe q3_k_m-gptq --calib TEXT --out MODEL-Q3_K_M.gguf" in text
    assert main(["advise", "ref:small", "--max-bits-per-weight", "3.1", "--frontier", str(path)]) == 0
    assert "recommendation: Q2_K GPTQ" in capsys.readouterr().out


def test_advise_says_when_nothing_fits(tmp_path, capsys):
    from quantkit.commands.cli import main

    path = write(tmp_path, frontier_data())
    assert main(["advise", "ref:small", "--max-size", "2MiB", "--frontier", str(path)]) == 1
    text = capsys.readouterr().out
    assert "nothing fits at most 2.1 MB (2 MiB)" in text and "smallest measured file is Q2_K" in text


@pytest.mark.parametrize("argv, says", [
    (["--max-size", "60"], "'60' has no unit"),
    (["--max-size", "60MB"], "need --frontier FILE"),
    (["--frontier", "F"], "needs a budget"),
    (["--max-size", "60MB", "--frontier", "F", "--gpu", "h200"], "--gpu is for GPU advice"),
    (["--max-size", "60MB", "--frontier", "F", "--batch", "2"], "--batch is for GPU advice"),
    ([], "missing --gpu, --prompt-len, --output-len"),
    (["--gpu", "h200", "--prompt-len", "8"], "missing --output-len"),
    (["--max-size", "60MB", "--frontier", "missing.json"], "no such file"),
])
def test_advise_refuses_in_one_line(tmp_path, capsys, monkeypatch, argv, says):
    from quantkit.commands.cli import main

    monkeypatch.chdir(tmp_path)
    write(tmp_path, frontier_data(), "F")
    try:
        status = main(["advise", "ref:small", *argv])
    except SystemExit as e:  # argparse's own errors (a --max-size it cannot read) exit from the parser
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("quantkit advise: error: ") and says in err and err.count("\n") == 1


def test_advise_refuses_the_frontier_of_another_model(tmp_path, capsys):
    from quantkit.commands.cli import main

    path = write(tmp_path, frontier_data(model="ref:tiny"))
    assert main(["advise", "ref:small", "--max-size", "60MB", "--frontier", str(path)]) == 2
    err = capsys.readouterr().err
    assert "was measured on ref:tiny, not ref:small" in err and "frontier.py --model ref:small" in err
    from quantkit.formats.loading import resolve_model_source

    folder = resolve_model_source("ref:tiny")  # the same model by its folder
    assert main(["advise", folder, "--max-size", "60MB", "--frontier", str(path)]) == 0


def test_advise_recommends_only_what_quantkit_writes(tmp_path, capsys):
    from quantkit.commands.cli import main

    path = write(tmp_path, frontier_data(RECORDS + LLAMA))
    assert main(["advise", "ref:small", "--max-size", "3.5MB", "--frontier", str(path)]) == 0
    text = capsys.readouterr().out
    assert "recommendation: Q3_K_M GPTQ" in text and "make it: quantkit quantize ref:small --recipe q3_k_m-gptq" in text
    assert "not candidates: 2 files of llama.cpp" in text


def test_advise_through_the_installed_command(tmp_path):
    """The real command line in a process of its own: the answer on stdout, exit 0."""
    import subprocess
    import sys

    path = write(tmp_path, frontier_data())
    done = subprocess.run([sys.executable, "-m", "quantkit", "advise", "ref:small", "--max-size", "4MB",
                           "--frontier", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "recommendation: Q4_K_M GPTQ" in done.stdout
