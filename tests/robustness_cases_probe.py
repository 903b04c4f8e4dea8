"""Inputs the CLI took silently or with a traceback: output paths, baselines, bench settings, results given twice, demo options."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from .robustness_cases import Case, checkpoint, float_folder

LONG = "n" * 256  # one byte more than the usual NAME_MAX of 255
TINY_BENCH = ["--prompt-lens", "8", "--context-lens", "8", "--batch-sizes", "1", "--warmup", "0", "--repeats", "1",
              "--gpu", "h200", "--device", "cpu", "--dtype", "float32", "--quiet"]
ADVISE = ["advise", "ref:tiny", "--gpu", "h200", "--prompt-len", "8", "--output-len", "8"]


def _names_can_be_longer() -> str | None:
    limit = os.pathconf(tempfile.gettempdir(), "PC_NAME_MAX")
    return f"this filesystem takes names of {limit} bytes" if limit >= len(LONG) + 30 else None


def _quality(work: Path, name: str, recipe: str, perplexity: float) -> str:
    path = work / f"{name}.json"
    path.write_text(json.dumps({"recipe": recipe, "perplexity": perplexity, "baseline_perplexity": 11.0}) + "\n")
    return str(path)


def _small_folder(work: Path) -> Path:
    """A copy of the small reference model's folder (another model than the tiny one)."""
    dest = work.parent / "_shared" / "small-float"
    if not dest.exists():
        from quantkit.loading import resolve_model_source

        shutil.copytree(resolve_model_source("ref:small"), dest)
    return dest


def _out_name_too_long(work):
    return ["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", str(work / LONG)]


def _refmodel_folder_too_long(work):
    return ["refmodel", "build", "tiny", "--out", str(work / LONG / "model")]


def _out_empty(work):
    return ["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", ""]


def _eval_json_empty(work):
    return ["eval", str(checkpoint(work)), "--baseline", "ref:tiny", "--max-tokens", "64", "--window", "32",
            "--json", ""]


def _advise_json_empty(work):
    return [*ADVISE, "--json", ""]


def _bench_other_baseline(work):
    return ["bench", str(checkpoint(work)), "--baseline", str(_small_folder(work)), *TINY_BENCH]


def _bench_other_shapes_allowed(work):
    return ["bench", str(checkpoint(work)), "--baseline", str(_small_folder(work)), "--allow-other-baseline",
            *TINY_BENCH]


def _eval_checkpoint_as_baseline(work):
    ck = str(checkpoint(work))
    return ["eval", ck, "--baseline", ck, "--max-tokens", "64", "--window", "32"]


def _eval_reversed(work):
    return ["eval", str(float_folder(work)), "--baseline", str(checkpoint(work)), "--max-tokens", "64", "--window", "32"]


def _bench_seed(work):
    return ["bench", "ref:tiny", "--seed", str(10**23), *TINY_BENCH]


def _bench_compile_backend(work):
    return ["bench", "ref:tiny", "--compile", "--compile-backend", "nonsense", *TINY_BENCH]


def _bench_backend_without_compile(work):
    return ["bench", "ref:tiny", "--compile-backend", "aot_eager", *TINY_BENCH]


def _bench_variant_plus(work):
    return ["bench", "ref:tiny", "--variants", "+", *TINY_BENCH]


def _eval_max_tokens_huge(work):
    return ["eval", str(checkpoint(work)), "--baseline", "ref:tiny", "--max-tokens", str(10**12)]


def _bench_nothing_measured(work):
    return ["bench", "ref:tiny", "--prompt-lens", "100000", "--context-lens", "100000", "--batch-sizes", "1",
            "--warmup", "0", "--repeats", "1", "--gpu", "h200", "--device", "cpu", "--quiet"]


def _report_quality_twice(work):
    quality = _quality(work, "w4", "w4a16-rtn", 12.0)
    return ["report", "--quality", quality, quality, "--out", str(work / "report")]


def _advise_two_results_one_scheme(work):
    return [*ADVISE, "--quality", _quality(work, "rtn", "w4a16-rtn", 12.0), _quality(work, "gptq", "w4a16-gptq", 11.5)]


def _inspect_config_file(work):
    return ["inspect", str(checkpoint(work) / "config.json")]


