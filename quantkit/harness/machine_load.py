"""Whether other work shared the CPU while it was timed: the load average before and after a timing run.

CPU timings of multi-threaded steps depend on free cores: a step whose threads wait at OpenMP barriers
for a thread another process holds its core from runs many times slower (a two-thread W4 decode step of
SmolLM2 on 2 cores: 18.8 ms idle, 0.8 s beside a one-thread job at nice 19). The bench records the load
average around its timing and says so in its summary and report when other work left fewer cores free
than its threads need.
"""

from __future__ import annotations

import os


def load_average() -> float | None:
    """The 1-minute load average (runnable and running processes), None where the OS does not give one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def machine_load(before: float | None, after: float | None, threads: int, cpus: int | None) -> dict:
    """The record of a timing run's load: load averages before / after, the threads timed and the CPUs, and
    ``busy``: other work before the run (its load average) left fewer free CPUs than the threads timed (with
    half a process of slack), so the run's times are not the machine's."""
    cpus = cpus or 1
    busy = before is not None and before > max(0.5, cpus - threads + 0.5)
    return {"before": before, "after": after, "threads": threads, "cpus": cpus, "busy": busy}


def busy_caution(load: dict | None) -> str | None:
    """One sentence for the summary and the report when the run's record says the machine was busy, else None."""
    if not load or not load.get("busy"):
        return None
    return (f"Caution: the load average was {load['before']:.2f} before the timing on {load['cpus']} CPU(s) "
            f"with {load['threads']} thread(s) timed: other work held cores the timed threads needed, so "
            "these times (quantized and float alike, and their ratios) can be several times off; run again on "
            "an idle machine.")
