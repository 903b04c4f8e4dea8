"""NaN/Inf in a model or a checkpoint is an error naming the tensor, never a quiet 'perplexity nan'."""

import pytest
import torch
from safetensors.torch import load_file, save_file

import quantkit
from quantkit.commands.cli import main
from quantkit.core.errors import CheckpointError, QuantizationError

from .conftest import make_random_model


@pytest.mark.parametrize("recipe", ["w4a16-rtn", "kv-fp8"])
def test_nan_in_a_norm_weight_is_refused_by_quantize(recipe):
    model = make_random_model("llama")
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[7] = float("nan")
        model.model.norm.weight[1] = float("inf")
    with pytest.raises(QuantizationError, match=r"model\.layers\.0\.input_layernorm\.weight \(1 NaN/Inf value\), "
                                                r"model\.norm\.weight \(1 NaN/Inf value\)"):
        quantkit.quantize(model, recipe, [torch.randint(0, 512, (1, 32))], progress=False)


@pytest.fixture
def checkpoint_with_nan_scale(tmp_path):
    model = quantkit.quantize(make_random_model("llama"), "w4a16-rtn", progress=False)
    path = quantkit.save(model, tmp_path / "w4")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name][2, 1] = float("nan")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, name


def test_checkpoint_with_a_nan_scale_is_refused_by_load(checkpoint_with_nan_scale):
    path, name = checkpoint_with_nan_scale
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')} \(1 NaN/Inf value\); the checkpoint is corrupt"):
        quantkit.load(path)


def test_eval_of_a_checkpoint_with_a_nan_scale_exits_2(checkpoint_with_nan_scale, random_model_folder, capsys):
    path, name = checkpoint_with_nan_scale
    assert main(["eval", str(path), "--baseline", str(random_model_folder())]) == 2
    err = capsys.readouterr().err
    assert name in err and "Traceback" not in err


def test_nan_logits_are_an_evaluation_error_not_a_perplexity():
    from quantkit.core.errors import EvaluationError
    from quantkit.harness.quality import evaluate_quality

    baseline, broken = make_random_model("llama"), make_random_model("llama")
    with torch.no_grad():
        broken.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    windows = torch.randint(0, 512, (3, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(EvaluationError, match=r"'model' produced NaN/Inf logits on windows 0\.\.1"):
        evaluate_quality(broken, baseline, windows, batch_size=2, progress=False)
    with pytest.raises(EvaluationError, match="the baseline produced NaN/Inf logits"):
        evaluate_quality(baseline, broken, windows, batch_size=2, progress=False)
