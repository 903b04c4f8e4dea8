"""The block-by-block runner: replayed block inputs, sub-layer order, families, save/load, offloading."""

import copy

import pytest
import torch
from torch import nn

import quantkit
from quantkit.algorithms.gptq import HessianSum
from quantkit.calibration import gptq_processor, run_blockwise
from quantkit.core.errors import QuantizationError
from quantkit.modules.quant_linear import QuantLinear

from .calibration_fixtures import CALIBRATION_FAMILIES, tiny_model, token_batches


class _RecordInputs:
    """A processor that quantizes nothing and keeps each block's replayed inputs and arguments."""

    def __init__(self):
        self.inputs, self.kwargs, self.finished = [], [], None

    def process_block(self, ctx):
        self.inputs.append([x.clone() for x in ctx.inputs])
        self.kwargs.append(ctx.kwargs)

    def finish(self, model):
        self.finished = model


@pytest.mark.parametrize("family", CALIBRATION_FAMILIES)
def test_replayed_block_inputs_match_the_model_forward(family):
    model = tiny_model(family, layers=3, sliding_window=16)
    batches = token_batches(model.config.vocab_size, seq_len=40)
    rec = _RecordInputs()
    run_blockwise(model, batches, [], [rec], progress=False)
    assert rec.finished is model
    with torch.no_grad():
        for b, ids in enumerate(batches):
            hidden = model(ids, output_hidden_states=True).hidden_states
            for i in range(3):
                torch.testing.assert_close(rec.inputs[i][b], hidden[i], rtol=0, atol=0)
    if family == "qwen2":  # sliding-window layers get their own mask: the runner replays per-block arguments
        masks = [rec.kwargs[i][0]["attention_mask"] for i in range(3)]
        assert masks[0] is not masks[1] and masks[1] is masks[2]


def _spy_on_gptq(monkeypatch):
    """Record (layer name, Hessian, QuantizedWeight) of every gptq_quantize call the runner makes (the
    Hessian: the one the step's factor_hessian was given, which the linears of the step share)."""
    calls, current = [], []
    real, real_factor = gptq_processor.gptq_quantize, gptq_processor.factor_hessian

    def spy_factor(hessian, *args, **kw):
        current[:] = [hessian.clone()]
        return real_factor(hessian, *args, **kw)

    def spy(weight, factor, scheme, options, **kw):
        q = real(weight, factor, scheme, options, **kw)
        calls.append((kw["name"], current[0], q))
        return q

    monkeypatch.setattr(gptq_processor, "factor_hessian", spy_factor)
    monkeypatch.setattr(gptq_processor, "gptq_quantize", spy)
    return calls


def _hessian_of_input(model, batches, name):
    """H of the input of module `name` over the calibration batches, from a plain model forward."""
    acc = HessianSum()

    def hook(module, args, output):
        acc.add(args[0])

    handle = model.get_submodule(name).register_forward_hook(hook)
    with torch.no_grad():
        for ids in batches:
            model(ids)
    handle.remove()
    return acc.hessian()


def test_sublayers_are_quantized_in_order_and_see_quantized_outputs(monkeypatch):
    model = tiny_model("llama", layers=2)
    float_model = copy.deepcopy(model)
    batches = token_batches(model.config.vocab_size)
    calls = _spy_on_gptq(monkeypatch)
    quantkit.quantize(model, "w4a16-gptq", calibration_data=batches, progress=False)

    order = [name.split(".", 2)[-1] for name, _, _ in calls]
    per_block = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert order == [f"{b}.{n}" for b in (0, 1) for n in per_block]

    # Replay: put every earlier linear's quantized weight into a float copy, step by step, and check that
    # the Hessian each GPTQ call got is the one of that step's input in the partly quantized model.
    replay = copy.deepcopy(float_model)
    by_name = {name: (h, q) for name, h, q in calls}
    checked_differs = 0
    for name, h_runner, q in calls:
        first = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        h_expected = _hessian_of_input(replay, batches, first)
        torch.testing.assert_close(h_runner, h_expected, rtol=1e-4, atol=1e-5)
        h_float = _hessian_of_input(float_model, batches, first)
        checked_differs += not torch.allclose(h_runner, h_float, rtol=1e-4, atol=1e-5)
        replay.get_submodule(name).weight.data = by_name[name][1].dequantize()
    assert checked_differs == len(calls) - 3  # all but block 0's q/k/v see quantized upstream outputs


