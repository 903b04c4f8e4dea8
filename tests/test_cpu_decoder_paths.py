"""CpuDecoder's linears take the path the kernel chooser gives their prepared layout at every number of rows
the C++ loop runs (its x is fp32 [batch, K]): quantkit::wna16_cpu_q8dot, the loop's own, on "cpu_q8" only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from quantkit.kernels import cpu_flags, cpu_kernel_choice
from quantkit.runtime import cpu_decoder


def _linear(layout: str, k: int = 256, n: int = 96) -> SimpleNamespace:
    """What loop_path_reason reads of a QuantLinear."""
    return SimpleNamespace(in_features=k, out_features=n, kernel_layout=layout)


@pytest.mark.parametrize("amx", (False, True), ids=("no-amx", "amx-bf16"))
@pytest.mark.parametrize("layout,runs", [
    ("cpu_q8", None),
    ("cpu_int4", "aten._weight_int4pack_mm_for_cpu at 1+ rows, int4 dequantized once + at::linear at 128+ rows"),
    ("cpu_int8", "aten._weight_int8pack_mm at 1+ rows, int8 dequantized once + at::linear at 32+ rows"),
    ("reference", "reference (dequantize + fp32 matmul) at 1+ rows"),
    ("triton", "quantkit::wna16_gemm (Triton) at 1+ rows"),
])
def test_the_loop_runs_what_the_chooser_picks(layout, runs, amx, monkeypatch):
    monkeypatch.setattr(cpu_flags, "amx_bf16", lambda: amx)  # bf16 prompts would dequantize; the loop's x is fp32
    reason = cpu_decoder.loop_path_reason(_linear(layout))
    if runs is None:
        assert reason is None
    else:
        assert reason == f"a quantized linear prepared for {layout!r}, not quantkit's C++ kernel (cpu_q8): {runs}"


def test_the_loop_path_is_the_chooser_s_at_every_batch(monkeypatch):
    """The rule the loop relied on (a cpu_q8 linear runs quantkit::wna16_cpu_q8dot whatever the batch) is the
    chooser's answer for fp32 rows, checked one batch size at a time."""
    monkeypatch.setattr(cpu_flags, "amx_bf16", lambda: True)
    for batch in range(1, 2 * max(cpu_kernel_choice.DEQUANT_MIN_ROWS.values()) + 2):
        path = cpu_kernel_choice.choose(batch, 256, 96, cpu_decoder.LOOP_ACTIVATION_DTYPE, "cpu_q8")
        assert type(path) is cpu_decoder.LOOP_PATH, batch


def test_the_loop_reads_its_path_s_operands():
    prepared = {"cpu_q8_weight": torch.ones(2, 32, dtype=torch.uint8), "cpu_q8_scale": torch.ones(2, 1)}
    weight, scale, zero = cpu_decoder.LOOP_PATH.operands(prepared)
    assert weight is prepared["cpu_q8_weight"] and scale is prepared["cpu_q8_scale"] and zero is None
