"""Whether other work shared the CPU while the bench timed it: the CPU time other processes used during the
timing (Linux's /proc/stat, less this process's own /proc/self/stat), in CPUs on average.

CPU timings of multi-threaded steps depend on free cores: a step whose threads wait at OpenMP barriers
for a thread another process holds its core from runs many times slower (a two-thread W4 decode step of
SmolLM2 on 2 cores: 18.8 ms idle, 0.8 s beside a one-thread job at nice 19). The bench records what other
processes used while it timed, and its summary and report say so when they took cores its threads needed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's ticks a second (USER_HZ)


@dataclass(frozen=True)
class CpuSnapshot:
    """wall: time.monotonic(); busy: CPU ticks every CPU spent not idle; own: this process's ticks (all threads)."""

    wall: float
    busy: int
    own: int


def cpu_snapshot(stat: str = "/proc/stat", self_stat: str = "/proc/self/stat") -> CpuSnapshot | None:
    """The machine's and this process's CPU ticks now; None where the OS has no /proc (not Linux)."""
    try:
        with open(stat) as f:
            fields = [int(x) for x in f.readline().split()[1:]]  # user nice system idle iowait irq softirq steal ...
        with open(self_stat) as f:
            own = f.read().rsplit(")", 1)[1].split()  # after the command name: state is field 3, utime 14, stime 15
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return CpuSnapshot(time.monotonic(), sum(fields[:8]) - idle, int(own[11]) + int(own[12]))


def machine_load(start: CpuSnapshot | None, end: CpuSnapshot | None, threads: int, cpus: int | None) -> dict:
    """The record of a timing run: ``other_cpus``, the CPUs other processes used on average between the two
    snapshots (None without them), the threads timed and the CPUs, and ``busy``: other work took more than
    the CPUs the timed threads left free (with a quarter CPU of slack), so the run's times are not the machine's."""
    cpus = cpus or 1
    other = None
    if start is not None and end is not None and end.wall > start.wall:
        other = max(0.0, ((end.busy - start.busy) - (end.own - start.own)) / CLOCK_TICKS / (end.wall - start.wall))
    busy = other is not None and other > max(0, cpus - threads) + 0.25
    return {"other_cpus": other, "threads": threads, "cpus": cpus, "busy": busy}


def busy_caution(load: dict | None) -> str | None:
    """One sentence for the summary and the report when the run's record says the machine was busy, else None."""
    if not load or not load.get("busy"):
        return None
    return (f"Caution: other processes used {load['other_cpus']:.2f} of the {load['cpus']} CPU(s) on average while "
            f"{load['threads']} thread(s) were timed: they held cores the timed threads needed, so these times "
            "(quantized and float alike, and their ratios) can be several times off; run again on an idle machine.")