@pytest.mark.parametrize("family, recipe", zip(CALIBRATION_FAMILIES, ["w4a16-gptq", "w4a16-awq", "w4a16-awq-asym",
                                                                       "w4a16-gptq-asym"]))
def test_families_quantize_save_and_load(family, recipe, tmp_path):
    model = tiny_model(family, layers=2, sliding_window=16)
    reference = copy.deepcopy(model)
    batches = token_batches(model.config.vocab_size)
    rtn = quantkit.quantize(copy.deepcopy(model), recipe.replace("gptq", "rtn").replace("awq", "rtn"), progress=False)
    quantkit.quantize(model, recipe, calibration_data=batches, progress=False)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 14
    assert isinstance(model.lm_head, nn.Linear)
    path = quantkit.save(model, tmp_path / "q")
    loaded = quantkit.load(path, backend="reference")
    ids = batches[0]
    with torch.no_grad():
        ref, ours, back, base = (m(ids).logits for m in (reference, model, loaded, rtn))
    torch.testing.assert_close(back, ours, rtol=1e-4, atol=1e-4)

    def kl(logits):
        return torch.nn.functional.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                          reduction="batchmean").item()

    assert kl(ours) < kl(base)  # calibrated beats RTN on its (random) calibration tokens


def test_unknown_family_is_a_clear_error():
    import transformers

    config = transformers.GPTNeoXConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=1,
                                        num_attention_heads=4, vocab_size=320)
    model = transformers.GPTNeoXForCausalLM(config)
    with pytest.raises(QuantizationError, match=r"model type 'gpt_neox'.*supported: llama, mistral, mixtral, olmoe, qwen2, qwen2_moe, qwen3, qwen3_moe"):
        quantkit.quantize(model, "w4a16-gptq", calibration_data=token_batches(320), progress=False)


def test_nan_activations_are_a_clear_error():
    model = tiny_model("llama", layers=2)
    with torch.no_grad():  # finite weights whose activations overflow, as fp16 models can
        model.model.layers[1].post_attention_layernorm.weight[3] = torch.finfo(torch.float32).max
    with pytest.raises(QuantizationError, match=r"NaN/Inf value\(s\) in the calibration activations at the input of "
                                                r"model\.layers\.1\.mlp\.gate_proj"):
        quantkit.quantize(model, "w4a16-gptq", calibration_data=token_batches(320), progress=False)
    model = tiny_model("llama", layers=1)
    with torch.no_grad():
        model.model.embed_tokens.weight[:] = float("nan")
    with pytest.raises(QuantizationError, match=r"model\.embed_tokens\.weight \(\d+ NaN/Inf values\)"):
        quantkit.quantize(model, "w4a16-awq", calibration_data=token_batches(320), progress=False)


FAST_AWQ = {"weights": {"num_bits": 4, "strategy": "group", "group_size": 128},
            "algorithm": {"name": "awq", "grid": 5, "clip_grid": 10}}


