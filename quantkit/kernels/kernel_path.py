"""The protocol every weight-only kernel path implements, on any device: ``KernelPath``.

A path names itself (``name``: the op or computation that runs), reads one prepared layout
(``layout``: "cpu_q8", "cpu_int4", "cpu_int8", "triton" or "reference"; ``wna16_layout``), says why it
cannot run a call (``can_run(m, k, n, dtype, layout)``: a reason, or None), builds its layout once from
the on-disk tensors (``prepare``; the paths of one layout share it), runs it
(``apply(x, *operands)``, the operands of its layout as the calling op receives them) and gives the
reference its result is tested against (``reference``, same arguments). ``keys`` names the tensors of a
prepared dict (``prepare_wna16``) that are its leading operands, in order; ``operands(prepared)`` reads them. The CPU paths are in
``cpu_kernel_choice``; the Triton kernel and the reference in ``backend_choice``.
"""

from __future__ import annotations

import torch


class KernelPath:
    """One kernel path for one layout."""

    name = ""
    layout = ""
    keys: tuple[str, ...] = ()

    @classmethod
    def operands(cls, prepared: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        """The tensors of ``prepared`` named by ``keys``, in order (None for an optional one it lacks)."""
        return tuple(map(prepared.get, cls.keys))  # per call on the decode path: no list in between

    @staticmethod
    def prepare(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None,
                shape) -> dict[str, torch.Tensor]:
        """The prepared dict of this path's layout (its tensors under ``keys``' names and the layout's others)
        from the on-disk tensors in uniform groups; ``shape``: their ``wna16_layout.WNA16Shape``."""
        raise NotImplementedError

    def can_run(self, m: int, k: int, n: int, dtype: torch.dtype, layout: str) -> str | None:
        """None if this path runs a call of x [m, k] (``dtype``) by a weight [n, k] in ``layout``, else why not."""
        return None if layout == self.layout else f"{self.name} reads the {self.layout} layout, not {layout}"

    def apply(self, x: torch.Tensor, *operands) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""
        raise NotImplementedError

    def reference(self, x: torch.Tensor, *operands) -> torch.Tensor:
        """What ``apply`` computes, in float torch without the kernel (its test's reference), in x's dtype."""
        raise NotImplementedError
