"""Closing a vllm.LLM engine built in the test process, at once and in the test that built it.

An in-process engine tears down vLLM's distributed groups (process-wide state) when it is shut down, and
otherwise does so from a finalizer when the garbage collector reaches it. Left to the collector, an engine
of one test can be collected while a later test's engine runs and take that engine's groups with it
("pipeline model parallel group is not initialized" in the middle of `generate`)."""

from __future__ import annotations

import gc


def shut_down(llm) -> None:
    """Shut `llm` (a vllm.LLM) down now: its engine core, its executor and the distributed groups it made."""
    llm.llm_engine.engine_core.shutdown()
    gc.collect()
