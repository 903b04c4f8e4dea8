"""Hook helpers shared by the block processors: evenly subsampled token rows of a module's input."""

from __future__ import annotations

import math

import torch


class TokenSubsample:
    """Keeps every `stride`-th token row of the inputs it is fed, so at most `max_tokens` rows in all.

    total_tokens: how many rows will be fed over one pass (the calibration token count).
    add(x): x [..., K]; `rows` is the kept fp32 [M, K] (M <= max_tokens), on x's device.
    """

    def __init__(self, total_tokens: int, max_tokens: int) -> None:
        self.stride = max(1, math.ceil(total_tokens / max(1, max_tokens)))
        self.offset = 0
        self.parts: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])  # [M, K]
        first = (-self.offset) % self.stride
        self.parts.append(x[first::self.stride].float())
        self.offset += x.shape[0]

    @property
    def rows(self) -> torch.Tensor:
        return torch.cat(self.parts) if len(self.parts) != 1 else self.parts[0]