@pytest.mark.parametrize("recipe", ["w4a16-gptq", FAST_AWQ], ids=["gptq", "awq"])
def test_offloaded_model_quantizes_like_the_in_memory_one(recipe, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama", layers=3)
    model.save_pretrained(tmp_path / "float")
    batches = token_batches(model.config.vocab_size, batches=1, seq_len=64)
    device_map = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.layers.2": "cpu", "model.norm": "disk", "lm_head": "disk"}
    off = AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", device_map=device_map, offload_folder=tmp_path / "offload", dtype=torch.float32)
    assert off.model.layers[1].mlp.down_proj.weight.is_meta and off.model.embed_tokens.weight.is_meta
    in_memory = quantkit.quantize(model, recipe, calibration_data=batches, progress=False)
    quantkit.quantize(off, recipe, calibration_data=batches, progress=False)
    state_a, state_b = in_memory.state_dict(), off.state_dict()
    assert state_a.keys() == state_b.keys()
    for key in state_a:  # AWQ also folds scales into the (offloaded) norms: those must come back too
        assert not state_b[key].is_meta, key
        torch.testing.assert_close(state_b[key], state_a[key], rtol=0, atol=0, msg=key)
    assert not hasattr(off, "hf_device_map")
    path = quantkit.save(off, tmp_path / "q")
    ids = batches[0]
    with torch.no_grad():
        torch.testing.assert_close(quantkit.load(path, backend="reference")(ids).logits, in_memory(ids).logits)


@pytest.mark.parametrize("block_outputs", [True, False])
def test_awq_scale_search_for_qkv_compares_the_attention_output(monkeypatch, block_outputs):
    """AWQ's q/k/v scale search scores a candidate by the attention's output (forwards through the block on the
    first max_search_tokens tokens), or with block_outputs=False by the q/k/v projections' outputs."""
    from quantkit.algorithms.awq import scaled_effective_weight
    from quantkit.calibration import awq_processor
    from quantkit.quantization.recipe import recipe_from_dict

    model = tiny_model("llama", layers=1)
    float_model = copy.deepcopy(model)
    batches = token_batches(model.config.vocab_size, batches=3, batch_size=2, seq_len=48)
    qkv = ("q_proj", "k_proj", "v_proj")
    checked = []
    real = awq_processor.search_scales

    def spy(x_mean, loss, grid, w_mean):
        if not checked:  # the first search is block 0's q/k/v
            s = torch.exp(0.3 * torch.randn(x_mean.shape[0], generator=torch.Generator().manual_seed(5)))
            seen = batches[:2] if block_outputs else batches  # the first 192 tokens, or all (the subsample is all)
            checked.append((loss(s), _qkv_loss(float_model, seen, s, qkv, block_outputs, scaled_effective_weight)))
        return real(x_mean, loss, grid, w_mean)

    monkeypatch.setattr(awq_processor, "search_scales", spy)
    recipe = recipe_from_dict({
        "weights": {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 32}, "ignore": ["lm_head"],
        "algorithm": {"name": "awq", "grid": 2, "clip": False, "block_outputs": block_outputs,
                      "max_search_tokens": 192 if block_outputs else 4096},
    })
    quantkit.quantize(model, recipe, calibration_data=batches, progress=False)
    (got, expected), = checked
    assert got > 0
    assert got == pytest.approx(expected, rel=1e-4)


def _qkv_loss(float_model, batches, s, qkv, attention: bool, scaled_effective_weight):
    """Mean squared change of the attention's output (or of the q/k/v outputs) of block 0 when q/k/v get the
    AWQ-scaled, quantized weights Q(w * s) / s, from plain model forwards."""
    from quantkit.core.scheme import QuantScheme

    scheme = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32)
    attn = float_model.model.layers[0].self_attn
    names = ["self_attn"] if attention else [f"self_attn.{n}" for n in qkv]

    def outputs():
        seen = {n: [] for n in names}

        def keep(name):
            def hook(module, args, out):
                out = out[0] if isinstance(out, tuple) else out
                seen[name].append(out.reshape(-1, out.shape[-1]))
            return hook

        handles = [float_model.model.layers[0].get_submodule(n).register_forward_hook(keep(n)) for n in names]
        with torch.no_grad():
            for ids in batches:
                float_model(ids)
        for h in handles:
            h.remove()
        return torch.cat([torch.cat(seen[n]) for n in names], dim=-1)

    reference = outputs()
    originals = {n: getattr(attn, n).weight.data for n in qkv}
    for n in qkv:
        getattr(attn, n).weight.data = scaled_effective_weight(originals[n], s, scheme, originals[n].dtype)
    changed = outputs()
    for n in qkv:
        getattr(attn, n).weight.data = originals[n]
    return (changed - reference).pow(2).mean().item()


