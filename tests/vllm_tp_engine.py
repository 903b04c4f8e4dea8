"""One ``vllm.LLM`` with ``tensor_parallel_size=TP`` over a checkpoint, in its own process (tests/test_vllm_tp.py).

    python -m tests.vllm_tp_engine FOLDER TP JOB.json OUT.json

JOB.json: {"prompts": [[token id, ...], ...], "sequences": [[...], ...]} (quantkit's greedy sequences, for
the teacher-forced log-probs), and optionally "engine": {LLM keyword: value} over
tests/test_vllm_engine.ENGINE. OUT.json: the engine's outputs (tests/test_vllm_engine.engine_outputs, the
log-probs as [[token id, logprob, rank], ...] per position) and, from every tensor-parallel worker, its
rank, world size, process id and each linear layer's kernel, this rank's in/out features and how many
times the kernel ran during generation (counted in the worker itself).

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the caller); with TP > 1
vLLM's multiprocessing executor starts one worker process per rank (spawned: hence the ``__main__``
guard) and joins them with gloo; ``LLM.apply_model`` sends the probes below to each of them.
"""

from __future__ import annotations

import gc
import json
import os
import sys


def count_kernel_calls(model) -> int:
    """In each worker: make every quantized linear's kernel count its ``apply_weights`` calls; the number of
    kernels so instrumented."""
    count = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "scheme", None), "kernel", None)
        if kernel is None or hasattr(kernel, "calls"):
            continue
        original = kernel.apply_weights

        def counted(layer, x, bias=None, _kernel=kernel, _original=original):
            _kernel.calls += 1
            return _original(layer, x, bias)

        kernel.calls = 0
        kernel.apply_weights = counted
        count += 1
    return count


def worker_report(model) -> dict:
    """In each worker: its tensor-parallel rank and world size, its process id, and every linear layer of
    the model: {name: {"method", "kernel", "in_features", "out_features", "calls"}} (kernel None where the
    layer's method has none, e.g. the unquantized lm_head)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.linear import LinearBase

    layers = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        scheme = getattr(module, "scheme", None)
        kernel = getattr(scheme, "kernel", None)
        layers[name] = {
            "method": type(module.quant_method).__name__,
            "scheme": None if scheme is None else type(scheme).__name__,
            "kernel": None if kernel is None else type(kernel).__name__,
            "in_features": getattr(kernel, "in_features", None),
            "out_features": getattr(kernel, "out_features", None),
            "calls": getattr(kernel, "calls", None),
        }
    return {"rank": get_tensor_model_parallel_rank(), "world_size": get_tensor_model_parallel_world_size(),
            "pid": os.getpid(), "layers": layers}


def _logprobs_json(prompt_logprobs) -> list:
    return [None if entries is None else [[int(t), lp.logprob, lp.rank] for t, lp in entries.items()]
            for entries in (prompt_logprobs[i] for i in range(len(prompt_logprobs)))]


def main(argv: list[str]) -> int:
    folder, tp, job_path, out_path = argv[0], int(argv[1]), argv[2], argv[3]
    from vllm import LLM

    from tests.test_vllm_engine import ENGINE, engine_outputs

    with open(job_path) as f:
        job = json.load(f)
    llm = LLM(model=folder, **{**ENGINE, **job.get("engine", {})}, tensor_parallel_size=tp)
    try:
        instrumented = llm.apply_model(count_kernel_calls)
        outputs = engine_outputs(llm, job["prompts"], job["sequences"])
        workers = llm.apply_model(worker_report)
    finally:
        del llm
        gc.collect()
    result = {
        "greedy": outputs["greedy"],
        "text": outputs["text"],
        "prompt_logprobs": [_logprobs_json(p) for p in outputs["prompt_logprobs"]],
        "instrumented": instrumented,
        "workers": workers,
        "engine_pid": os.getpid(),
    }
    with open(out_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
