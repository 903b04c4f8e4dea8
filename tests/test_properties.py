"""Property-based tests (hypothesis) of the edges: the recipe loader and the typed configs, the bench and
quality readers, and every output path. They assert the contract, not a message: bad input is one
QuantkitError (ValueError for QuantScheme) of one line, or on the command line one line on stderr and exit
status 2; nothing is written; nothing that is not a regular file quantkit may replace is ever replaced.

Calls run in process (no subprocesses), with few examples each, so the whole file takes well under a minute
on two cores."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from quantkit.commands.cli import main
from quantkit.core.errors import ConfigError, QuantkitError
from quantkit.quantization.recipe import AlgorithmConfig, Recipe, load_recipe
from quantkit.core.scheme import QuantScheme

#: in CI (CI set) the examples are derandomized: the same examples every run, so a run cannot fail by the
#: draw; elsewhere every run draws new ones (and hypothesis keeps the failures it finds to replay them)
DERANDOMIZE = bool(os.environ.get("CI"))
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                    derandomize=DERANDOMIZE)
#: examples that run a command each (a report renders plots): fewer, and a failure is shown as found (shrinking
#: one takes minutes)
FEW = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
               phases=[Phase.explicit, Phase.reuse, Phase.generate], derandomize=DERANDOMIZE)
REAL_BENCH = Path(__file__).resolve().parent.parent / "evals" / "reports" / "cpu" / "bench.json"

# -- values a careless file or script gives -----------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-300, 300), st.sampled_from([0, 4, 8, 32, 64, 128, 2**63, -1]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([4.0, 128.0, 1e308, -0.0]),
    st.text(max_size=12), st.sampled_from(["int", "float", "group", "channel", "tensor", "Linear", "lm_head",
                                           "re:.*proj", "re:(", "rtn", "gptq", "awq", "128", "true", "weight"]),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(["name", "num_bits", "type", "x", "group_size"]) | st.text(max_size=6), inner, max_size=4),
    max_leaves=10)
SCHEME_KEYS = ["num_bits", "type", "symmetric", "strategy", "group_size", "actorder"]
RECIPE_KEYS = ["version", "description", "weights", "targets", "ignore", "algorithm", "kv_cache", "indivisible"]


def schemes_dicts():
    base = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    return st.builds(lambda changes: {**base, **changes}, st.dictionaries(st.sampled_from(SCHEME_KEYS), scalars,
                                                                           max_size=3))


def recipe_dicts():
    return st.dictionaries(st.sampled_from(RECIPE_KEYS + ["weight", "algo"]),
                           st.one_of(values, schemes_dicts(), st.lists(st.text(max_size=8), max_size=3)), max_size=5)


def _fresh(tmp_path: Path) -> Path:
    """A new empty folder under the test's tmp_path (hypothesis runs every example in one test call)."""
    import tempfile

    return Path(tempfile.mkdtemp(dir=tmp_path))


def _one_line(error: BaseException) -> None:
    message = str(error)
    assert message and "\n" not in message, repr(message)


# -- the recipe loader and the typed configs ----------------------------------------------------------------

@SETTINGS
@given(recipe_dicts())
def test_a_recipe_dict_is_a_recipe_or_one_config_error(data):
    try:
        recipe = load_recipe(data)
    except ConfigError as e:
        _one_line(e)
        return
    assert isinstance(recipe.targets, tuple) and all(isinstance(t, str) and t for t in recipe.targets)
    assert isinstance(recipe.ignore, tuple) and all(isinstance(t, str) and t for t in recipe.ignore)
    assert isinstance(recipe.algorithm, AlgorithmConfig) and recipe.algorithm.options is not None
    assert load_recipe(recipe.to_dict()) == Recipe(**{**recipe.__dict__})  # what it writes, it reads back


@SETTINGS
@given(st.dictionaries(st.sampled_from(SCHEME_KEYS), scalars, max_size=6))
def test_a_quant_scheme_checks_its_own_fields(fields):
    try:
        scheme = QuantScheme(**fields)
    except ValueError as e:
        _one_line(e)
        return
    assert isinstance(scheme.num_bits, int) and not isinstance(scheme.num_bits, bool)
    assert isinstance(scheme.symmetric, bool) and scheme.type in ("int", "float")
    assert scheme.group_size is None or (isinstance(scheme.group_size, int) and not isinstance(scheme.group_size, bool))


@SETTINGS
@given(st.dictionaries(st.sampled_from(RECIPE_KEYS + ["name"]), values, max_size=4))
def test_a_recipe_built_in_python_checks_its_own_fields(fields):
    fields.setdefault("weights", QuantScheme(num_bits=4, strategy="group", group_size=128))
    try:
        recipe = Recipe(**fields)
    except ValueError as e:  # ConfigError, or QuantScheme's ValueError
        _one_line(e)
        return
    assert isinstance(recipe.targets, tuple) and all(isinstance(t, str) for t in recipe.targets)
    assert isinstance(recipe.algorithm, AlgorithmConfig)


