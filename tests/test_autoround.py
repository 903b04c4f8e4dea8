"""AutoRound: the fake quantizer matches RTN at its start, the tuned block beats RTN on its output, the
checkpoint saves and loads, options are checked, a seed fixes the result."""

import copy

import pytest
import torch

import quantkit
from quantkit.algorithms.autoround import (
    AutoRoundOptions, RoundingParams, check_scheme, fake_quantize, quantized_weight,
)
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.calibration import CalibrationConfig
from quantkit.core.errors import ConfigError, QuantizationError
from quantkit.modules.quant_linear import QuantLinear
from quantkit.quantization.recipe import load_recipe
from quantkit.core.scheme import QuantScheme, grid_scheme

SCHEMES = [
    QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32),
    QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=32),
    QuantScheme(num_bits=4, symmetric=True, strategy="channel"),
    QuantScheme(num_bits=8, symmetric=False, strategy="channel"),
    QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=64),  # K=120 below: a ragged last group
]
FAST = {"iters": 12, "batch_size": 4}


def _recipe(symmetric=True, group_size=32, **options):
    return load_recipe({"weights": {"num_bits": 4, "symmetric": symmetric, "strategy": "group",
                                    "group_size": group_size},
                        "algorithm": {"name": "autoround", **FAST, **options}})


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"w{s.num_bits}-{s.strategy}-sym{s.symmetric}")
def test_untuned_parameters_are_round_to_nearest(scheme):
    w = torch.randn(24, 120, generator=torch.Generator().manual_seed(0))
    params = RoundingParams.init(w, scheme)
    options = AutoRoundOptions()
    ours = quantized_weight(w, params, scheme, options)
    rtn = rtn_quantize(w, scheme)
    assert torch.equal(ours.q, rtn.q) and torch.equal(ours.scale, rtn.scale)
    assert (ours.zero_point is None) == (rtn.zero_point is None)
    if rtn.zero_point is not None:
        assert torch.equal(ours.zero_point, rtn.zero_point)
    torch.testing.assert_close(fake_quantize(w, params, scheme, options), rtn.dequantize())


def test_fake_quantize_matches_the_stored_weight_after_moving_parameters():
    scheme = SCHEMES[1]
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    params = RoundingParams.init(w, scheme)
    g = torch.Generator().manual_seed(2)
    params.offset.uniform_(-0.5, 0.5, generator=g)
    params.low.uniform_(0.6, 1.0, generator=g)
    params.high.uniform_(0.6, 1.0, generator=g)
    stored = quantized_weight(w, params, scheme, AutoRoundOptions())
    torch.testing.assert_close(fake_quantize(w, params, scheme, AutoRoundOptions()), stored.dequantize())
    assert int(stored.q.min()) >= scheme.qmin and int(stored.q.max()) <= scheme.qmax


def test_gradients_reach_offsets_and_ranges():
    scheme = SCHEMES[1]
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    params = RoundingParams.init(w, scheme)
    for t in params.tensors():
        t.requires_grad_(True)
    fake_quantize(w, params, scheme, AutoRoundOptions()).pow(2).sum().backward()
    assert all(t.grad is not None and bool(t.grad.abs().sum() > 0) for t in params.tensors())


@pytest.mark.parametrize("options, message", [
    ({"iters": 0}, "iters must be a positive whole number"),
    ({"iters": 2.5}, "iters must be a positive whole number"),
    ({"lr": -0.1}, "lr must be a positive finite step size"),
    ({"lr": float("nan")}, "lr must be a positive finite step size"),
    ({"minmax_lr": 0}, "minmax_lr must be a positive finite step size"),
    ({"batch_size": 0}, "batch_size must be a positive number"),
    ({"min_range": 1.5}, r"min_range must be in \(0, 1\]"),
])
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        AutoRoundOptions(**options)
    field = message.split(" must ")[0]  # the recipe checks the type first, with its own words
    with pytest.raises(ConfigError, match=f"algorithm \\(autoround\\): {field} must be"):
        load_recipe({"weights": {"num_bits": 4, "strategy": "channel"}, "algorithm": {"name": "autoround", **options}})


