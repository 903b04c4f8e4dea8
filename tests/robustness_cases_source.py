"""Source models, config.json, devices, recipes and evaluation text that quantkit refuses"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from .robustness_cases import Case, _copy, _out, _recipe, W4, checkpoint, float_folder


def _source(work: Path, name: str, *, tensors: Callable[[dict], None] | None = None,
            config: Callable[[dict], None] | None = None) -> str:
    """A copy of the tiny float model with its tensors and/or config.json edited."""
    from safetensors.torch import load_file, save_file

    folder = _copy(float_folder(work), work / name)
    if tensors is not None:
        state = load_file(folder / "model.safetensors")
        tensors(state)
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        settings = json.loads((folder / "config.json").read_text())
        config(settings)
        (folder / "config.json").write_text(json.dumps(settings, indent=2))
    return str(folder)


def _quantize(source: str, work: Path) -> list[str]:
    return ["quantize", source, "--recipe", "w4a16-rtn", "--out", _out(work)]


def _as(name: str, dtype_name: str):
    def edit(state):
        import torch

        w = state[name]
        state[name] = (w * 1000).to(torch.int32) if dtype_name == "int32" else w.to(getattr(torch, dtype_name))
    return edit


def _without(name: str):
    return lambda state: state.pop(name)


def _missing_linear(work):
    return _quantize(_source(work, "missing-linear", tensors=_without("model.layers.0.mlp.down_proj.weight")), work)


def _missing_norm(work):
    return _quantize(_source(work, "missing-norm", tensors=_without("model.layers.1.input_layernorm.weight")), work)


def _untied_no_lm_head(work):
    return _quantize(_source(work, "untied", config=lambda c: c.update(tie_word_embeddings=False)), work)


def _fewer_layers(work):
    return _quantize(_source(work, "one-layer", config=lambda c: c.update(num_hidden_layers=1)), work)


def _int32_linear(work):
    return _quantize(_source(work, "int32", tensors=_as("model.layers.0.self_attn.q_proj.weight", "int32")), work)


def _fp8_linear(work):
    return _quantize(_source(work, "fp8", tensors=_as("model.layers.0.self_attn.q_proj.weight", "float8_e4m3fn")), work)


def _extra_tensor(work):
    def add(state):
        import torch

        state["model.extra.weight"] = torch.ones(4, 4)
    return _quantize(_source(work, "extra", tensors=add), work)


def _string_hidden_size(work):
    return _quantize(_source(work, "string-hidden", config=lambda c: c.update(hidden_size="128")), work)


def _impossible_heads(work):
    return _quantize(_source(work, "heads", config=lambda c: c.update(num_attention_heads=3)), work)


def _small_vocab(work):
    return _quantize(_source(work, "small-vocab", config=lambda c: c.update(vocab_size=1000)), work)


def _no_model_type(work):
    return _quantize(_source(work, "no-model-type", config=lambda c: c.pop("model_type")), work)


def _wrong_shape(work):
    def reshape(state):
        import torch

        state["model.layers.0.mlp.up_proj.weight"] = torch.ones(300, 128)
    return _quantize(_source(work, "wrong-shape", tensors=reshape), work)


def _remote_code(work):
    folder = Path(_source(work, "remote", config=lambda c: c.update(
        model_type="customllama", architectures=["CustomForCausalLM"],
        auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                  "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})))
    (folder / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass CustomConfig(LlamaConfig):\n    model_type = 'customllama'\n")
    (folder / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_custom import CustomConfig\n\n\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n")
    return _quantize(str(folder), work)


def _baseline_missing(work):
    source = _source(work, "baseline-missing", tensors=_without("model.layers.1.mlp.up_proj.weight"))
    return ["eval", str(checkpoint(work)), "--baseline", source, "--max-tokens", "512"]


def _bench_missing(work):
    source = _source(work, "bench-missing", tensors=_without("model.norm.weight"))
    return ["bench", source, "--device", "cpu", "--gpu", "h200", "--quiet"]


def _device_meta(work):
    return ["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", _out(work), "--device", "meta"]


def _triton_interpreted() -> str | None:
    """In a process whose kernels were built under TRITON_INTERPRET=1, Triton does run on CPU tensors."""
    from quantkit.kernels.wna16_triton import KERNELS_INTERPRETED

    return "the Triton kernels run interpreted on CPU in this process (TRITON_INTERPRET=1)" if KERNELS_INTERPRETED else None


def _triton_on_cpu(work):
    return ["eval", str(checkpoint(work)), "--baseline", "ref:tiny", "--backend", "triton", "--device", "cpu"]


def _recipe_latin1(work):
    path = work / "latin1.yaml"
    path.write_bytes((W4 + "description: caf\xe9\n").encode("latin-1"))
    return ["quantize", "ref:tiny", "--recipe", str(path), "--out", _out(work)]


def _recipe_utf16_no_bom(work):
    path = work / "utf16.yaml"
    path.write_bytes(W4.encode("utf-16-le"))
    return ["quantize", "ref:tiny", "--recipe", str(path), "--out", _out(work)]


def _alias_bomb(work):
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]" for i in range(8)]
    recipe = _recipe(work, "bomb", W4 + "\n".join(lines) + "\ntargets: *i\n")
    return ["quantize", "ref:tiny", "--recipe", recipe, "--out", _out(work)]


def _recipe_too_large(work):
    recipe = _recipe(work, "large", W4 + "".join(f"k{i}: 1\n" for i in range(300_000)))
    return ["quantize", "ref:tiny", "--recipe", recipe, "--out", _out(work)]


def _many_unknown_keys(work):
    recipe = _recipe(work, "many-keys", W4 + "".join(f"k{i}: 1\n" for i in range(5000)))
    return ["quantize", "ref:tiny", "--recipe", recipe, "--out", _out(work)]


def _eval_data_utf16(work):
    path = work / "utf16.txt"
    path.write_text("The quick brown fox jumps over the lazy dog.\n" * 200, encoding="utf-16")
    return ["eval", str(checkpoint(work)), "--baseline", "ref:tiny", "--data", str(path)]


def _eval_data_nul(work):
    path = work / "zeros.txt"
    path.write_bytes(b"\0" * 100_000)
    return ["eval", str(checkpoint(work)), "--baseline", "ref:tiny", "--data", str(path)]


def _eval_dev_zero(work):
    return ["eval", str(checkpoint(work)), "--baseline", "ref:tiny", "--data", "/dev/zero"]


def _max_tokens_beyond_text(work):
    path = work / "short.txt"
    path.write_text("The quick brown fox jumps over the lazy dog.\n" * 100)
    return ["eval", str(checkpoint(work)), "--baseline", "ref:tiny", "--data", str(path), "--max-tokens", "100000000"]


def _unknown_rope_type(work):
    return _quantize(_source(work, "rope", config=lambda c: c.update(rope_parameters={"rope_type": "nonsense"})), work)


def _corrupt_tokenizer(work):
    folder = Path(_source(work, "corrupt-tokenizer"))
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    return ["eval", str(checkpoint(work)), "--baseline", str(folder), "--max-tokens", "512"]


def _bench_random_config(work):
    settings = json.loads((float_folder(work) / "config.json").read_text())
    path = work / "random.json"
    path.write_text(json.dumps(settings | {"hidden_size": "128"}))
    return ["bench", str(path), "--device", "cpu", "--gpu", "h200", "--quiet"]


def _bench_threads(work):
    return ["bench", "ref:tiny", "--device", "cpu", "--gpu", "h200", "--threads", "100000"]


def _recipe_deep(work):
    recipe = _recipe(work, "deep", W4 + "targets: " + "[" * 20000 + "]" * 20000 + "\n")
    return ["quantize", "ref:tiny", "--recipe", recipe, "--out", _out(work)]


def _config_deep(work):
    folder = _copy(float_folder(work), work / "deep-config")
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    return _quantize(str(folder), work)


def _report_deep_json(work):
    path = work / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    return ["report", "--quality", str(path), "--out", str(work / "report")]


def _report_dev_zero(work):
    return ["report", "--quality", "/dev/zero", "--out", str(work / "report")]


def _refmodel_over_file(work):
    (work / "a-file").write_text("notes\n")
    return ["refmodel", "build", "tiny", "--out", str(work / "a-file")]


CASES = [
    Case("source-missing-linear", "a source `model.safetensors` without one linear's weight", _missing_linear,
         "missing from the weights (random values would take their place): model.layers.0.mlp.down_proj.weight",
         creates="out"),
    Case("source-missing-norm", "a source without one norm's weight", _missing_norm,
         "missing from the weights (random values would take their place): model.layers.1.input_layernorm.weight",
         creates="out"),
    Case("source-untied-no-lm-head", "an untied source (`tie_word_embeddings: false`) without `lm_head.weight`",
         _untied_no_lm_head, "lm_head.weight", creates="out"),
    Case("source-fewer-layers", "`config.json` saying `num_hidden_layers: 1` over a 2-layer checkpoint", _fewer_layers,
         "config.json says num_hidden_layers: 1, but the weights hold 2 layers", creates="out"),
    Case("source-int32-linear", "a source linear weight stored as int32", _int32_linear,
         "model.layers.0.self_attn.q_proj.weight (I32)", creates="out"),
    Case("source-fp8-linear", "a source linear weight stored as float8 (e4m3)", _fp8_linear,
         "model.layers.0.self_attn.q_proj.weight (F8_E4M3)", creates="out"),
    Case("source-extra-tensor", "a source tensor the model does not use", _extra_tensor,
         "stored but not in the model config.json describes (they would be dropped): model.extra.weight",
         creates="out"),
    Case("config-string-hidden-size", "`config.json` with `hidden_size: \"128\"` (a string)", _string_hidden_size,
         "invalid model config (Validation error for field 'hidden_size'", creates="out"),
    Case("config-impossible-heads", "`config.json` with 3 attention heads for a hidden size of 128", _impossible_heads,
         "not a multiple of the number of attention heads", creates="out"),
    Case("config-vocab-smaller", "`config.json` with a vocabulary smaller than the stored embedding", _small_vocab,
         "model.embed_tokens.weight (4096x128 stored, 1000x128 from config.json)", creates="out"),
    Case("config-no-model-type", "`config.json` without `model_type`", _no_model_type, "model_type", creates="out"),
    Case("source-tensor-shape", "a source tensor whose shape disagrees with `config.json`", _wrong_shape,
         "model.layers.0.mlp.up_proj.weight (300x128 stored, 384x128 from config.json)", creates="out"),
    Case("source-remote-code", "a source whose `auto_map` needs its own code, without `--trust-remote-code`",
         _remote_code, "pass --trust-remote-code", creates="out"),
    Case("eval-baseline-missing-tensor", "`eval --baseline` a folder missing one tensor", _baseline_missing,
         "model.layers.1.mlp.up_proj.weight"),
    Case("bench-source-missing-tensor", "`bench` of a folder missing its final norm", _bench_missing,
         "model.norm.weight"),
    Case("device-meta", "`--device meta`", _device_meta, "the meta device holds tensor shapes without their values",
         creates="out"),
    Case("backend-triton-on-cpu", "`eval --backend triton` on a CPU", _triton_on_cpu,
         "--backend triton: backend 'triton' needs the weights on a CUDA device", skip=_triton_interpreted),
    Case("recipe-latin1", "a recipe saved as Latin-1", _recipe_latin1, "cannot be read as text", creates="out"),
    Case("recipe-utf16-no-bom", "a recipe saved as UTF-16 without a byte-order mark", _recipe_utf16_no_bom,
         "cannot be read as text", creates="out"),
    Case("recipe-alias-bomb", "a YAML alias bomb in a recipe (nine levels of nine aliases)", _alias_bomb,
         "recipes do not use YAML aliases", creates="out"),
    Case("recipe-too-large", "a 3 MB recipe (300k keys)", _recipe_too_large, "larger than 64 KiB", creates="out"),
    Case("recipe-many-unknown-keys", "a recipe with 5000 unknown keys (the message names 10)", _many_unknown_keys,
         "and 4990 more", creates="out"),
    Case("eval-data-utf16", "`eval --data` a UTF-16 text file", _eval_data_utf16, "could not be read as UTF-8 text"),
    Case("eval-data-nul", "`eval --data` a `.txt` file of NUL bytes", _eval_data_nul, "holds NUL bytes"),
    Case("eval-data-dev-zero", "`eval --data /dev/zero`", _eval_dev_zero, "is not a file, a folder or a hub dataset"),
    Case("config-unknown-rope-type", "`config.json` with `rope_type: nonsense`", _unknown_rope_type,
         "transformers could not build the model", creates="out"),
    Case("baseline-corrupt-tokenizer", "a baseline whose `tokenizer.json` is corrupt", _corrupt_tokenizer,
         "could not load a tokenizer for"),
    Case("bench-random-config-string", "`bench` of a random-model config with `hidden_size: \"128\"`",
         _bench_random_config, "invalid model config"),
    Case("bench-threads-100000", "`bench --threads 100000` (OpenMP crashed creating them)", _bench_threads,
         "this machine has"),
    Case("recipe-deep-nesting", "a recipe nesting a list 20000 levels deep", _recipe_deep,
         "values nested more than 32 levels deep", creates="out"),
    Case("config-json-deep-nesting", "a source `config.json` nesting 100000 levels deep", _config_deep,
         "is not valid JSON", creates="out"),
    Case("report-quality-deep-json", "`report --quality` of JSON nested 100000 levels deep", _report_deep_json,
         "maximum recursion depth", creates="report"),
    Case("report-quality-dev-zero", "`report --quality /dev/zero` (read forever before)", _report_dev_zero,
         "not a regular file", creates="report"),
    Case("refmodel-out-file", "`refmodel build --out` naming a file", _refmodel_over_file,
         "it is a file, not an output folder quantkit wrote"),
    Case("eval-max-tokens-beyond-text", "`eval --max-tokens 100000000` over a 1000-token text", _max_tokens_beyond_text,
         "is more than the evaluation text has"),
]
