"""model.generate of a quantkit.load'ed model on the CPU (quantkit/runtime/fast_generate.py, decode_loop.py): quantkit's
C++ loop gives transformers' own tokens (greedy, sampling with a seed, end-of-sequence padding, stop strings,
streamers) for float and W4 models, and whatever it cannot honour runs transformers' generate, saying why."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

import quantkit
from quantkit.runtime.fast_generate import QUANTKIT_LOOP, FastGenerate
from quantkit.kernels.cpu_extension import load_cpu_kernels
from quantkit.refmodels import resolve_model_name
from quantkit.runtime.sampling import SamplingConfig

pytestmark = pytest.mark.skipif(not load_cpu_kernels().available, reason=load_cpu_kernels().reason)


@pytest.fixture(scope="module", params=["float", "w4a16-rtn"])
def model(request, tmp_path_factory):
    model = quantkit.load("ref:tiny", dtype=torch.float32)
    if request.param != "float":
        quantkit.quantize(model, request.param, progress=False)
        out = tmp_path_factory.mktemp("generate") / request.param
        quantkit.save(model, out)
        model = quantkit.load(out, dtype=torch.float32)
    return model


def prompts(model, batch=2, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=g)


def transformers_generate(model, *args, **kwargs):
    """transformers' own generate, whatever the instance's generate is."""
    return type(model).generate(model, *args, **kwargs)


def run(model, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loop ran: no fallback warning
        result = FastGenerate.of(model).run(*args, **kwargs)
    assert result.loop == QUANTKIT_LOOP and result.reason is None
    return result.sequences


def test_load_gives_the_instance_a_fast_generate_and_leaves_the_class_alone(model):
    assert isinstance(model.generate, FastGenerate) and FastGenerate.of(model) is model.generate
    assert "generate" not in type(model).__dict__ or not isinstance(type(model).__dict__["generate"], FastGenerate)
    plain = quantkit.load("ref:tiny", fast_generate=False)
    assert "generate" not in plain.__dict__


def test_a_copied_or_pickled_model_generates_with_its_own_tensors():
    model = quantkit.load("ref:tiny", dtype=torch.float32)
    ids = prompts(model, seed=10)
    want = model.generate(ids, max_new_tokens=5, do_sample=False)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin.generate.model is twin
        with torch.no_grad():
            twin.model.layers[0].mlp.down_proj.weight.mul_(-4)  # the original's weights stay
        assert torch.equal(twin.generate(ids, max_new_tokens=5, do_sample=False),
                           transformers_generate(twin, ids, max_new_tokens=5, do_sample=False))
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), want)


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=12), dict(max_new_tokens=12, do_sample=False), dict()],
                         ids=["max_new_tokens", "do_sample_false", "defaults"])
def test_greedy_tokens_equal_transformers_generate(model, kwargs):
    ids = prompts(model)
    got = model.generate(ids, **kwargs)
    assert torch.equal(got, transformers_generate(model, ids, **kwargs))
    assert torch.equal(run(model, ids, **kwargs), got)


def test_left_padded_prompts_give_transformers_tokens(model):
    ids = prompts(model, batch=3, length=9, seed=9)
    mask = torch.ones_like(ids)
    mask[0, :4], mask[2, :1] = 0, 0  # rows of 5, 9 and 8 tokens
    ids = ids.masked_fill(mask == 0, 2)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=2)
    assert torch.equal(run(model, ids, **kwargs), transformers_generate(model, ids, **kwargs))


def test_end_of_sequence_pads_finished_sequences_as_transformers_does(model):
    ids = prompts(model, batch=3, seed=1)
    free = transformers_generate(model, ids, max_new_tokens=10, do_sample=False, eos_token_id=[], pad_token_id=0)
    eos = int(free[1, ids.shape[1] + 2])  # the middle sequence's third new token ends it
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=2)
    want = transformers_generate(model, ids, **kwargs)
    assert (want[1, ids.shape[1] + 3:] == 2).all()
    assert torch.equal(run(model, ids, **kwargs), want)


@pytest.mark.parametrize("settings", [dict(), dict(temperature=0.7, top_k=20), dict(top_p=0.8, top_k=0)],
                         ids=["default_top_k_50", "temperature_top_k", "top_p"])
def test_sampled_tokens_with_a_seed_are_reproducible(model, settings):
    ids = prompts(model, seed=2)
    draws = []
    for _ in range(2):
        torch.manual_seed(7)
        draws.append(run(model, ids, max_new_tokens=16, do_sample=True, **settings))
    assert torch.equal(*draws)
    torch.manual_seed(8)
    assert not torch.equal(run(model, ids, max_new_tokens=16, do_sample=True, **settings), draws[0])


@pytest.mark.parametrize("settings", [dict(), dict(temperature=0.9, top_k=30, top_p=0.9), dict(top_k=0)],
                         ids=["default_top_k_50", "temperature_top_k_top_p", "no_top_k"])
def test_the_first_sampled_token_is_transformers_own(model, settings):
    """The prompt runs through the model's own forward in both, so the first token's logits are the same
    numbers: the settings read as transformers reads them and the same seed give its very token."""
    ids = prompts(model, batch=4, seed=3)
    torch.manual_seed(11)
    want = transformers_generate(model, ids, max_new_tokens=1, do_sample=True, **settings)
    torch.manual_seed(11)
    assert torch.equal(run(model, ids, max_new_tokens=1, do_sample=True, **settings), want)


def test_stop_strings_end_generation_as_in_transformers():
    model = quantkit.load("ref:small")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name("ref:small"))
    ids = tokenizer(["def main():\n"], return_tensors="pt")["input_ids"]
    free = transformers_generate(model, ids, max_new_tokens=24, do_sample=False)
    text = tokenizer.decode(free[0, ids.shape[1]:])
    stop = text[len(text) // 2: len(text) // 2 + 2]  # two characters the continuation holds
    kwargs = dict(max_new_tokens=24, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    want = transformers_generate(model, ids, **kwargs)
    assert want.shape[1] < free.shape[1]
    assert torch.equal(run(model, ids, **kwargs), want)


class Recorder:
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


def test_a_streamer_gets_what_transformers_gives_it(model):
    ids = prompts(model, batch=1, seed=4)
    mine, theirs = Recorder(), Recorder()
    run(model, ids, max_new_tokens=6, do_sample=False, streamer=mine)
    transformers_generate(model, ids, max_new_tokens=6, do_sample=False, streamer=theirs)
    assert len(mine.puts) == len(theirs.puts) == 7 and mine.ended == theirs.ended == 1
    assert all(torch.equal(a, b) for a, b in zip(mine.puts, theirs.puts))


@pytest.mark.parametrize("kwargs,reason", [
    (lambda: dict(num_beams=2), "beam_search"),
    (lambda: dict(repetition_penalty=1.3), "repetition_penalty=1.3"),
    (lambda: dict(return_dict_in_generate=True, output_scores=True), "output_scores=True"),
    (lambda: dict(cache=DynamicCache()), "a passed cache"),
    (lambda: dict(attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1] * 7])), "a padded batch the loop cannot"),
    (lambda: dict(min_new_tokens=3), "min_new_tokens=3"),
], ids=["beams", "repetition_penalty", "output_scores", "cache", "padding", "min_new_tokens"])
def test_what_the_loop_cannot_honour_runs_transformers_generate_saying_why(kwargs, reason):
    model = quantkit.load("ref:tiny", dtype=torch.float32)
    ids = prompts(model)
    result = FastGenerate.of(model).run(ids, max_new_tokens=4, **kwargs())
    assert result.reason and reason in result.reason and result.loop == f"transformers, because {result.reason}"
    want = transformers_generate(model, ids, max_new_tokens=4, **kwargs())
    assert torch.equal(getattr(result.sequences, "sequences", result.sequences), getattr(want, "sequences", want))
    announced = f"quantkit: model.generate runs transformers' own generate, because .*{reason}"
    with pytest.warns(UserWarning, match=announced):
        model.generate(ids, max_new_tokens=4, **kwargs())


def test_a_model_the_loop_cannot_run_falls_back_with_the_decoders_reason():
    model = quantkit.load("ref:tiny", dtype=torch.float32)
    model.config.hidden_act = "gelu"
    result = FastGenerate.of(model).run(prompts(model), max_new_tokens=2)
    assert result.reason == "hidden_act 'gelu' (the loop's MLP is SiLU-gated)"


def test_the_decoder_follows_the_model_when_its_tensors_change():
    """The decoder made by the first call is not reused once a weight is replaced or changed in place."""
    model = quantkit.load("ref:tiny", dtype=torch.float32)
    ids = prompts(model, seed=5)
    outputs = [model.generate(ids, max_new_tokens=10, do_sample=False)]
    layers = model.model.layers
    layers[0].mlp.down_proj.weight = torch.nn.Parameter(layers[0].mlp.down_proj.weight * -4)  # a new tensor
    outputs.append(model.generate(ids, max_new_tokens=10, do_sample=False))
    assert torch.equal(outputs[-1], transformers_generate(model, ids, max_new_tokens=10, do_sample=False))
    with torch.no_grad():
        layers[1].self_attn.q_proj.weight.mul_(-4)  # in place (the float decoder holds a concatenated copy of q/k/v)
    outputs.append(model.generate(ids, max_new_tokens=10, do_sample=False))
    assert torch.equal(outputs[-1], transformers_generate(model, ids, max_new_tokens=10, do_sample=False))
    assert not torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[1], outputs[2])


def test_cpu_decoder_generate_samples_and_stops_at_eos():
    model = quantkit.load("ref:tiny", dtype=torch.float32)
    ids = prompts(model, seed=6)
    decoder = quantkit.CpuDecoder(model, max_len=32)
    greedy = decoder.generate(ids, 8)
    assert torch.equal(greedy, transformers_generate(model, ids, max_new_tokens=8, do_sample=False))
    eos = int(greedy[0, ids.shape[1] + 1])
    stopped = decoder.generate(ids, 8, eos_token_id=eos)
    assert stopped.shape[1] <= greedy.shape[1] and (stopped[0, ids.shape[1] + 2:] == eos).all()
    config = SamplingConfig(1.0, top_k=10)
    draws = [decoder.generate(ids, 8, config, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(*draws) and not torch.equal(draws[0], greedy)
