"""The command line's habits: --version, `recipes`, a --help that loads neither torch nor
transformers, progress lines before the work, eval's stated token budget, inspect's size summary,
and recipe.yaml in every checkpoint."""

import json
import subprocess
import sys

import pytest
import yaml

from quantkit.commands.cli import main

HEAVY_MODULES = ("torch", "transformers", "triton", "safetensors", "datasets", "numpy")


def test_version(capsys):
    import quantkit

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"quantkit {quantkit.__version__}"


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["eval", "--help"], ["refmodel", "build", "--help"]])
def test_help_imports_neither_torch_nor_transformers(argv):
    # A fresh interpreter: this test process has imported torch long ago.
    code = (
        "import sys\n"
        "from quantkit.commands.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "usage: quantkit" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-400:]


def test_recipes_lists_every_builtin_with_its_description(capsys):
    from quantkit.quantization.recipe import builtin_recipes

    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    recipes = builtin_recipes()
    for name, path in recipes.items():
        description = yaml.safe_load(path.read_text())["description"]
        assert any(line.split() and line.split()[0] == name and description in line for line in lines), name
    assert main(["recipes", "w4a16-rtn"]) == 0
    assert "group_size: 128" in capsys.readouterr().out
    assert main(["recipes", "w4a16-nope"]) == 2
    assert "built-in recipes: " in capsys.readouterr().err


def test_bench_announces_each_shape_before_measuring_it(monkeypatch, capsys):
    import torch

    from quantkit.harness import timing
    from quantkit.harness.hardware import DeviceSpec
    from quantkit.harness.variants import float_variant

    from .conftest import make_random_model

    seen = []

    def fake_measure(variants, make_run, settings, device):
        seen.append(capsys.readouterr().err)  # what was printed before this shape's work began
        return [{"times_s": [1e-3], "memory": {"peak_bytes": 1}} for _ in variants]

    monkeypatch.setattr(timing, "_measure_variants", fake_measure)
    spec = DeviceSpec(name="test", memory_bandwidth=1e11, peak_flops=1e12, memory_bytes=2**34, source="datasheet")
    settings = timing.BenchSettings(prompt_lens=[16, 32], context_lens=[8], batch_sizes=[1], warmup=1, repeats=2)
    variant = float_variant(make_random_model("llama"))
    timing.run_bench([variant], spec, settings, device=torch.device("cpu"))
    assert len(seen) == 3
    assert "[1/3] prefill batch=1 prompt_len=16" in seen[0] and "2 shape(s) after this" in seen[0]
    assert "[2/3] prefill batch=1 prompt_len=32" in seen[1]
    assert "[3/3] decode batch=1 context_len=8" in seen[2] and "1 warm-up + 2 timed runs" in seen[2]
    timing.run_bench([variant], spec, settings, device=torch.device("cpu"), progress=False)
    assert seen[3:] == ["", "", ""], "progress=False prints nothing"


def test_bench_command_says_what_it_loads_and_prepares(tmp_path, capsys):
    from .test_bench import tiny_model_source

    source = tiny_model_source(tmp_path)
    assert main(["bench", source, "--variants", "w8a16-rtn", "--prompt-lens", "8", "--context-lens", "8",
                 "--batch-sizes", "1", "--warmup", "0", "--repeats", "1", "--device", "cpu",
                 "--backend", "reference", "--gpu", "h200", "--dtype", "fp32"]) == 0
    # --dtype pinned: with "auto" a CPU may time prefill and decode in different dtypes, each phase
    # then a run of its own numbered [1/1]; the progress lines are what this test is about
    err = capsys.readouterr().err
    assert f"bench: loading {source}" in err and "preparing variant 1/1: w8a16-rtn" in err
    assert err.index("loading") < err.index("preparing variant") < err.index("[1/2] prefill")


@pytest.fixture(scope="module")
def w8_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("habits") / "w8"
    assert main(["quantize", "ref:tiny", "--recipe", "w8a16-rtn", "--out", str(out)]) == 0
    return out


def test_eval_states_tokens_and_expected_time_and_defaults_to_a_budget(w8_checkpoint, tmp_path, capsys, monkeypatch):
    from quantkit.commands import eval as eval_command

    DEFAULT_MAX_TOKENS = 2048  # a smaller default keeps the test fast; the parser reads the module's value
    monkeypatch.setattr(eval_command, "DEFAULT_MAX_TOKENS", DEFAULT_MAX_TOKENS)

    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n\n" * 6000)  # far more tokens than the default budget
    report = tmp_path / "eval.json"
    assert main(["eval", str(w8_checkpoint), "--baseline", "ref:tiny", "--data", str(text), "--window", "256",
                 "--json", str(report)]) == 0
    err = capsys.readouterr().err
    result = json.loads(report.read_text())
    assert result["windows"] * result["window"] == DEFAULT_MAX_TOKENS, "the default reads a fixed budget"
    line = next(x for x in err.splitlines() if x.startswith("eval: ") and "windows of" in x)
    total = int(line.split("of the text's ")[1].split()[0])
    assert total > 2 * DEFAULT_MAX_TOKENS and f"{DEFAULT_MAX_TOKENS // 256} windows of 256 tokens" in line
    assert "expect up to ~" in line
    assert main(["eval", str(w8_checkpoint), "--baseline", "ref:tiny", "--data", str(text), "--window", "256",
                 "--max-tokens", "100"]) == 2
    assert "less than one window of 256 tokens" in capsys.readouterr().err


def test_eval_help_states_the_default_budget(capsys):
    from quantkit.commands.eval import DEFAULT_MAX_TOKENS

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert f"default: {DEFAULT_MAX_TOKENS}" in " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_inspect_prints_sizes_by_kind(w8_checkpoint, capsys):
    from safetensors import safe_open

    assert main(["inspect", str(w8_checkpoint)]) == 0
    shown = capsys.readouterr().out
    expected = {"packed weights": 0, "scales": 0}
    with safe_open(str(w8_checkpoint / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            kind = {"weight_packed": "packed weights", "weight_scale": "scales"}.get(key.rsplit(".", 1)[1])
            if kind:
                expected[kind] += t.numel() * t.element_size()
    summary = shown[shown.index("size by kind"):]
    assert "zero points" not in summary, "a symmetric checkpoint has none"
    assert "float embeddings" in summary and "norms, biases" in summary
    from quantkit.quantization.summaries import human_bytes

    for kind, nbytes in expected.items():
        assert nbytes > 0 and f"{kind}" in summary
        row = next(line for line in summary.splitlines() if line.strip().startswith(kind))
        assert human_bytes(nbytes) in row


def test_size_by_kind_counts_zero_points_and_ignored_linears():
    from quantkit.commands.inspect import size_by_kind

    layers = {
        "model.embed_tokens": {"weight": ((100, 8), "BF16", 1600)},
        "model.layers.0.mlp.up_proj": {"weight_packed": ((16, 1), "I32", 64), "weight_scale": ((16, 1), "BF16", 32),
                                       "weight_zero_point": ((2, 1), "I32", 8), "weight_shape": ((2,), "I64", 16)},
        "model.layers.0.input_layernorm": {"weight": ((8,), "BF16", 16)},
        "lm_head": {"weight": ((100, 8), "BF16", 1600)},
    }
    assert size_by_kind(layers) == {"packed weights": 64, "scales": 32, "zero points": 8, "float embeddings": 1600,
                                    "float linears": 1600, "norms, biases": 16, "kv scales": 0, "metadata": 16}


def test_checkpoint_carries_its_recipe_and_calibration(tmp_path, capsys):
    import quantkit

    out = tmp_path / "kv"
    assert main(["quantize", "ref:tiny", "--recipe", "kv-fp8", "--out", str(out), "--calib-samples", "4",
                 "--calib-seq-len", "64", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "calibration      : ref (the reference models' training text): 4 samples x 64 tokens, seed 3" in printed
    text = (out / "recipe.yaml").read_text()
    assert "--calib ref --calib-samples 4 --calib-seq-len 64 --seed 3" in text
    saved = quantkit.load_recipe(out / "recipe.yaml")
    original = quantkit.load_recipe("kv-fp8")
    assert saved.to_dict() == original.to_dict()

    w8 = tmp_path / "w8"
    assert main(["quantize", "ref:tiny", "--recipe", "w8a16-rtn", "--out", str(w8)]) == 0
    assert "calibration      : none" in capsys.readouterr().out
    assert quantkit.load_recipe(w8 / "recipe.yaml").to_dict() == quantkit.load_recipe("w8a16-rtn").to_dict()


def test_python_api_writes_recipe_yaml_for_token_id_calibration(tmp_path):
    import torch

    import quantkit

    from .conftest import make_random_model

    model = make_random_model("llama")
    quantkit.quantize(model, "kv-fp8", [torch.randint(0, 512, (2, 160))], progress=False)
    path = quantkit.save(model, tmp_path / "kv")
    text = (path / "recipe.yaml").read_text()
    assert "# calibration: token ids: 2 samples x 160 tokens" in text
    assert quantkit.load_recipe(path / "recipe.yaml").kv_cache is not None


def test_a_reader_that_stops_early_gets_no_traceback():
    """`quantkit recipes | head -1`: once the pipe's reader has gone, quantkit stops quietly with 141 (what a
    shell reports for SIGPIPE), not with a BrokenPipeError traceback. The reader goes before the command has
    printed anything (Python's start alone takes longer), so every write meets a closed pipe."""
    proc = subprocess.Popen([sys.executable, "-m", "quantkit", "recipes"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, bufsize=0)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
