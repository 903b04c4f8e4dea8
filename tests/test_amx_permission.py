"""quantkit/engines/amx_permission.py: the AMX tile-data permission is asked for only on Linux x86-64 CPUs
with AMX tiles, and every outcome says why (the system call faked for the branches this CPU cannot reach)."""

from __future__ import annotations

import errno
import platform

import pytest
import torch

from quantkit.engines import amx_permission
from quantkit.engines.amx_permission import (
    ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA,
    cpu_has_amx_tiles,
    holds_amx_tile_permission,
    request_amx_tile_permission,
)

LINUX_X86_64 = platform.system() == "Linux" and platform.machine() == "x86_64"
AMX_CPU = cpu_has_amx_tiles()


class FakeArchPrctl:
    """arch_prctl that records its calls and answers (result, errno)."""

    def __init__(self, result: int, code: int = 0):
        self.answer, self.calls = (result, code), []

    def __call__(self, code: int, arg: int) -> tuple[int, int]:
        self.calls.append((code, arg))
        return self.answer


@pytest.fixture
def linux_x86_64(monkeypatch):
    monkeypatch.setattr(amx_permission.platform, "system", lambda: "Linux")
    monkeypatch.setattr(amx_permission.platform, "machine", lambda: "x86_64")


def test_a_cpu_without_amx_is_not_asked_about(linux_x86_64):
    call = FakeArchPrctl(0)
    outcome = request_amx_tile_permission(amx=False, arch_prctl=call)
    assert call.calls == [] and not outcome.asked and not outcome.granted
    assert "this CPU has no AMX tiles" in outcome.reason


def test_by_default_the_cpu_is_told_apart_by_torchs_probe(linux_x86_64, monkeypatch):
    """vLLM takes its AMX kernels where torch.cpu._is_amx_tile_supported() says so: the same probe."""
    for has_amx in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: has_amx)
        call = FakeArchPrctl(0)
        assert request_amx_tile_permission(arch_prctl=call).asked == has_amx and len(call.calls) == has_amx


def test_other_systems_are_not_asked_about(monkeypatch):
    monkeypatch.setattr(amx_permission.platform, "system", lambda: "Darwin")
    call = FakeArchPrctl(0)
    outcome = request_amx_tile_permission(amx=True, arch_prctl=call)
    assert call.calls == [] and not outcome.asked and "Linux x86-64" in outcome.reason
    assert not holds_amx_tile_permission(arch_prctl=call)


def test_an_amx_cpu_asks_for_the_tile_data_component(linux_x86_64):
    call = FakeArchPrctl(0)
    outcome = request_amx_tile_permission(amx=True, arch_prctl=call)
    assert call.calls == [(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)] == [(0x1023, 18)]
    assert outcome.asked and outcome.granted and outcome.reason.startswith("granted")


@pytest.mark.parametrize("code, why", [
    (errno.ENOSPC, "sigaltstack"), (errno.EINVAL, "Linux < 5.16"), (errno.EOPNOTSUPP, "offers no AMX tile data"),
    (errno.EIO, "Input/output error"),
])
def test_a_refusal_says_why(linux_x86_64, code, why):
    outcome = request_amx_tile_permission(amx=True, arch_prctl=FakeArchPrctl(-1, code))
    assert outcome.asked and not outcome.granted
    assert outcome.reason.startswith("refused") and errno.errorcode[code] in outcome.reason and why in outcome.reason


@pytest.mark.skipif(not LINUX_X86_64, reason="arch_prctl is a Linux x86-64 system call")
def test_the_real_system_call_grants_exactly_where_the_cpu_has_amx():
    """The system call itself, told the CPU has AMX: Linux grants the permission on an AMX CPU (and then
    reports it held) and refuses it on any other, where the process is left as it was."""
    outcome = request_amx_tile_permission(amx=True)
    assert outcome.asked and outcome.granted == AMX_CPU, outcome
    assert holds_amx_tile_permission() == AMX_CPU
    if not AMX_CPU:
        assert outcome.reason.startswith("refused"), outcome


@pytest.mark.skipif(not LINUX_X86_64 or AMX_CPU, reason="on an AMX CPU the permission is asked for")
def test_on_this_cpu_without_amx_the_request_does_nothing_and_says_why():
    outcome = request_amx_tile_permission()
    assert not outcome.asked and not outcome.granted and "no AMX" in outcome.reason
    assert not holds_amx_tile_permission()