def test_default_lr_is_one_over_iters():
    assert AutoRoundOptions(iters=200).rounding_lr == 0.005 == AutoRoundOptions(iters=200).range_lr
    assert AutoRoundOptions(lr=0.01, minmax_lr=0.002).range_lr == 0.002


def test_gguf_grids_are_refused_naming_gptq():
    with pytest.raises(ValueError, match="use gptq"):
        check_scheme(grid_scheme("q4_k"))


def test_gguf_recipe_is_refused_before_tuning():
    model = quantkit.load("ref:tiny")
    recipe = load_recipe({"weights": {"grid": "q4_k", "num_bits": 4, "symmetric": False, "strategy": "group",
                                      "group_size": 32}, "algorithm": {"name": "autoround", **FAST}})
    with pytest.raises(QuantizationError, match="use gptq"):
        quantkit.quantize(model, recipe, calibration_data=_calibration(), progress=False)


def _calibration(seed=0, samples=8):
    return CalibrationConfig(num_samples=samples, seq_len=64, seed=seed)


def _kl(reference, model, ids):
    with torch.no_grad():
        ref, ours = reference(ids).logits.float(), model(ids).logits.float()
    return torch.nn.functional.kl_div(ours.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                      reduction="batchmean").item()


@pytest.fixture(scope="module")
def tiny_runs():
    """ref:tiny float, RTN and AutoRound (asym g32, 40 steps) on the same 16 calibration windows; other ids."""
    from quantkit.calibration.data import calibration_batches

    float_model = quantkit.load("ref:tiny")
    calibration = _calibration(samples=16)
    held_out = torch.cat(calibration_batches(_calibration(seed=7, samples=8), float_model))
    rtn = quantkit.quantize(copy.deepcopy(float_model), "w4a16-rtn-asym-g32", progress=False)
    tuned = quantkit.quantize(copy.deepcopy(float_model), _recipe(symmetric=False, iters=40, batch_size=8),
                              calibration_data=calibration, progress=False)
    return float_model, rtn, tuned, held_out, calibration


def test_autoround_beats_rtn_on_block_output_and_kl(tiny_runs):
    from quantkit.calibration.data import calibration_batches

    float_model, rtn, tuned, held_out, calibration = tiny_runs
    ids = torch.cat(calibration_batches(calibration, float_model))

    def block_mse(model):
        outs = {}
        for name, m in (("float", float_model), ("q", model)):
            handle = m.model.layers[0].register_forward_hook(lambda mod, a, out, n=name: outs.__setitem__(n, out))
            with torch.no_grad():
                m(ids)
            handle.remove()
        first = [o[0] if isinstance(o, tuple) else o for o in (outs["float"], outs["q"])]
        return float((first[0] - first[1]).pow(2).mean())

    assert block_mse(tuned) < block_mse(rtn)
    assert _kl(float_model, tuned, ids) < _kl(float_model, rtn, ids)  # the calibration windows


def test_checkpoint_saves_and_loads(tiny_runs, tmp_path):
    _float_model, _rtn, tuned, held_out, _calibration_ = tiny_runs
    assert sum(isinstance(m, QuantLinear) for m in tuned.modules()) == 14
    path = quantkit.save(tuned, tmp_path / "q")
    loaded = quantkit.load(path, backend="reference")
    ids = held_out[:2]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, tuned(ids).logits, rtol=1e-4, atol=1e-4)
    config = (path / "config.json").read_text()
    assert '"quantization_config"' in config


def test_same_seed_same_checkpoint_other_seed_differs():
    model = quantkit.load("ref:tiny")

    def run(seed):
        q = quantkit.quantize(copy.deepcopy(model), _recipe(seed=seed, iters=10, batch_size=2, lr=0.02),
                              calibration_data=_calibration(), progress=False)
        return torch.cat([m.weight_packed.flatten() for m in q.modules() if isinstance(m, QuantLinear)])

    first = run(0)
    assert torch.equal(first, run(0))
    assert not torch.equal(first, run(1))