@SETTINGS
@given(scalars, st.one_of(st.none(), values))
def test_an_algorithm_config_checks_its_own_fields(name, options):
    try:
        config = AlgorithmConfig(name=name, options=options)
    except ConfigError as e:
        _one_line(e)
        return
    assert config.name in ("rtn", "gptq", "awq") and config.options is not None


YAML_PIECES = ["weights:", " {num_bits: 4, strategy: channel}", " {num_bits: 4, num_bits: 8, strategy: channel}",
               "\n", "\n\t", "\n  ", "targets: [Linear]", "ignore: [lm_haed]", "---\n", "&a 1", "*a", "version: 1",
               "algorithm: gptq", "algorithm: {name: gptq, block_size: 128.5}", "kv_cache: {num_bits: 8}", ": :",
               "[", "}", "'", "\"", "#", "é", "\x00", "\ufeff", "group_size: '128'", "indivisible: ragged"]


@FEW
@given(st.lists(st.sampled_from(YAML_PIECES), min_size=1, max_size=8))
def test_a_recipe_file_gives_one_line_and_exit_2_or_is_a_recipe(tmp_path, capsys, pieces):
    """`quantize --recipe FILE`: a file that is no valid recipe ends with one line, exit 2, no output."""
    tmp_path = _fresh(tmp_path)
    path = tmp_path / "r.yaml"
    path.write_text("".join(pieces), encoding="utf-8", errors="surrogatepass")
    try:
        load_recipe(path)
        return  # a valid recipe: quantizing with it is another test's business
    except ConfigError as e:
        _one_line(e)
    out = tmp_path / "out"
    status = main(["quantize", "ref:tiny", "--recipe", str(path), "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and err.startswith("quantkit quantize: error: "), err
    assert not out.exists()


# -- the results readers --------------------------------------------------------------------------------------

def _leaves(data, where=()):
    """Paths to every number of a JSON value."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _leaves(v, (*where, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _leaves(v, (*where, i))
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        yield where


BENCH = json.loads(REAL_BENCH.read_text())
#: the numbers load_bench checks (its contract): records' shapes, times, roofline figures and memory, the
#: variants' sizes and the device's rates
CHECKED = {"batch", "prompt_len", "context_len", "median_s", "predicted_s", "intensity", "measured_over_predicted",
           "achieved_bandwidth", "weights_bytes", "kv_cache_bytes", "peak_bytes", "weight_bytes", "memory_bandwidth",
           "peak_flops"}
BENCH_NUMBERS = [w for w in _leaves(BENCH) if w[-1] in CHECKED or (len(w) > 1 and w[-2] == "times_s")]
odd_numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
    [0, -1, 1e308, -1e308, 5e-324, 2**64, True, None, "1", [], {}]), st.integers())


def _set(data, where, value):
    for key in where[:-1]:
        data = data[key]
    data[where[-1]] = value


def _strict_json(text: str):
    def refuse(name):
        raise AssertionError(f"{name} in report.json")
    return json.loads(text, parse_constant=refuse)


@FEW
@given(st.lists(st.tuples(st.sampled_from(BENCH_NUMBERS), odd_numbers), min_size=1, max_size=3))
@example(edits=[(("decode", 6, "median_s"), 436)])  # a median outside its own repeats: the plot's error bars were negative
def test_a_bench_file_is_refused_in_one_line_or_reported_as_valid_json(tmp_path, capsys, edits):
    data = json.loads(json.dumps(BENCH))
    for where, value in edits:
        _set(data, where, value)
    tmp_path = _fresh(tmp_path)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(data))  # NaN and Infinity as Python's json writes them
    out = tmp_path / "report"
    status = main(["report", "--bench", str(bench), "--out", str(out)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if status == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("quantkit report: error: "), err
        assert not out.exists(), "a refused report left its --out folder"
        return
    assert status == 0, err
    _strict_json((out / "report.json").read_text())


quality_values = st.one_of(odd_numbers, st.floats(0, 100))


@SETTINGS
@given(st.dictionaries(st.sampled_from(["perplexity", "baseline_perplexity", "kl_divergence", "top1_agreement",
                                        "log_ppl_ratio_stderr", "window", "windows", "tokens", "recipe", "x"]),
                       quality_values, max_size=6),
       st.sampled_from(["object", "list", "results"]))
def test_a_quality_file_is_a_result_or_one_usage_error(tmp_path, record, shape):
    from quantkit.harness.results import load_quality

    data = {"object": record, "list": [record], "results": {"results": [record]}}[shape]
    path = _fresh(tmp_path) / "q.json"
    path.write_text(json.dumps(data))
    try:
        results = load_quality([path])
    except QuantkitError as e:
        _one_line(e)
        return
    for r in results:
        for key in ("perplexity", "baseline_perplexity", "kl_divergence", "top1_agreement"):
            value = getattr(r, key)
            assert value is None or (isinstance(value, float) and math.isfinite(value))


# -- every output path ----------------------------------------------------------------------------------------

KINDS = ["new", "file", "link-to-file", "link-to-new", "dangling-link", "link-to-folder", "folder", "dev-null",
         "dash", "stdout", "control", "empty", "in-missing-folder", "input"]


def _make(tmp: Path, kind: str) -> str:
    """An output path of `kind` under `tmp`."""
    (tmp / "target.txt").write_text("mine\n")
    (tmp / "dir").mkdir(exist_ok=True)
    paths = {
        "new": tmp / "new.json", "file": tmp / "target.txt", "folder": tmp / "dir", "dev-null": Path(os.devnull),
        "dash": "-", "stdout": "/dev/stdout", "control": tmp / "a\nb.json", "empty": "",
        "in-missing-folder": tmp / "no" / "such" / "x.json", "input": tmp / "quality.json",
    }
    if kind in paths:
        return str(paths[kind])
    link = tmp / f"{kind}.lnk"
    link.symlink_to({"link-to-file": "target.txt", "link-to-new": "fresh.json", "dangling-link": "no/such/x.json",
                     "link-to-folder": "dir"}[kind])
    return str(link)


def _snapshot(tmp: Path) -> dict:
    """Every entry below `tmp` (and /dev/null): its kind, a link's target, a file's bytes."""
    out = {"/dev/null": stat.S_IFMT(os.lstat(os.devnull).st_mode)}
    for root, dirs, files in os.walk(tmp):
        for name in dirs + files:
            p = Path(root) / name
            mode = os.lstat(p).st_mode
            out[str(p)] = (stat.S_IFMT(mode), os.readlink(p) if stat.S_ISLNK(mode) else
                           p.read_bytes() if stat.S_ISREG(mode) else None)
    return out


def _changed(before: dict, after: dict) -> list[str]:
    return [k for k in before if after.get(k) != before[k]]


@pytest.mark.parametrize("kind", KINDS)
def test_advise_json_writes_a_file_or_through_a_stream_and_never_replaces_anything_else(tmp_path, capsys, kind):
    tmp = tmp_path / kind
    tmp.mkdir()
    from fixtures.robustness_cases_reports import GOOD_QUALITY

    (tmp / "quality.json").write_text(json.dumps(GOOD_QUALITY))
    path = _make(tmp, kind)
    before = _snapshot(tmp)
    status = main(["advise", "ref:tiny", "--gpu", "h200", "--prompt-len", "8", "--output-len", "8", "--quality",
                   str(tmp / "quality.json"), "--json", path])
    captured = capsys.readouterr()
    after = _snapshot(tmp)
    assert "Traceback" not in captured.err
    if status == 2:
        assert len([line for line in captured.err.splitlines() if line]) == 1, captured.err
        assert captured.err.startswith("quantkit advise: error: ")
        assert after == before, "a refused output changed something"
        return
    assert status in (0, 1), captured.err  # 1: no scheme recommended, the JSON still written
    for where in _changed(before, after):
        kind_before, kind_after = before[where], after.get(where)
        assert where != "/dev/null" and kind_before[0] == stat.S_IFREG and kind_after[0] == stat.S_IFREG, \
            f"{where} was replaced: {kind_before} -> {kind_after}"
        assert Path(where).resolve() == Path(path).resolve(), f"{where} changed, not the output {path}"
    if kind in ("dash", "stdout"):
        assert "workload" in json.loads(captured.out)


FOLDER_KINDS = ["new", "file", "link-to-folder", "dangling-link", "empty-folder", "foreign-folder", "quantkit-folder",
                "control"]


def _folder_output(tmp: Path, kind: str) -> Path:
    out = tmp / ("a\tb" if kind == "control" else "out")
    if kind == "file":
        out.write_text("mine\n")
    elif kind in ("link-to-folder", "dangling-link"):
        (tmp / "elsewhere").mkdir()
        out.symlink_to("elsewhere" if kind == "link-to-folder" else "nowhere")
    elif kind == "empty-folder":
        out.mkdir()
    elif kind == "foreign-folder":
        out.mkdir()
        (out / "notes.txt").write_text("mine\n")
    elif kind == "quantkit-folder":
        from quantkit.files.outputs import atomic_output_dir

        with atomic_output_dir(out) as staging:
            (staging / "old.txt").write_text("old\n")
    return out


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("kind", FOLDER_KINDS)
def test_a_folder_output_is_written_whole_or_refused_without_advice_that_fails(tmp_path, kind, force):
    """atomic_output_dir (quantkit.save, quantize, demo, refmodel build): a refusal that advises force=True is
    one that force=True gets past; a refusal changes nothing."""
    from quantkit.core.errors import OutputExistsError
    from quantkit.files.outputs import atomic_output_dir

    tmp = tmp_path / f"{kind}-{force}"
    tmp.mkdir()
    out = _folder_output(tmp, kind)
    before = _snapshot(tmp)
    try:
        with atomic_output_dir(out, force=force) as staging:
            (staging / "new.txt").write_text("new\n")
    except QuantkitError as e:
        _one_line(e)
        assert _snapshot(tmp) == before
        if "force" in str(e):
            assert isinstance(e, OutputExistsError) and not force
            with atomic_output_dir(out, force=True) as staging:  # the advice works
                (staging / "new.txt").write_text("new\n")
        return
    assert not out.is_symlink() and (out / "new.txt").read_text() == "new\n"
    assert kind in ("new", "empty-folder", "quantkit-folder")


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("kind", ["new", "file-out", "link-to-folder", "quantkit-report", "foreign-report",
                                  "dev-null"])
def test_report_out_is_written_or_refused_and_a_forced_report_leaves_nothing_stale(tmp_path, capsys, kind, force):
    from fixtures.robustness_cases_reports import GOOD_QUALITY

    tmp = tmp_path / f"{kind}-{force}"
    tmp.mkdir()
    quality = tmp / "quality.json"
    quality.write_text(json.dumps(GOOD_QUALITY))
    out = tmp / "report"
    if kind == "file-out":
        out.write_text("mine\n")
    elif kind == "link-to-folder":
        (tmp / "elsewhere").mkdir()
        out.symlink_to("elsewhere")
    elif kind == "quantkit-report":
        assert main(["report", "--quality", str(quality), "--out", str(out)]) == 0
        (out / "roofline.png").write_bytes(b"not listed")  # a file of the same name quantkit did not write
    elif kind == "foreign-report":
        out.mkdir()
        (out / "report.md").write_text("mine\n")
    elif kind == "dev-null":
        out = Path(os.devnull)
    capsys.readouterr()
    before = _snapshot(tmp)
    argv = ["report", "--bench", str(REAL_BENCH), "--out", str(out)] + (["--force"] if force else [])
    status = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if status == 2:
        assert len(err.strip().splitlines()) == 1, err
        assert _snapshot(tmp) == before
        if "--force" in err:
            assert not force and main(argv + ["--force"]) == 0
        return
    assert status == 0, err
    listed = (out / "report.md").read_text()
    for png in Path(out).glob("*.png"):
        assert png.name in listed or png.name == "roofline.png", f"stale {png.name}"
    assert not (Path(out) / "quality.png").exists()
    assert stat.S_ISCHR(os.lstat(os.devnull).st_mode)


names = st.text(st.sampled_from("ab.-_ \n\t\x1b/\\é~*?\x7f"), min_size=0, max_size=12)


@SETTINGS
@given(names, st.booleans())
def test_any_output_name_is_written_where_it_says_or_refused_in_one_line(tmp_path, name, folder):
    """check_output_file + write_output_file (every --json) and atomic_output_dir (every --out folder, save):
    a name is refused in one line with nothing written, or the output is exactly at that name."""
    from quantkit.files.outputs import atomic_output_dir, check_output_file, write_output_file

    tmp = _fresh(tmp_path)
    cwd, home = os.getcwd(), os.environ.get("HOME")
    os.chdir(tmp)
    os.environ["HOME"] = str(tmp / "home")  # "~/..." names expand into the test's folder, never the user's home
    try:
        if folder:
            with atomic_output_dir(name) as staging:
                (staging / "x.txt").write_text("x\n")
        else:
            check_output_file(name)
            write_output_file(name, "{}\n")
    except QuantkitError as e:
        _one_line(e)
        assert not [p for p in tmp.rglob("*") if p.is_file()], "a refused output wrote a file"
        return
    except OSError:  # a name the filesystem itself refuses (a folder name that is a file's): never a traceback
        return     # of quantkit's; the command line reports it in one line with exit status 1
    finally:
        os.chdir(cwd)
        if home is None:
            del os.environ["HOME"]
        else:
            os.environ["HOME"] = home
    if name in ("-", "/dev/stdout", "/dev/stderr"):
        return
    target = tmp / (str(tmp / "home") + name[1:] if name == "~" or name.startswith("~/") else name)
    assert (target / "x.txt").read_text() == "x\n" if folder else target.read_text() == "{}\n"
