"""Outputs that are no regular file, typed configs built in Python, inputs taken silently and messages that misled."""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from pathlib import Path

from quantkit.errors import ConfigError, OutputRefusedError, QuantizationError, UsageError

from .robustness_cases import W4, Case, PythonCase, _recipe, checkpoint, float_folder
from .robustness_cases_reports import _bench_file

#: a bench result `quantkit bench` wrote (committed with the CPU report)
REAL_BENCH = Path(__file__).resolve().parent.parent / "evals" / "reports" / "cpu" / "bench.json"
ADVISE = ["advise", "ref:tiny", "--gpu", "h200", "--prompt-len", "8", "--output-len", "8"]
EVAL = ["--baseline", "ref:tiny", "--max-tokens", "512"]


def _quantize(recipe: str, work: Path, source: str = "ref:tiny") -> list[str]:
    return ["quantize", source, "--recipe", recipe, "--out", str(work / "out")]


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _json_from(text: str) -> dict:
    data = json.loads(text)
    assert isinstance(data, dict)
    return data


# -- outputs that are not a regular file quantkit may replace ----------------------------------------------

def _eval_dev_null(work):
    return ["eval", str(checkpoint(work)), *EVAL, "--json", os.devnull]


def _check_dev_null(work, out):
    mode = os.stat(os.devnull).st_mode
    if not stat.S_ISCHR(mode) and os.geteuid() == 0:  # put the machine's /dev/null back before failing
        os.unlink(os.devnull)
        os.mknod(os.devnull, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        os.chmod(os.devnull, 0o666)
    assert stat.S_ISCHR(mode), "/dev/null was replaced"
    return "/dev/null is still a character device"


def _advise_stdout(name):
    return lambda work: [*ADVISE, "--json", name]


def _check_stdout_json(work, out):
    assert "workload" in _json_from(out), out[:200]
    return "the JSON alone on stdout (the advice on stderr)"


def _advise_link_to_file(work):
    (work / "real.json").write_text("{}\n")
    (work / "link.json").symlink_to("real.json")
    return [*ADVISE, "--json", str(work / "link.json")]


def _check_link_kept(work, out):
    assert (work / "link.json").is_symlink(), "the link was replaced"
    assert "workload" in _json_from((work / "real.json").read_text())
    return "link kept, the file it points to written"


def _advise_dangling_link(work):
    (work / "dangling.json").symlink_to("no-such-folder/x.json")
    return [*ADVISE, "--json", str(work / "dangling.json")]


def _bench_dangling_link(work):
    (work / "dangling.json").symlink_to("no-such-folder/x.json")
    return ["bench", "ref:tiny", "--json", str(work / "dangling.json"), "--device", "cpu", "--quiet"]


_FIFO_READ: dict[str, bytes] = {}


def _advise_fifo(work):
    fifo = work / "pipe"
    os.mkfifo(fifo)

    def read():  # the reader's open waits for the writer's, and the writer's for it
        fd = os.open(fifo, os.O_RDONLY)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        _FIFO_READ[str(fifo)] = b"".join(chunks)
        os.close(fd)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    _FIFO_READ[str(fifo) + ":thread"] = thread  # type: ignore[assignment]
    return [*ADVISE, "--json", str(fifo)]


def _check_fifo(work, out):
    fifo = work / "pipe"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the named pipe was replaced"
    _FIFO_READ[str(fifo) + ":thread"].join(10)  # type: ignore[attr-defined]
    assert "workload" in _json_from(_FIFO_READ.get(str(fifo), b"").decode())
    return "the JSON written through the pipe, which stays a pipe"


def _quantize_out_newline(work):
    return _quantize("w4a16-rtn", work)[:-1] + [str(work / "nl\nck")]


def _quantize_out_link_to_source(work):
    source = float_folder(work)
    (work / "out").symlink_to(source)
    return _quantize("w4a16-rtn", work, str(source))


def _quantize_out_link_to_ref(work):
    (work / "out").symlink_to(float_folder(work))
    return _quantize("w4a16-rtn", work)


def _quantize_out_file(work):
    (work / "out").write_text("a file of mine\n")
    return _quantize("w4a16-rtn", work)


# -- tracebacks ---------------------------------------------------------------------------------------------

def _eval_float_weights(work):
    ck = _copy(checkpoint(work), work / "ck")
    config = json.loads((ck / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        type="float", num_bits=8, group_size=None, strategy="channel")
    (ck / "config.json").write_text(json.dumps(config))
    return ["eval", str(ck), *EVAL]


def _set_all(phase, key, value):
    def edit(bench):
        for r in bench[phase]:
            r[key] = value
    return edit


def _report_bench(edit, *extra):
    return lambda work: ["report", "--bench", _bench_file(work, edit), "--out", str(work / "report"), *extra]


def _huge_time(bench):
    bench["decode"][1]["median_s"] = 1e308
    bench["decode"][1]["times_s"] = [1e308, 1e308]


def _empty_phases(bench):
    bench["prefill"], bench["decode"] = [], []


def _infinite_peak(bench):
    bench["settings"] = {"memory_method": "bytes of the tensors"}
    for r in bench["decode"]:
        r["memory"] = {"weights_bytes": 100, "kv_cache_bytes": 10, "peak_bytes": float("inf")}


def _twice_named(bench):
    bench["variants"][1]["name"] = "bf16"
    for r in bench["prefill"] + bench["decode"]:
        r["variant"] = "bf16"


# -- silent wrong results -----------------------------------------------------------------------------------

def _recipe_case(name, text):
    return lambda work: _quantize(_recipe(work, name, text), work)


def _shards_and_single(work):
    folder = _copy(float_folder(work), work / "both")
    shard = "model-00001-of-00001.safetensors"
    shutil.copy(folder / "model.safetensors", folder / shard)
    from safetensors import safe_open

    with safe_open(str(folder / shard), "pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": {n: shard for n in names}}))
    return _quantize("w4a16-rtn", work, str(folder))


