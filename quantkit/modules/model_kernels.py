"""A model's quantized linears and their kernels: prepare them all for one backend, and say which layouts they run.

The one place that walks a model to set up its kernels (``quantkit.load`` and the benchmark's variants call
it): every QuantLinear repacked once for the backend (``QuantLinear.prepare``, which asks
``kernels.resolve_backend`` / ``planned_layout``), q/k/v and gate/up fused where the backend gains from it
(``kernels.fuses_projections``), and each MoE block's grouped layout built from its experts' layers.

Only QuantLinear has kernels to prepare (a GgufLinear dequantizes its blocks in its forward, a FusedPart
runs its group's QuantLinear), so the walk names that class here and nowhere else.
"""

from __future__ import annotations

from torch import nn

from ..kernels.backend_choice import fuses_projections
from .fused_linear import fuse_projections
from .moe import experts_modules
from .quant_linear import QuantLinear


def prepare_model_kernels(model: nn.Module, backend: str, *, fuse: bool | None = None,
                          release_checkpoint_tensors: bool = False) -> str | None:
    """Repack every QuantLinear of ``model`` for ``backend`` ("auto" | "triton" | "torch" | "reference"),
    fuse q/k/v and gate/up (``fuse`` True; None: where ``kernels.fuses_projections`` says the backend gains)
    and build the MoE blocks' grouped layouts.

    release_checkpoint_tensors: free the on-disk tensors the kernels do not read (after fusing, which reads
    them; the model can then no longer be saved or repacked). Returns the concrete backend the linears run on
    ("+"-joined, sorted, should they differ), or None when the model has no QuantLinear.
    """
    backends = {m.prepare(backend) for m in _quant_linears(model)}
    if fuse or (fuse is None and len(backends) == 1 and fuses_projections(*backends)):
        fuse_projections(model)
    if release_checkpoint_tensors:
        for m in _quant_linears(model):  # the fused layers among them
            m.prepare(m.backend, release_checkpoint_tensors=True)
    for _, experts in experts_modules(model):
        experts.prepare()  # the grouped MoE op's per-expert layout, from the layers just prepared
    return "+".join(sorted(backends)) or None


def kernel_layouts(model: nn.Module) -> list[str]:
    """The prepared layout each QuantLinear of ``model`` runs ("cpu_q8", "cpu_int4", "cpu_int8", "triton",
    "reference"; ``kernels.describe_layouts`` names their kernels), in module order."""
    return [m.kernel_layout for m in _quant_linears(model)]


def _quant_linears(model: nn.Module) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear)]