@pytest.mark.parametrize("family", CALIBRATION_FAMILIES)
def test_gptq_calibrates_a_targeted_output_head_on_the_final_norm(family):
    """With lm_head targeted (ignore: []), GPTQ quantizes it after the last block on the final norm of the
    quantized blocks' outputs, unannounced as RTN: on those inputs its output error is below RTN's of the
    same weights; AWQ, which has no head step, still says it rounded the head to nearest."""
    import dataclasses
    import warnings

    from quantkit.algorithms.rtn import rtn_quantize
    from quantkit.quantization.recipe import load_recipe

    model = tiny_model(family, layers=2)
    head = model.lm_head.weight.detach().clone()
    batches = token_batches(model.config.vocab_size)
    recipe = dataclasses.replace(load_recipe("w4a16-gptq"), ignore=())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantkit.quantize(model, recipe, calibration_data=batches, progress=False)
    assert not [w for w in caught if "outside the decoder blocks" in str(w.message)]
    assert isinstance(model.lm_head, QuantLinear)
    with torch.no_grad():
        hidden = torch.cat([model.model(ids).last_hidden_state.flatten(0, 1) for ids in batches])
        want = hidden @ head.T
        gptq = hidden @ model.lm_head.dequantized_weight().float().T
        rtn = hidden @ rtn_quantize(head, recipe.schemes_for(model, ["lm_head"])["lm_head"]).dequantize().T
    assert (gptq - want).pow(2).mean() < 0.8 * (rtn - want).pow(2).mean()

    awq = tiny_model(family, layers=2)
    with pytest.warns(UserWarning, match="lm_head: outside the decoder blocks, quantized with RTN"):
        quantkit.quantize(awq, dataclasses.replace(load_recipe("w4a16-awq"), ignore=()), calibration_data=batches,
                          progress=False)


@pytest.mark.parametrize("native", [False, True])
def test_bf16_models_calibrate_in_fp32_where_the_cpu_emulates_bf16(monkeypatch, native):
    """On a CPU without native bf16 a bf16 model's block passes run in fp32 (one block upcast at a time);
    the model comes back in bf16 with bf16 quantized layers, its outputs those of the bf16 calibration."""
    from quantkit.calibration import runner
    from quantkit.kernels import cpu_flags

    monkeypatch.setattr(cpu_flags, "_NATIVE_BF16", native)
    assert runner.calibration_dtype(torch.bfloat16, torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    assert runner.calibration_dtype(torch.float32, torch.device("cpu")) == torch.float32
    assert runner.calibration_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16

    model = tiny_model("llama").to(torch.bfloat16)
    model.model.layers[1].register_buffer("kept", torch.ones(3))  # an fp32 tensor of a bf16 model stays fp32
    seen = []
    real = gptq_processor.GPTQProcessor.process_block

    def record(self, ctx):
        seen.append((ctx.inputs[0].dtype, ctx.block.mlp.down_proj.weight.dtype, ctx.block.input_layernorm.weight.dtype))
        return real(self, ctx)

    monkeypatch.setattr(gptq_processor.GPTQProcessor, "process_block", record)
    batches = token_batches()
    quantkit.quantize(model, "w4a16-gptq", batches, progress=False)
    want = torch.bfloat16 if native else torch.float32
    assert seen == [(want, want, want)] * 2
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    assert floats == {torch.bfloat16} and model.model.layers[1].kept.dtype == torch.float32
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14 and {m.weight_scale.dtype for m in layers} == {torch.bfloat16}
    logits = model(batches[0]).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
