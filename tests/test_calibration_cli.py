"""`quantkit quantize` with calibrated recipes: --calib* / --seed options, errors with exit code 2."""

import json

from quantkit.commands.cli import main

from .calibration_fixtures import byte_tokenizer, tiny_model


def _model_folder(tmp_path):
    folder = tmp_path / "float"
    tiny_model("qwen2", layers=1).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_quantize_with_a_text_calibration_file(tmp_path, capsys):
    src = _model_folder(tmp_path)
    text = tmp_path / "calib.txt"
    text.write_text("\n".join(f"value_{i} = compute({i}, {i * 3})" for i in range(300)))
    out = tmp_path / "gptq"
    args = ["quantize", str(src), "--recipe", "w4a16-gptq-asym", "--out", str(out), "--calib", str(text),
            "--calib-samples", "6", "--calib-seq-len", "64", "--seed", "3"]
    assert main(args) == 0
    assert "layers quantized : 7" in capsys.readouterr().out
    weights = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert weights["symmetric"] is False and weights["actorder"] == "weight"  # act-order with static groups


def test_calibration_errors_exit_2_before_writing(tmp_path, capsys):
    src = _model_folder(tmp_path)
    out = tmp_path / "o"
    assert main(["quantize", str(src), "--recipe", "w4a16-awq", "--out", str(out)]) == 2
    assert "needs calibration data" in capsys.readouterr().err
    text = tmp_path / "short.txt"
    text.write_text("too short")
    assert main(["quantize", str(src), "--recipe", "w4a16-gptq", "--out", str(out), "--calib", str(text),
                 "--calib-samples", "4", "--calib-seq-len", "64"]) == 2
    assert "has only" in capsys.readouterr().err
    assert main(["quantize", str(src), "--recipe", "w4a16-gptq", "--out", str(out), "--calib-samples", "0"]) == 2
    assert "num_samples must be >= 1" in capsys.readouterr().err
    assert not out.exists()
