"""kernels.cpu_kernel_choice: which CPU kernel path runs a call, and why the others do not."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import cpu_flags, cpu_kernel_choice as choice


@pytest.mark.parametrize("native, amx", ((False, False), (True, False), (True, True)),
                         ids=("emulated-bf16", "avx512-bf16", "amx-bf16"))
def test_the_rules(native, amx, monkeypatch):
    monkeypatch.setattr(cpu_flags, "native_bf16", lambda: native)
    monkeypatch.setattr(cpu_flags, "amx_bf16", lambda: amx)
    rows = choice.DEQUANT_MIN_ROWS
    for m in (1, 8, 16, rows["cpu_q8"] - 1, rows["cpu_q8"], 2048):
        assert isinstance(choice.choose(m, 576, 1536, torch.float32, "cpu_q8"), choice.Q8Dot)
        bf16 = choice.choose(m, 576, 1536, torch.bfloat16, "cpu_q8")
        assert isinstance(bf16, choice.Q8Dequantized if amx and m >= rows["cpu_q8"] else choice.Q8Dot)
    for layout, fused, dequantized in (("cpu_int4", choice.AtenInt4Fused, choice.AtenInt4Dequantized),
                                       ("cpu_int8", choice.AtenInt8Fused, choice.AtenInt8Dequantized)):
        assert type(choice.choose(rows[layout] - 1, 256, 64, torch.bfloat16, layout)) is fused
        assert type(choice.choose(rows[layout], 256, 64, torch.bfloat16, layout)) is dequantized


def test_each_refusal_says_why(monkeypatch):
    monkeypatch.setattr(cpu_flags, "amx_bf16", lambda: False)
    path = choice.Q8Dequantized()
    assert "not bf16" in path.can_run(64, 256, 64, torch.float32, "cpu_q8")
    assert "no AMX bf16 tiles" in path.can_run(64, 256, 64, torch.bfloat16, "cpu_q8")
    assert "cpu_q8 layout, not cpu_int4" in path.can_run(64, 256, 64, torch.bfloat16, "cpu_int4")
    assert "rows <" in choice.AtenInt8Dequantized().can_run(4, 256, 64, torch.bfloat16, "cpu_int8")
    with pytest.raises(ValueError, match="no CPU kernel path reads the 'triton' layout"):
        choice.choose(1, 256, 64, torch.float32, "triton")


def test_every_path_has_a_name_and_a_layout():
    names = [p.name for p in choice.PATHS]
    assert len(set(names)) == len(names) and all(names)
    assert {p.layout for p in choice.PATHS} == {"cpu_q8", "cpu_int4", "cpu_int8"}
