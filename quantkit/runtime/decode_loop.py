"""Generating tokens in quantkit's C++ decode loop: the prompt through ``CpuDecoder.prefill``, then one
``CpuDecoder.step`` per token, each token chosen by ``quantkit.runtime.sampling``, until every sequence has
stopped or the token budget is spent. The loop follows transformers' ``generate`` step for step
(``GenerationMixin._sample``): a finished sequence gets the pad token while the others go on, the
stop test sees the whole sequence after each token, a streamer gets the prompt and then each token.

    decoder = quantkit.CpuDecoder(model, max_len=prompt_len + 64)
    ids = decode(decoder, input_ids, 64, SamplingConfig(0.8, top_p=0.95), stop=eos_stop([2]), pad_token_id=2)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..core.errors import UsageError
from .sampling import SamplingConfig, sample

#: stop test: the sequences so far, int64 [B, T] -> bool [B] (True: that sequence has finished)
StopTest = Callable[[torch.Tensor], torch.Tensor]


def eos_stop(eos_token_ids: Sequence[int]) -> StopTest:
    """The stop test of end-of-sequence tokens: a sequence is finished when its last token is one of them."""
    eos = torch.tensor(list(eos_token_ids), dtype=torch.int64)
    return lambda sequences: torch.isin(sequences[:, -1], eos)


def decode(decoder, input_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(), *,
           stop: StopTest | None = None, pad_token_id: int | None = None,
           generator: torch.Generator | None = None, streamer=None,
           attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """input_ids int64 [B, L] -> int64 [B, L + n], n <= max_new_tokens new tokens per sequence.

    decoder: a ``CpuDecoder`` with room for L + max_new_tokens positions.
    stop: when a sequence has finished (None: only the budget ends it); generation ends when all have.
    pad_token_id: the token a finished sequence gets while others go on (None: it keeps drawing tokens).
    generator: the random state of sampling (None: torch's global generator, as transformers).
    streamer: transformers' streamer interface: ``put(input_ids)`` once, ``put(tokens [B])`` per step, ``end()``.
    attention_mask: [B, L] of left-padded prompts, for the decoder's prefill.
    """
    if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
        raise UsageError(f"input_ids must be int64 [batch, length], got {input_ids.dtype} {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise UsageError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    length = input_ids.shape[1] + max_new_tokens
    if length > decoder.max_len:
        raise UsageError(f"{input_ids.shape[1]} prompt + {max_new_tokens} new tokens exceed the decoder's max_len "
                         f"{decoder.max_len}; make it with max_len >= {length}")
    if streamer is not None:
        streamer.put(input_ids.cpu())
    columns = [input_ids]
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool)
    for i in range(max_new_tokens):
        logits = decoder.prefill(input_ids, attention_mask) if i == 0 else decoder.step(token)  # fp32 [B, V]
        token = sample(logits, sampling, generator)  # int64 [B]
        if pad_token_id is not None:
            token = torch.where(unfinished, token, pad_token_id)
        columns.append(token[:, None])
        if stop is not None:
            unfinished &= ~stop(torch.cat(columns, dim=1))
        if streamer is not None:
            streamer.put(token.cpu())
        if not unfinished.any():
            break
    if streamer is not None:
        streamer.end()
    return torch.cat(columns, dim=1)
