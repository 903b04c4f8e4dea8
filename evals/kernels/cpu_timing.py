"""CPU timing helper shared by the kernel benchmarks: real-time priority for the timed part.

(The CPU's name: quantkit.harness.hardware.cpu_name.)
"""

import contextlib
import os


@contextlib.contextmanager
def realtime_priority(enabled: bool):
    """Run the block with every thread of this process under SCHED_FIFO (Linux, root), then restore.

    On a shared machine other processes preempt the worker threads of a 2-thread OpenMP kernel at every
    barrier, which turns each call into a scheduler time slice and every ratio into ~1.0x; a real-time
    class for the timed part (only) keeps the measurement about the kernels. The kernel leaves 5% of
    each CPU to other processes (sched_rt_runtime_us)."""
    if not enabled:
        yield
        return
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    for tid in tids:
        os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(10))
    try:
        yield
    finally:
        for tid in tids:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except ProcessLookupError:
                pass
