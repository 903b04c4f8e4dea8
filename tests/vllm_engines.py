"""In-process vllm.LLM engines in tests: closing one at once, in the test that built it, and checking the
process may run vLLM's AMX kernels before they run.

An in-process engine tears down vLLM's distributed groups (process-wide state) when it is shut down, and
otherwise does so from a finalizer when the garbage collector reaches it. Left to the collector, an engine
of one test can be collected while a later test's engine runs and take that engine's groups with it
("pipeline model parallel group is not initialized" in the middle of `generate`).

vLLM's AMX attention kernel (bf16 models on AMX CPUs) runs tile instructions without asking Linux for the
tile-data permission; quantkit's plugin asks when vLLM loads it (quantkit/engines/amx_permission.py).
Without the permission the kernel kills the whole test process with SIGILL; with this check the test
fails first, with the reason."""

from __future__ import annotations

import gc

from quantkit.engines.amx_permission import cpu_has_amx_tiles, holds_amx_tile_permission, request_amx_tile_permission


def shut_down(llm) -> None:
    """Shut `llm` (a vllm.LLM) down now: its engine core, its executor and the distributed groups it made."""
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def check_amx_tile_permission() -> None:
    """On a CPU with AMX, assert that this process holds the tile-data permission (call it once an engine
    is built, before it generates); elsewhere nothing to check."""
    if cpu_has_amx_tiles():
        assert holds_amx_tile_permission(), (
            "this AMX CPU's process lacks the tile-data permission, so vLLM's AMX attention would die with "
            f"SIGILL; asking again: {request_amx_tile_permission().reason}")
