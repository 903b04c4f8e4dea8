"""The bench's record of the machine's load (quantkit/harness/machine_load.py): the busy rule, and the caution
the summary and the report print when other work shared the cores the timing needed."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quantkit.harness.machine_load import busy_caution, machine_load
from quantkit.harness.report import render_report, summary_lines

BENCH = Path(__file__).resolve().parent.parent / "evals" / "reports" / "cpu" / "bench.json"


@pytest.mark.parametrize("before,threads,cpus,busy", [
    (0.1, 2, 2, False), (0.9, 2, 2, True), (0.4, 1, 2, False), (1.2, 1, 2, False), (1.7, 1, 2, True),
    (3.0, 2, 16, False), (15.0, 2, 16, True), (None, 2, 2, False)])
def test_busy_when_other_work_leaves_too_few_cores(before, threads, cpus, busy):
    assert machine_load(before, 0.0, threads, cpus)["busy"] is busy


@given(st.floats(0, 64), st.integers(1, 64), st.integers(1, 64))
def test_the_rule_is_free_cores_against_threads(before, threads, cpus):
    busy = machine_load(before, None, threads, cpus)["busy"]
    assert busy == (before > max(0.5, cpus - threads + 0.5))
    assert (busy_caution(machine_load(before, None, threads, cpus)) is not None) == busy


def test_the_summary_and_the_report_say_so_only_when_busy(tmp_path):
    base = json.loads(BENCH.read_text())
    for load, said in ((machine_load(1.9, 2.0, 2, 2), True), (machine_load(0.1, 0.2, 2, 2), False), (None, False)):
        bench = copy.deepcopy(base)
        if load is not None:
            bench["device"]["load"] = load
        summary = "\n".join(summary_lines(bench))
        report = render_report(bench, [], tmp_path / str(len(str(load))), title="t").read_text()
        for text in (summary, report):
            assert ("the load average was 1.90 before the timing on 2 CPU(s) with 2 thread(s)" in text) is said