def _eval_corrupt_tokenizer(work):
    ck = _copy(checkpoint(work), work / "ck")
    (ck / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "nonsense"')
    return ["eval", str(ck), *EVAL]


def _eval_other_tokenizer(work):
    from quantkit.loading import resolve_model_source

    ck = _copy(checkpoint(work), work / "ck")
    small = Path(resolve_model_source("ref:small"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (small / name).exists():
            shutil.copy(small / name, ck / name)
    return ["eval", str(ck), *EVAL]


def _report_force_over_quality(work):
    from .robustness_cases_reports import _quality_file

    from quantkit.cli import main

    assert main(["report", "--quality", _quality_file(work), "--out", str(work / "report")]) == 0
    assert (work / "report" / "quality.png").exists()
    bench = work / "bench.json"
    shutil.copy(REAL_BENCH, bench)
    return ["report", "--bench", str(bench), "--out", str(work / "report"), "--force"]


def _check_no_stale_plot(work, out):
    report = work / "report"
    assert not (report / "quality.png").exists(), "the earlier report's quality.png was left behind"
    text = (report / "report.md").read_text()
    for png in report.glob("*.png"):
        assert png.name in text, f"{png.name} is not in the new report"
    return "the new report's files only (quality.png of the earlier one removed)"


# -- the Python API -----------------------------------------------------------------------------------------

def _w4():
    import quantkit

    return quantkit.QuantScheme(num_bits=4, strategy="group", group_size=128)


def _recipe_with(**fields):
    def call(work):
        from quantkit.recipe import Recipe

        return Recipe(weights=_w4(), **fields)
    return call


def _algorithm_magic(work):
    from quantkit.recipe import AlgorithmConfig

    return AlgorithmConfig(name="magic")


def _group_size_string(work):
    import quantkit

    return quantkit.QuantScheme(num_bits=4, strategy="group", group_size="128")


def _quantized_tiny():
    import quantkit

    from .conftest import make_random_model

    return quantkit.quantize(make_random_model("llama"), "w4a16-rtn", progress=False)


def _save_over_file(work):
    import quantkit

    (work / "model.bin").write_text("mine\n")
    quantkit.save(_quantized_tiny(), work / "model.bin")


def _save_newline(work):
    import quantkit

    quantkit.save(_quantized_tiny(), work / "nl\nck")


def _quantize_ignore_typo(work):
    import quantkit

    from .conftest import make_random_model

    recipe = quantkit.load_recipe({"weights": {"num_bits": 4, "strategy": "group", "group_size": 128},
                                   "ignore": ["lm_haed"]})
    quantkit.quantize(make_random_model("llama"), recipe, progress=False)


CASES = [
    # outputs
    Case("trust-eval-json-dev-null", "`eval --json /dev/null` (was: exit 0, /dev/null replaced by a 366-byte file)",
         _eval_dev_null, "still a character device", status=0, check=_check_dev_null),
    Case("trust-advise-json-dev-stdout", "`advise --json /dev/stdout` (was: the /proc/self/fd/1 link replaced, "
         "nothing on stdout)", _advise_stdout("/dev/stdout"), "alone on stdout", status=0, check=_check_stdout_json),
    Case("trust-advise-json-dash", "`advise --json -` (was: a file named '-' written)", _advise_stdout("-"),
         "alone on stdout", status=0, check=_check_stdout_json),
    Case("trust-advise-json-link", "`advise --json LINK` to a regular file (was: the link replaced by a file)",
         _advise_link_to_file, "link kept", status=0, check=_check_link_kept),
    Case("trust-advise-json-fifo", "`advise --json PIPE`, a named pipe (was: the pipe replaced by a file)",
         _advise_fifo, "stays a pipe", status=0, check=_check_fifo),
    Case("trust-advise-json-dangling-link", "`advise --json LINK` to a path in no folder (was: the link replaced)",
         _advise_dangling_link, "which does not exist (nor its folder)", creates="no-such-folder"),
    Case("trust-bench-json-dangling-link", "`bench --json LINK` to a path in no folder (checked before any work)",
         _bench_dangling_link, "is a symbolic link to"),
    Case("trust-quantize-out-newline", "`quantize --out $'nl\\nck'` (was: recipe.yaml's comment broken over two "
         "lines, the file then unreadable)", _quantize_out_newline, "holds the control character '\\n'",
         creates="nl\nck"),
    Case("trust-quantize-out-link-to-source", "`quantize SRC --out LINK` where LINK points to SRC (refused "
         "before too: a guard)",
         _quantize_out_link_to_source, "an input of this command", absent="--force"),
    Case("trust-quantize-out-link", "`quantize --out LINK`, an existing link to a folder (was: --force advised, "
         "then refused)", _quantize_out_link_to_ref, "it is a symbolic link", absent="--force"),
    Case("trust-quantize-out-file", "`quantize --out FILE`, an existing file (was: --force advised, then refused)",
         _quantize_out_file, "it is a file, not an output folder", absent="--force"),
    # typed configs
    Case("trust-eval-float-weights", "`eval` of a checkpoint whose config says weights type float (was: a "
         "traceback, ValueError from QuantLinear)", _eval_float_weights, "weights are float per channel"),
    # silent wrong results
    Case("trust-report-time-1e308", "`report --bench` with a time of 1e308 s (was: matplotlib's traceback, an "
         "empty --out left)", _report_bench(_huge_time), "decode[1].median_s is 1e+308", creates="report"),
    Case("trust-recipe-duplicate-inline-key", "recipe `{num_bits: 4, ..., num_bits: 8}` (was: int8, the last one)",
         _recipe_case("dup-inline", W4.replace("}", ", num_bits: 8}")), "the key 'num_bits' is given twice",
         creates="out"),
    Case("trust-recipe-duplicate-top-key", "recipe with two `weights:` (was: the last one used)",
         _recipe_case("dup-top", W4 + W4.replace("num_bits: 4", "num_bits: 8")), "the key 'weights' is given twice",
         creates="out"),
    Case("trust-recipe-target-embedding", "recipe `targets: [model.embed_tokens]` next to Linear (was: dropped "
         "silently)", _recipe_case("embed", W4 + "targets: [Linear, model.embed_tokens]\n"),
         "'model.embed_tokens' matches only modules quantkit cannot quantize", creates="out"),
    Case("trust-recipe-ignore-typo", "recipe `ignore: [lm_haed]` (was: lm_head quantized, exit 0)",
         _recipe_case("typo", W4 + "ignore: [lm_haed]\n"), "did you mean 'lm_head'?", creates="out"),
    Case("trust-shards-and-single-file", "a model folder with a shard index and a model.safetensors (was: quantkit "
         "read the shards, transformers the single file)", _shards_and_single, "holds both model.safetensors",
         creates="out"),
    Case("trust-eval-corrupt-tokenizer", "`eval` of a checkpoint whose tokenizer.json is corrupt (was: ignored, "
         "the baseline's used silently)", _eval_corrupt_tokenizer, "could not load a tokenizer"),
    Case("trust-eval-other-tokenizer", "`eval` of a checkpoint holding another model's tokenizer (was: ignored)",
         _eval_other_tokenizer, "own tokenizer (tokenizer.json, tokenizer_config.json) differs from the baseline's"),
    Case("trust-report-empty-phases", "`report --bench` whose prefill and decode are empty (was: empty tables)",
         _report_bench(_empty_phases), "prefill and decode are both empty", creates="report"),
    Case("trust-report-infinite-peak", "`report --bench` with `peak_bytes: Infinity` (was: written into "
         "report.json, which was then not JSON)", _report_bench(_infinite_peak), "memory.peak_bytes is inf",
         creates="report"),
    # outputs
    Case("trust-report-force-stale-plot", "`report --force` without --quality over a report made with it (was: "
         "its quality.png left)", _report_force_over_quality, "quality.png of the earlier one removed", status=0,
         check=_check_no_stale_plot),
    # messages
    Case("trust-report-variant-twice", "`report --bench` with two variants of one name (was: \"prefill[1].variant "
         "is 'bf16'; allowed: ...\")", _report_bench(_twice_named), "the variant name 'bf16' is duplicated",
         creates="report"),
    Case("trust-recipe-tab-indent", "a tab-indented recipe (was: a 4-line error)",
         _recipe_case("tabs", "weights:\n\tnum_bits: 4\n"), "indent with spaces, not tabs", creates="out"),
    Case("trust-recipe-two-documents", "a recipe of two YAML documents (was: a 7-line error)",
         _recipe_case("two", W4 + "---\n" + W4), "more than one YAML document", creates="out"),
    Case("trust-inspect-unknown-user", "`inspect ~nosuchuser/model` (a home that does not exist; was: pathlib's "
         "RuntimeError traceback)", lambda w: ["inspect", "~nosuchuser/model"], "does not exist"),
    Case("trust-inspect-two-folders", "`quantkit inspect A B` (was: \"quantkit: error:\" without the command, "
         "after a usage block)", lambda w: ["inspect", "A", "B"], "quantkit inspect: error: unrecognized arguments: B"),
    Case("trust-quantize-unknown-option", "`quantkit quantize --calib-file x.txt` (an unknown option; was: "
         "\"quantkit: error:\")", lambda w: [*_quantize("w4a16-rtn", w), "--calib-file", "x.txt"],
         "quantkit quantize: error: unrecognized arguments: --calib-file x.txt", creates="out"),
]

PYTHON_CASES = [
    # typed configs
    PythonCase("trust-py-recipe-algorithm-string", "`Recipe(..., algorithm=\"gptq\")` (was: AttributeError later)",
               _recipe_with(algorithm="gptq"), ConfigError, "algorithm must be an AlgorithmConfig"),
    PythonCase("trust-py-algorithm-magic", "`AlgorithmConfig(name=\"magic\")` (was: KeyError later)",
               _algorithm_magic, ConfigError, "unknown algorithm 'magic'"),
    PythonCase("trust-py-recipe-targets-none", "`Recipe(..., targets=None)` (was: TypeError later)",
               _recipe_with(targets=None), ConfigError, "targets must be a list or tuple"),
    PythonCase("trust-py-recipe-targets-string", "`Recipe(..., targets=\"Linear\")` (was: split into 'L', 'i', ...)",
               _recipe_with(targets="Linear"), ConfigError, "e.g. ('Linear',), got 'Linear' (a str)"),
    PythonCase("trust-py-group-size-string", "`QuantScheme(group_size=\"128\")` (was: \"must be one of (32, 64, "
               "128) ..., got 128\")", _group_size_string, ValueError, "got '128' (a str)"),
    # outputs
    PythonCase("trust-py-save-over-file", "`quantkit.save(model, FILE)` over a file (was: force=True advised, then "
               "refused)", _save_over_file, OutputRefusedError, "it is a file", absent="force=True"),
    PythonCase("trust-py-save-newline", "`quantkit.save(model, \"nl\\nck\")`", _save_newline, UsageError,
               "holds the control character", creates="nl\nck"),
    # silent wrong results
    PythonCase("trust-py-quantize-ignore-typo", "`quantkit.quantize` with `ignore: [lm_haed]` (was: lm_head "
               "quantized)", _quantize_ignore_typo, QuantizationError, "'lm_haed' matches no module"),
]
