"""``model.generate`` in quantkit's C++ decode loop, for the models ``quantkit.load`` returns on the CPU.

``quantkit.load`` gives the model instance it returns (not transformers' class) a ``FastGenerate`` as
its ``generate``. A call reads its arguments as transformers' ``generate`` does (the model's
``generation_config`` merged with the call's settings) and runs ``decode_loop.decode`` on a
``CpuDecoder`` when it can honour all of them: greedy search or sampling (``do_sample``,
``temperature``, ``top_k``, ``top_p``), ``max_new_tokens`` / ``max_length``, ``eos_token_id`` /
``pad_token_id``, ``stop_strings`` (with ``tokenizer=``), ``max_time``, ``stopping_criteria``, a
``streamer``, an ``attention_mask`` of left-padded prompts. The tokens are transformers' own: the same
warpers, the same draw from torch's global generator, the same padding of finished sequences.
Anything else (beam search and the other modes, logits processors, repetition penalties and any
other setting that changes the logits, ``output_scores`` / ``return_dict_in_generate``, a passed
cache, ``inputs_embeds``, a right-padded batch, a model or machine the loop cannot run) goes to
transformers' own ``generate`` unchanged, and a warning says why, once per reason.
``quantkit.load(path, fast_generate=False)`` keeps transformers' ``generate``.

    model = quantkit.load("ckpt")                        # on the CPU
    out = model.generate(ids, max_new_tokens=64, do_sample=True, top_p=0.9)   # the C++ loop
    result = FastGenerate.of(model).run(ids, max_new_tokens=64)  # with result.loop: which loop ran
"""

from __future__ import annotations

import functools
import inspect
import itertools
import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .cpu_decoder import CpuDecoder, _left_padded_lengths, decoder_unavailable
from .decode_loop import decode, eos_stop
from ..core.errors import UsageError
from .sampling import SamplingConfig

#: what ``Generated.loop`` says when quantkit's loop ran
QUANTKIT_LOOP = "quantkit's C++ loop"
#: generation settings the loop honours (the others must keep transformers' defaults)
HANDLED = frozenset({"max_length", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
                     "pad_token_id", "bos_token_id", "decoder_start_token_id", "stop_strings", "max_time", "use_cache",
                     "cache_implementation"})
#: settings that change how transformers runs or what other modes do (refused by the mode check), never
#: the tokens of greedy search and sampling
INERT = frozenset({"transformers_version", "_from_model_config", "cache_config", "max_cache_len", "compile_config",
                   "disable_compile", "prefill_chunk_size", "continuous_batching_config", "early_stopping",
                   "length_penalty", "num_assistant_tokens", "num_assistant_tokens_schedule",
                   "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "is_assistant",
                   "low_memory", "max_matching_ngram_size"})
#: transformers caches whose numerics are the plain cache's (a quantized one's are not)
PLAIN_CACHES = (None, "dynamic", "static", "offloaded", "offloaded_static")


@dataclass
class Generated:
    """sequences: int64 [B, L + n] as transformers' generate returns them; loop: QUANTKIT_LOOP or
    "transformers, because <reason>"; reason: None when quantkit's loop ran."""

    sequences: torch.Tensor
    loop: str
    reason: str | None = None


@dataclass
class _Plan:
    input_ids: torch.Tensor  # int64 [B, L]
    max_new_tokens: int
    sampling: SamplingConfig
    stop: object
    pad_token_id: int | None
    streamer: object
    attention_mask: torch.Tensor | None  # [B, L] of left-padded prompts, None: no padding


