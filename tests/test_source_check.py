"""Float sources load exactly as stored or are refused (the refusals themselves are robustness cases in
fixtures/robustness_cases_source.py); the reads of recipes and evaluation text are bounded."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.commands.cli import main
from quantkit.core.errors import MAX_MESSAGE_CHARS, CheckpointError, ConfigError
from quantkit.formats.loading import load_float_model


def _assert_loaded_as_stored(model, folder):
    state = model.state_dict()
    for name, stored in load_file(folder / "model.safetensors").items():
        if name in state:
            assert torch.equal(state[name], stored.to(state[name].dtype)), name


@pytest.mark.parametrize("family, tied", [("llama", True), ("llama", False), ("qwen2", False), ("mistral", True)])
def test_complete_sources_load_strictly(random_model_folder, family, tied, recwarn):
    """Tied weights (lm_head absent from the file) and non-persistent buffers (rotary inv_freq) are no mismatch."""
    folder = random_model_folder(family, tied=tied)
    stored = load_file(folder / "model.safetensors")
    assert ("lm_head.weight" in stored) != tied
    _assert_loaded_as_stored(load_float_model(str(folder)), folder)
    assert not [w for w in recwarn if "differs from its weights" in str(w.message)]


def test_legacy_rotary_buffers_in_the_file_are_no_mismatch(random_model_folder):
    """Older checkpoints store each layer's rotary inv_freq; transformers recomputes it and ignores them."""
    folder = random_model_folder("llama")
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(16)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    load_float_model(str(folder))


def test_not_strict_loads_as_transformers_does_and_warns(random_model_folder):
    folder = random_model_folder("llama")
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].to(torch.int32)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"down_proj\.weight.*up_proj\.weight \(I32\).*--allow-source-mismatch"):
        load_float_model(str(folder))
    with pytest.warns(UserWarning, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        model = load_float_model(str(folder), strict=False)
    assert model.model.layers[1].mlp.down_proj.weight.shape == (128, 384)


def test_allow_source_mismatch_quantizes_what_transformers_loads(random_model_folder, tmp_path, capsys):
    folder = random_model_folder("llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1}))
    out = tmp_path / "out"
    assert main(["quantize", str(folder), "--recipe", "w8a16-rtn", "--out", str(out)]) == 2
    assert "num_hidden_layers: 1, but the weights hold 2 layers" in capsys.readouterr().err and not out.exists()
    with pytest.warns(UserWarning, match=r"model\.layers\.1\."):
        assert main(["quantize", str(folder), "--recipe", "w8a16-rtn", "--out", str(out),
                     "--allow-source-mismatch"]) == 0
    assert not any(k.startswith("model.layers.1.") for k in load_file(out / "model.safetensors"))


def test_utf16_recipe_with_a_byte_order_mark_reads_as_its_utf8_twin(tmp_path):
    import quantkit

    text = "weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 64}\ndescription: café\n"
    (tmp_path / "a.yaml").write_text(text, encoding="utf-8")
    (tmp_path / "b.yaml").write_text(text, encoding="utf-16")
    a, b = (quantkit.load_recipe(tmp_path / n) for n in ("a.yaml", "b.yaml"))
    assert (a.weights, a.description) == (b.weights, b.description) == (a.weights, "café")


def test_alias_bomb_inside_targets_is_refused_before_it_expands(tmp_path):
    """Nine levels of nine aliases in `targets`: quoting the value in an error expanded 9**9 strings (GBs)."""
    import quantkit

    levels = ["&a [x, x, x, x, x, x, x, x, x]"]
    levels += [f"&{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]" for i in range(8)]
    path = tmp_path / "bomb.yaml"
    path.write_text("weights: {num_bits: 4, type: int, strategy: channel}\ntargets: [" + ", ".join(levels) + "]\n")
    with pytest.raises(ConfigError, match="line 2: recipes do not use YAML aliases") as info:
        quantkit.load_recipe(path)
    assert len(str(info.value)) < 300


def test_error_messages_are_capped_keeping_start_and_end(tmp_path, capsys):
    error = ConfigError("start " + "x" * 1_000_000 + " end")
    assert len(str(error)) <= MAX_MESSAGE_CHARS
    assert str(error).startswith("start ") and str(error).endswith(" end") and "characters left out" in str(error)
    name = str(tmp_path.joinpath(*["r" * 200] * 12))  # no such file; the unknown-recipe message quotes it whole
    assert main(["quantize", "ref:tiny", "--recipe", name, "--out", str(tmp_path / "out")]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line) <= MAX_MESSAGE_CHARS + len("quantkit quantize: error: ") and "built-in recipes:" in line


def test_unknown_keys_are_named_up_to_ten():
    from quantkit.quantization.recipe import recipe_from_dict

    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
    with pytest.raises(ConfigError) as info:
        recipe_from_dict({"weights": weights} | {f"key{i:03d}": 1 for i in range(500)})
    assert "'key009'" in str(info.value) and "'key010'" not in str(info.value) and "and 490 more" in str(info.value)


def test_eval_text_is_read_only_as_far_as_the_tokens_asked_for(tmp_path, monkeypatch):
    from quantkit.harness import eval_text

    tokenizer = eval_text.load_tokenizer("ref:tiny")
    line = " ".join(f"word{i % 97}" for i in range(40_000))  # one line, ~290k characters
    path = tmp_path / "one-line.txt"
    path.write_text(line)
    monkeypatch.setattr(eval_text, "READ_CHARS", 1000)
    reads = []
    original = eval_text._read_text_file
    monkeypatch.setattr(eval_text, "_read_text_file", lambda p, limit: reads.append(original(p, limit)) or reads[-1])
    first = eval_text.read_eval_tokens(tokenizer, str(path), max_tokens=300)
    assert not first.whole and first.ids.numel() == 300
    assert max(len(text) for text, _ in reads) < len(line) // 10  # a prefix, not the file
    full = tokenizer(line, add_special_tokens=False)["input_ids"]
    assert first.ids.tolist() == full[:300]  # the prefix tokenizes as the start of the whole text does
    everything = eval_text.read_eval_tokens(tokenizer, str(path), max_tokens=10 * len(full))
    assert everything.whole and everything.ids.tolist() == full


def test_eval_without_max_tokens_uses_a_short_text_whole(tmp_path, capsys):
    path = tmp_path / "short.txt"
    path.write_text("The quick brown fox jumps over the lazy dog.\n" * 60)
    out = tmp_path / "r.json"
    assert main(["eval", "ref:tiny", "--baseline", "ref:tiny", "--data", str(path), "--window", "64",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "of the text's" in capsys.readouterr().err and result["windows"] >= 1