def _demo(*options: str):
    return lambda work: ["demo", "--model", "ref:tiny", "--no-bench", "--out", str(work / "out"), *options]


CASES = [
    Case("probe-out-name-too-long", "`quantize --out` a name of 256 bytes (more than NAME_MAX)", _out_name_too_long,
         "bytes per name this filesystem allows; choose a name of at most", skip=_names_can_be_longer),
    Case("probe-refmodel-folder-too-long", "`refmodel build --out` inside a folder name of 256 bytes",
         _refmodel_folder_too_long, f"the folder name '{LONG}' is 256 bytes", skip=_names_can_be_longer),
    Case("probe-out-empty", "`quantize --out \"\"` (an unset variable)", _out_empty, "the output path is empty"),
    Case("probe-eval-json-empty", "`eval --json \"\"` (was: no JSON written, exit 0)", _eval_json_empty,
         "the output path is empty"),
    Case("probe-advise-json-empty", "`advise --json \"\"` (was: no JSON written, exit 0)", _advise_json_empty,
         "the output path is empty"),
    Case("probe-bench-other-baseline", "`bench CK --baseline` a model CK was not quantized from",
         _bench_other_baseline, "is not the model"),
    Case("probe-bench-other-shapes-allowed", "`bench --allow-other-baseline` with a baseline of other shapes",
         _bench_other_shapes_allowed, "bench times every variant on the baseline's shapes"),
    Case("probe-eval-checkpoint-as-baseline", "`eval CK --baseline CK` (was: KL 0, exit 0)",
         _eval_checkpoint_as_baseline, "the baseline is itself quantized: 14 of its linears"),
    Case("probe-eval-reversed", "`eval FLOAT --baseline CK` (model and baseline swapped; was: exit 0)",
         _eval_reversed, "the baseline is itself quantized"),
    Case("probe-bench-seed-overflow", "`bench --seed 10**23` (was: a traceback after loading the models)",
         _bench_seed, "outside the range of torch's generators"),
    Case("probe-bench-compile-backend", "`bench --compile --compile-backend nonsense` (was: a traceback)",
         _bench_compile_backend, "'nonsense' is not a torch.compile backend"),
    Case("probe-bench-backend-without-compile", "`bench --compile-backend aot_eager` without `--compile` (was: "
         "ignored, timed eager)", _bench_backend_without_compile, "takes effect only with --compile"),
    Case("probe-bench-nothing-measured", "`bench` whose every length exceeds the context (was: exit 0, no timings)",
         _bench_nothing_measured, "nothing would be measured"),
    Case("probe-report-quality-twice", "`report --quality w4.json w4.json` (was: the row twice)",
         _report_quality_twice, "two quality results are named 'w4a16-rtn'", creates="report"),
    Case("probe-advise-two-results-one-scheme", "`advise --quality` RTN and GPTQ results of one scheme (was: the "
         "last one used)", _advise_two_results_one_scheme, "both measured 4-bit symmetric weights"),
    Case("probe-demo-no-recipes", "`demo --recipes ,` (was: a traceback)", _demo("--recipes", ","),
         "names no recipe", creates="out"),
    Case("probe-demo-recipe-twice", "`demo --recipes w4a16-rtn,w4a16-rtn` (was: a temporary folder named, --force "
         "advised)", _demo("--recipes", "w4a16-rtn,w4a16-rtn"), "names the recipe 'w4a16-rtn' twice", creates="out"),
    Case("probe-demo-max-tokens-below-window", "`demo --max-tokens 64` for a model of 256 positions (was: advised "
         "--window, which demo lacks)", _demo("--max-tokens", "64"),
         "--max-tokens 64 is less than one evaluation window of 256 tokens", creates="out"),
    Case("probe-inspect-config-file", "`inspect CK/config.json` (was: \"has no config.json\")", _inspect_config_file,
         "config.json is not a model folder but a file; give the folder that holds the model"),
    Case("probe-bench-variant-plus", "`bench --variants +` (was: an unnamed copy of the float model timed)",
         _bench_variant_plus, "variant '+' names no recipe"),
    Case("probe-eval-max-tokens-huge", "`eval --max-tokens 10**12` (was: MemoryError reserving 4 TB for the text)",
         _eval_max_tokens_huge, "is more than the evaluation text has"),
]
