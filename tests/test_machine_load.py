"""The bench's record of other work on the CPU (quantkit/harness/machine_load.py): the CPUs other processes used
between two snapshots, the busy rule, and the caution the summary and the report print when other work took
cores the timing needed."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quantkit.harness.machine_load import CLOCK_TICKS as TICKS
from quantkit.harness.machine_load import CpuSnapshot, busy_caution, cpu_snapshot, machine_load
from quantkit.harness.report import render_report, summary_lines

BENCH = Path(__file__).resolve().parent.parent / "evals" / "reports" / "cpu" / "bench.json"


def record(other_cpus: float, threads: int, cpus: int) -> dict:
    """machine_load of two snapshots 10 s apart in which other processes used `other_cpus` CPUs."""
    start = CpuSnapshot(0.0, 0, 0)
    end = CpuSnapshot(10.0, round((other_cpus + threads) * 10 * TICKS), threads * 10 * TICKS)
    return machine_load(start, end, threads, cpus)


@pytest.mark.parametrize("other,threads,cpus,busy", [
    (0.1, 2, 2, False), (0.9, 2, 2, True), (1.1, 1, 2, False), (1.4, 1, 2, True), (3.0, 2, 16, False),
    (14.5, 2, 16, True)])
def test_busy_when_other_work_takes_the_timed_threads_cores(other, threads, cpus, busy):
    load = record(other, threads, cpus)
    assert load["other_cpus"] == pytest.approx(other, abs=0.01)
    assert load["busy"] is busy


@given(st.floats(0, 64), st.integers(1, 64), st.integers(1, 64))
def test_the_rule_is_other_work_against_the_free_cores(other, threads, cpus):
    load = record(other, threads, cpus)
    assert load["busy"] == (load["other_cpus"] > max(0, cpus - threads) + 0.25)
    assert (busy_caution(load) is not None) == load["busy"]
    assert not machine_load(None, None, threads, cpus)["busy"]  # no /proc: nothing claimed


@pytest.mark.skipif(cpu_snapshot() is None, reason="no /proc/stat here")
def test_the_snapshots_count_other_processes_and_not_this_one():
    """This process's own second of work adds nothing to the other processes' CPUs, a child's second adds
    about one; each measured against the same machine's idle second, so other work on the machine (a
    benchmark beside the suite) does not decide the outcome."""

    def other_cpus(work) -> float:
        start = cpu_snapshot()
        work()
        return machine_load(start, cpu_snapshot(), 1, 2)["other_cpus"]

    def spin():
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            pass

    def child():
        subprocess.run([sys.executable, "-c", "import time\nt = time.monotonic() + 1.0\nwhile time.monotonic() < t: pass"],
                       check=True)

    idle = other_cpus(lambda: time.sleep(1.0))
    own, spawned = other_cpus(spin), other_cpus(child)
    assert own - idle < 0.5 < spawned - idle, (idle, own, spawned)


def test_the_summary_and_the_report_say_so_only_when_busy(tmp_path):
    base = json.loads(BENCH.read_text())
    for i, (load, said) in enumerate(((record(1.2, 2, 2), True), (record(0.1, 2, 2), False), (None, False))):
        bench = copy.deepcopy(base)
        if load is not None:
            bench["device"]["load"] = load
        summary = "\n".join(summary_lines(bench))
        report = render_report(bench, [], tmp_path / str(i), title="t").read_text()
        for text in (summary, report):
            assert ("other processes used 1.20 of the 2 CPU(s) on average while 2 thread(s) were timed" in text) is said
