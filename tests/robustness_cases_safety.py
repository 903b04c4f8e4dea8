"""Outputs that would destroy what the user did not name: the source model, a folder holding it, the working folder, other files, an input of the command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .robustness_cases import Case, checkpoint, float_folder


def _model(work: Path, where: str = "m") -> str:
    """A float model folder of the user's (the tiny reference model), at `work`/`where`."""
    dest = work / where
    if not dest.exists():
        shutil.copytree(float_folder(work), dest)
    return f"./{where}"


def _ckpt(work: Path) -> str:
    """A w4a16-rtn checkpoint of the user's, at `work`/ck."""
    if not (work / "ck").exists():
        shutil.copytree(checkpoint(work), work / "ck")
    return "./ck"


def _out_is_source(work):
    return ["quantize", _model(work), "--recipe", "w4a16-rtn", "--out", "./m", "--force"]


def _out_holds_source(work):
    source = _model(work, "wrap/m")
    (work / "wrap" / "notes.txt").write_text("the user's notes\n")
    return ["quantize", source, "--recipe", "w4a16-rtn", "--out", "./wrap", "--force"]


def _out_working_folder(work):
    (work / "notes.txt").write_text("the user's notes\n")
    return ["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", ".", "--force"]


def _out_other_files(work):
    (work / "results").mkdir()
    (work / "results" / "notes.txt").write_text("the user's notes\n")
    return ["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", "./results", "--force"]


def _out_checkpoint_with_notes(work):
    ckpt = _ckpt(work)
    (work / "ck" / "notes.txt").write_text("what this checkpoint was for\n")
    return ["quantize", "ref:tiny", "--recipe", "w8a16-rtn", "--out", ckpt, "--force"]


def _out_is_a_file(work):
    (work / "notes.txt").write_text("the user's notes\n")
    return ["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", "./notes.txt", "--force"]


def _out_holds_recipe(work):
    ckpt = _ckpt(work)
    return ["quantize", "ref:tiny", "--recipe", f"{ckpt}/recipe.yaml", "--out", ckpt, "--force"]


def _eval_json_checkpoint_config(work):
    ckpt = _ckpt(work)
    return ["eval", ckpt, "--baseline", "ref:tiny", "--json", f"{ckpt}/config.json"]


def _eval_json_data(work):
    (work / "text.txt").write_text("The evaluation text of the user. " * 64)
    return ["eval", _ckpt(work), "--baseline", "ref:tiny", "--data", "./text.txt", "--json", "./text.txt"]


def _eval_json_baseline_weights(work):
    source = _model(work)
    return ["eval", _ckpt(work), "--baseline", source, "--json", f"{source}/model.safetensors"]


def _bench_json_config(work):
    (work / "llama.json").write_text((Path(float_folder(work)) / "config.json").read_text())
    return ["bench", "./llama.json", "--json", "./llama.json"]


def _advise_json_quality(work):
    (work / "w4.json").write_text(json.dumps({"recipe": "w4a16-rtn", "perplexity": 12.0,
                                              "baseline_perplexity": 11.0}) + "\n")
    return ["advise", "ref:tiny", "--gpu", "h200", "--prompt-len", "128", "--output-len", "16",
            "--quality", "./w4.json", "--json", "./w4.json"]


def _report_over_quality(work):
    (work / "report").mkdir()
    (work / "report" / "report.json").write_text(json.dumps({"recipe": "w4a16-rtn", "perplexity": 12.0,
                                                             "baseline_perplexity": 11.0}) + "\n")
    return ["report", "--quality", "./report/report.json", "--out", "./report", "--force"]


def _demo_out_is_source(work):
    return ["demo", "--model", _model(work), "--out", "./m", "--force", "--no-bench"]


def _refmodel_over_model(work):
    _model(work)
    (work / "m" / "training.json").unlink()  # the user's model, not a reference model quantkit built
    return ["refmodel", "build", "tiny", "--out", "./m"]


CASES = [
    Case("force-out-is-source", "`quantize ./m --out ./m --force` (the source model as the output)", _out_is_source,
         "it is ./m, an input of this command"),
    Case("force-out-holds-source", "`--out ./wrap --force` where wrap holds the source model and notes.txt",
         _out_holds_source, "it holds ./wrap/m, an input of this command"),
    Case("force-out-working-folder", "`--out . --force` (the working folder, holding the user's files)",
         _out_working_folder, "it is the working folder"),
    Case("force-out-other-files", "`--out DIR --force` where DIR holds only the user's notes.txt", _out_other_files,
         "quantkit did not write it"),
    Case("force-out-checkpoint-with-notes", "`--out CK --force` where the checkpoint CK gained the user's notes.txt",
         _out_checkpoint_with_notes, "it holds files quantkit did not write (notes.txt)"),
    Case("force-out-is-a-file", "`--out notes.txt --force` (a file)", _out_is_a_file, "it is a file"),
    Case("force-out-holds-recipe", "`--recipe CK/recipe.yaml --out CK --force` (the recipe read is inside the output)",
         _out_holds_recipe, "it holds ./ck/recipe.yaml, an input of this command"),
    Case("eval-json-checkpoint-config", "`eval ./ck --json ./ck/config.json` (the checkpoint's own config)",
         _eval_json_checkpoint_config, "it is a file of ./ck, an input of this command"),
    Case("eval-json-data", "`eval --data text.txt --json text.txt` (the evaluation text)", _eval_json_data,
         "it is ./text.txt, an input of this command"),
    Case("eval-json-baseline-weights", "`eval --baseline ./m --json ./m/model.safetensors`",
         _eval_json_baseline_weights, "it is a file of ./m, an input of this command"),
    Case("bench-json-model-config", "`bench ./llama.json --json ./llama.json` (the model's config)",
         _bench_json_config, "it is ./llama.json, an input of this command"),
    Case("advise-json-quality", "`advise --quality w4.json --json w4.json`", _advise_json_quality,
         "it is ./w4.json, an input of this command"),
    Case("report-over-quality", "`report --quality out/report.json --out out --force` (the input is the report's "
         "name)", _report_over_quality, "it is ./report/report.json, an input of this command"),
    Case("demo-out-is-source", "`demo --model ./m --out ./m --force`", _demo_out_is_source,
         "it is ./m, an input of this command"),
    Case("refmodel-over-model", "`refmodel build tiny --out ./m` where ./m is the user's model", _refmodel_over_model,
         "quantkit did not write it"),
]