class FastGenerate:
    """A model instance's ``generate`` that runs quantkit's C++ loop where it can (module docstring).
    Keeps the ``CpuDecoder`` it made for the next call while the model's tensors stay the same."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._decoder: CpuDecoder | None = None
        self._made_for: tuple = ()

    @classmethod
    def of(cls, model: nn.Module) -> "FastGenerate":
        """The model's own FastGenerate (quantkit.load's), else a new one for it."""
        own = model.__dict__.get("generate")
        return own if isinstance(own, cls) and own.model is model else cls(model)

    def __call__(self, *args, **kwargs):
        result = self.run(*args, **kwargs)
        if result.reason:
            warnings.warn(f"quantkit: model.generate runs transformers' own generate, because {result.reason}",
                          stacklevel=2)
        return result.sequences

    def run(self, *args, **kwargs) -> Generated:
        """transformers' ``generate(*args, **kwargs)``, in quantkit's loop where it can honour them."""
        plan = self._plan(args, kwargs)
        if isinstance(plan, str):
            return Generated(type(self.model).generate(self.model, *args, **kwargs), f"transformers, because {plan}",
                             plan)
        sequences = decode(self._decoder_for(plan.input_ids.shape[1] + plan.max_new_tokens), plan.input_ids,
                           plan.max_new_tokens, plan.sampling, stop=plan.stop, pad_token_id=plan.pad_token_id,
                           streamer=plan.streamer, attention_mask=plan.attention_mask)
        return Generated(sequences, QUANTKIT_LOOP)

    def __reduce__(self):  # pickled and deep-copied as a new one for the model's copy (no decoder)
        return FastGenerate, (self.model,)

    def __repr__(self) -> str:
        return f"<quantkit FastGenerate of {type(self.model).__name__}.generate>"

    def _decoder_for(self, length: int) -> CpuDecoder:
        """A decoder with room for `length` positions (and the model's context), on the model's tensors as they
        are now (its cache grows as sequences do)."""
        tensors = tuple((name, t.data_ptr(), t._version, t.dtype) for name, t in
                        itertools.chain(self.model.named_parameters(), self.model.named_buffers()))
        if self._decoder is None or self._made_for != tensors or self._decoder.max_len < length:
            self._decoder = None  # its cache is freed before the next one is made
            context = getattr(self.model.config, "max_position_embeddings", None) or length
            self._decoder = CpuDecoder(self.model, max_len=max(length, context))
            self._made_for = tensors
        return self._decoder

    def _plan(self, args: tuple, kwargs: dict) -> "_Plan | str":
        """What the loop runs for these arguments of transformers' generate, or why it cannot (one line)."""
        model = self.model
        reason = decoder_unavailable(model)
        if reason:
            return reason
        try:
            named = _generate_signature().bind(model, *args, **kwargs).arguments
        except TypeError as e:
            return f"the arguments do not fit generate's signature ({e})"
        for name in ("logits_processor", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model",
                     "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate"):
            if named.get(name):
                return f"{name} is given"
        settings = dict(named.get("kwargs", {}))
        tokenizer = settings.pop("tokenizer", None)
        if "assistant_tokenizer" in settings:
            return "assistant_tokenizer is given"
        given = named.get("generation_config")
        try:
            config, model_inputs = model._prepare_generation_config(given, **settings)
        except Exception as e:  # noqa: BLE001 (transformers raises its own error for these settings)
            first = str(e).splitlines()[0] if str(e) else ""
            return f"transformers refuses these settings ({type(e).__name__}: {first})"
        mode = config.get_generation_mode(None)
        if mode not in ("greedy_search", "sample"):
            return f"{getattr(mode, 'value', mode)} (quantkit's loop runs greedy search and sampling)"
        reason = _setting_reason(config)
        if reason:
            return reason
        input_ids = named.get("inputs")
        if input_ids is None:
            input_ids = model_inputs.pop("input_ids", None)
        mask = model_inputs.pop("attention_mask", None)
        if model_inputs:
            names = ", ".join(sorted(model_inputs))
            cached = {"cache", "past_key_values"} & set(model_inputs)
            return f"a passed cache ({', '.join(sorted(cached))})" if cached else f"model inputs {names} are given"
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            return "the input is not a [batch, length] tensor of token ids"
        if input_ids.device.type != "cpu" or input_ids.shape[1] == 0:
            return "the input ids are not on the CPU" if input_ids.shape[1] else "the input is empty"
        if mask is not None and isinstance(mask, torch.Tensor) and bool((mask == 1).all()):
            mask = None
        if mask is not None:
            try:
                _left_padded_lengths(mask, tuple(input_ids.shape))
            except UsageError as e:
                return f"a padded batch the loop cannot take ({e})"
        return self._length_plan(input_ids.long(), mask, config, given, settings, tokenizer, named)

    def _length_plan(self, input_ids, mask, config, given, settings, tokenizer, named) -> "_Plan | str":
        model, length = self.model, input_ids.shape[1]
        if config.max_new_tokens is not None:
            max_length = config.max_new_tokens + length
        elif (settings.get("max_length") is None and (given is None or given.max_length is None)
              and model.generation_config.max_length is None):  # transformers' default: 20 new tokens
            max_length = config.max_length + length
            positions = getattr(model.config, "max_position_embeddings", None)
            max_length = max_length if positions is None else min(max_length, positions)
        else:
            max_length = config.max_length
        if length >= max_length:
            return f"max_length {max_length} leaves no room after the {length} input tokens"
        if config.do_sample:
            try:
                sampling = SamplingConfig(1.0 if config.temperature is None else config.temperature,
                                          config.top_k or 0, 1.0 if config.top_p is None else config.top_p)
            except UsageError as e:
                return str(e)
            if sampling.greedy:
                return "do_sample with temperature 0"
        else:
            sampling = SamplingConfig()
        tests = list(named.get("stopping_criteria") or [])
        eos = config.eos_token_id
        eos = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
        if eos:
            at_eos = eos_stop(eos)
            tests.append(lambda ids, _scores: at_eos(ids))
        if config.stop_strings:
            if tokenizer is None:
                return "stop_strings without tokenizer= (transformers needs the tokenizer to match them)"
            from transformers import StopStringCriteria  # import time: transformers loads only where it is used

            tests.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=config.stop_strings))
        if config.max_time is not None:
            deadline = time.time() + config.max_time
            tests.append(lambda ids, _scores: torch.full((ids.shape[0],), time.time() > deadline))
        padded = bool(eos) or any(hasattr(t, "eos_token_id") for t in named.get("stopping_criteria") or [])
        pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
        if padded and pad is None:
            return "a stopping criterion with eos_token_id but no pad_token_id"

        def stop(sequences: torch.Tensor) -> torch.Tensor:
            done = torch.zeros(sequences.shape[0], dtype=torch.bool)
            for test in tests:
                done |= torch.as_tensor(test(sequences, None), dtype=torch.bool)
            return done

        return _Plan(input_ids, max_length - length, sampling, stop if tests else None, pad if padded else None,
                     named.get("streamer"), mask)


def _setting_reason(config) -> str | None:
    """Why the loop cannot honour a generation setting (one that is not transformers' default), or None."""
    if config.cache_implementation not in PLAIN_CACHES:
        return f"cache_implementation={config.cache_implementation!r} (quantkit's loop has its own cache)"
    defaults = getattr(config, "_get_default_generation_params", dict)()  # transformers 5.x; {}: any value set refuses
    for key, value in sorted(config.to_dict().items()):
        if key in HANDLED or key in INERT or value is None or value is False or value == defaults.get(key):
            continue
        if isinstance(value, (list, dict)) and not value or key == "guidance_scale" and value == 1:
            continue
        return f"{key}={value!r}"
    return None


@functools.cache
def _generate_signature() -> inspect.Signature:
    from transformers import GenerationMixin  # import time: transformers loads only where it is used

    return inspect.signature(GenerationMixin.generate)


def install(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Give `model` (this instance) a FastGenerate as its ``generate`` when `enabled` and it runs on the CPU;
    returns the model."""
    if enabled and hasattr(model, "generate") and next(model.parameters()).device.type == "cpu":
        model.generate = FastGenerate(model)
    return model
