"""Tensor parallel in vLLM's CPU build: ``vllm.LLM(..., tensor_parallel_size=2)`` over a quantkit W4 checkpoint.

A W4 g128 RTN checkpoint of ``ref:small`` (8 query / 4 KV heads, hidden 256, MLP 768: all split in two)
runs in vLLM with one worker and with two (gloo between the worker processes). Checked:

- in BOTH workers every quantized linear (q/k/v fused, o, gate/up fused, down; 16 layers) runs on
  quantkit's kernel: each worker reports, from inside its own process, the kernel class of every layer,
  its rank's in/out features (column-parallel layers hold half the outputs, row-parallel ones half the
  inputs, against the one-worker engine) and how often the kernel ran during generation (> 0), and
  vLLM logs "Using QuantkitWNA16LinearKernel" for each rank;
- the two-worker engine generates the same greedy tokens as the one-worker engine and as quantkit's own
  ``generate`` (bf16: a continuation may part only at a near-tie, as in tests/test_vllm_engine.py), and
  its teacher-forced log-probs lie within bf16 tolerance of both.

Each engine runs in its own process (tests/vllm_tp_engine.py) under a time limit, so a hung gloo group
fails this test with the engine's log instead of stalling the stage. CPU binding for two ranks on a
machine with one NUMA node: one half of this process's CPUs per rank (VLLM_CPU_OMP_THREADS_BIND="A|B"),
unless VLLM_CPU_OMP_THREADS_BIND or VLLM_CPU_SIM_MULTI_NUMA is already set. MoE checkpoints cannot run
in vLLM's CPU build without AMX at all (tests/test_vllm_moe.py): the last test checks that a W4 MoE
checkpoint under tensor_parallel_size=2 stops, in both workers, at vLLM's missing WNA16 MoE backend.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_vllm_engine import (  # noqa: E402  (imports vLLM, or skips where it is missing)
    KERNEL,
    MIN_LOGPROB_TOLERANCE,
    PROMPTS,
    compare,
    make_checkpoints,
    prompt_ids,
    quantkit_side,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
CHECKPOINT = "w4a16-rtn"
ENGINE_TIMEOUT_S = 600  # one engine start + 8 short requests take ~10-30 s on 2 cores
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")  # split along K; the others along N


def cpu_binding(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``ranks`` workers: this process's CPUs cut into that many runs
    ("0|1" on 2 CPUs), every rank at least one CPU (the last one shared where there are fewer)."""
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cpus) // ranks)
    runs = [cpus[min(r * per_rank, len(cpus) - 1):][:per_rank] for r in range(ranks)]
    return "|".join(",".join(map(str, run)) for run in runs)


def start_engine(folder: Path, tp: int, job: Path, out: Path) -> tuple[int, str, str]:
    """tests/vllm_tp_engine.py in a fresh process: (exit status, its log, what the log calls it); a run
    past ENGINE_TIMEOUT_S fails the test with the log's tail."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")  # the engine core in that process
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env and "VLLM_CPU_SIM_MULTI_NUMA" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tp)
    what = (f"vllm.LLM(tensor_parallel_size={tp}) on {folder.name} "
            f"(VLLM_CPU_OMP_THREADS_BIND={env.get('VLLM_CPU_OMP_THREADS_BIND')!r})")
    log = out.with_suffix(".log")
    command = [sys.executable, "-m", "tests.vllm_tp_engine", str(folder), str(tp), str(job), str(out)]
    with open(log, "w") as f:
        try:
            rc = subprocess.run(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=ENGINE_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            pytest.fail(f"{what} did not finish in {ENGINE_TIMEOUT_S} s; log tail:\n{log.read_text()[-4000:]}")
    return rc, log.read_text(), what


def run_engine(folder: Path, tp: int, job: Path, out: Path) -> dict:
    """tests/vllm_tp_engine.py in a fresh process; its result, or a failure with its log's tail."""
    rc, text, what = start_engine(folder, tp, job, out)
    if rc != 0 or not out.exists():
        pytest.fail(f"{what} failed (exit {rc}); log tail:\n{text[-4000:]}")
    result = json.loads(out.read_text())
    result["log"] = text
    return result


def with_logprob_objects(result: dict) -> dict:
    """The engine's JSON log-probs as vLLM's own {token id: Logprob} per position, for ``compare``."""
    from vllm.logprobs import Logprob

    forced = [[None if entries is None else {t: Logprob(logprob=lp, rank=rank) for t, lp, rank in entries}
               for entries in sequence] for sequence in result["prompt_logprobs"]]
    return {**result, "prompt_logprobs": forced}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """quantkit's generate, then vllm.LLM with one worker and with two, on the same checkpoint."""
    root = tmp_path_factory.mktemp("vllm-tp")
    folder = make_checkpoints(root, [CHECKPOINT])[CHECKPOINT]
    prompts = prompt_ids(folder)
    ours = quantkit_side(folder, prompts)
    job = root / "job.json"
    job.write_text(json.dumps({"prompts": prompts,
                               "sequences": [ids + cont for ids, cont in zip(prompts, ours["greedy"])]}))
    engines = {tp: with_logprob_objects(run_engine(folder, tp, job, root / f"tp{tp}.json")) for tp in (1, 2)}
    for tp, run in engines.items():
        run.update(compare(ours, run, prompts))
        print(f"tp={tp}: top-1 {run['top1_agreement']:.3f}, max |d logprob| {run['max_abs_logprob_delta']:.4f}, "
              f"margins where they part {run['parting_margins']}, greedy {run['greedy']}")
    return {"prompts": prompts, "quantkit": ours, **engines}


def test_both_workers_run_every_linear_on_quantkits_kernel(runs):
    one, two = runs[1], runs[2]
    assert [(w["rank"], w["world_size"]) for w in one["workers"]] == [(0, 1)]
    assert [(w["rank"], w["world_size"]) for w in two["workers"]] == [(0, 2), (1, 2)]
    pids = {w["pid"] for w in two["workers"]}
    assert len(pids) == 2 and two["engine_pid"] not in pids, "two worker processes besides the engine's"
    layers = 4 * len(PROJECTIONS)  # ref:small has 4 decoder layers
    assert one["instrumented"] == [layers] and two["instrumented"] == [layers, layers]
    whole = one["workers"][0]["layers"]
    expected = {f"model.layers.{i}.{p}" for i in range(layers // len(PROJECTIONS)) for p in PROJECTIONS}
    for worker in (*one["workers"], *two["workers"]):
        quantized = {name: layer for name, layer in worker["layers"].items() if layer["scheme"] is not None}
        assert set(quantized) == expected, f"rank {worker['rank']}: {sorted(quantized)}"
        for name, layer in quantized.items():
            where = f"rank {worker['rank']}/{worker['world_size']} {name}"
            assert layer["kernel"] == KERNEL, f"{where}: {layer['kernel']} (not quantkit's kernel)"
            assert layer["calls"] > 0, f"{where}: quantkit's kernel never ran"
            split = worker["world_size"]
            k, n = whole[name]["in_features"], whole[name]["out_features"]
            want = (k // split, n) if name.endswith(ROW_PARALLEL) else (k, n // split)
            assert (layer["in_features"], layer["out_features"]) == want, where
    for rank in (0, 1):
        assert re.search(rf"\(Worker_TP{rank} pid=\d+\).*Using {KERNEL} for CompressedTensorsWNA16", two["log"]), \
            f"vLLM logged no {KERNEL} for rank {rank}"


# tests/test_vllm_engine.py's bf16 log-prob tolerance at its floor (this test runs no unquantized control)
TOLERANCE = MIN_LOGPROB_TOLERANCE


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_tokens_equal_quantkits(runs, tp):
    """As tests/test_vllm_engine.py: at most half of the continuations part, each only at a near-tie
    of quantkit's own distribution; teacher-forced top-1 agreement >= 0.97, log-probs within tolerance."""
    run = runs[tp]
    margins = run["parting_margins"]
    assert len(margins) <= len(PROMPTS) // 2, f"tp={tp}: {len(margins)} of {len(PROMPTS)} continuations part"
    assert all(abs(m) <= TOLERANCE for m in margins), margins
    assert run["top1_agreement"] >= 0.97
    assert run["max_abs_logprob_delta"] <= TOLERANCE


def test_two_workers_generate_what_one_worker_generates(runs):
    """The same greedy tokens (a continuation may part only where both engines part from quantkit's at a
    near-tie, checked above), and on quantkit's sequences the same top-1 token and log-probs within
    tolerance at every position: the two ranks' partial sums (o_proj, down_proj, gloo all-reduce) add
    up to what one worker computes."""
    one, two = runs[1], runs[2]
    equal = sum(a == b for a, b in zip(one["greedy"], two["greedy"]))
    assert equal >= len(PROMPTS) - len(PROMPTS) // 2, f"{equal} of {len(PROMPTS)} continuations equal"
    worst, agree, total = 0.0, 0, 0
    for ids, cont, first, second in zip(runs["prompts"], runs["quantkit"]["greedy"], one["prompt_logprobs"],
                                        two["prompt_logprobs"]):
        seq = ids + cont
        for i in range(1, len(seq)):
            top = [next(t for t, lp in entries.items() if lp.rank == 1) for entries in (first[i], second[i])]
            agree += int(top[0] == top[1])
            total += 1
            worst = max(worst, abs(first[i][seq[i]].logprob - second[i][seq[i]].logprob))
    assert agree / total >= 0.97, f"top-1 agreement {agree}/{total}"
    assert worst <= TOLERANCE, f"max |log p(tp=2) - log p(tp=1)| = {worst:.4f}"


def test_moe_checkpoints_stop_in_every_worker_without_a_wna16_moe_backend(tmp_path):
    """vLLM's CPU build has a WNA16 MoE method only with AMX or zentorch (tests/test_vllm_moe.py), and
    quantkit's plugin supplies linear kernels only: under tensor parallel, too, the workers stop where
    vLLM picks the MoE backend (``select_wna16_moe_backend``, vllm/model_executor/layers/fused_moe/oracle/
    int_wna16.py). This holds docs/vllm.md's "dense models only" to the installed vLLM."""
    import shutil

    import torch

    import quantkit
    from quantkit.refmodels.registry import reference_model_path
    from fixtures.moe_fixtures import make_moe_model

    if torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has AMX: vLLM's CPU build may run WNA16 MoE here, which this test does not cover")
    model = make_moe_model("qwen3_moe", vocab_size=4096)  # ref:tiny's tokenizer, for the engine's start
    quantkit.quantize(model, "w4a16-rtn", progress=False)
    folder = quantkit.save(model, tmp_path / "qwen3-moe-w4", dtype=torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(reference_model_path("tiny") / name, folder / name)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"prompts": [[1, 2, 3]], "sequences": [[1, 2, 3, 4]],
                               "engine": {"max_model_len": 128}}))  # the random model's context: 256
    rc, log, what = start_engine(folder, 2, job, tmp_path / "moe.json")
    assert rc != 0, f"{what} started: vLLM's CPU build now runs WNA16 MoE; test it and update docs/vllm.md"
    # vLLM stops every worker once one has failed: a slower rank may be killed before it reaches the MoE
    # layer (then it logs no error at all); a rank that logs an error must log this one
    stopped = {rank for rank in (0, 1) if re.search(
        rf"\(Worker_TP{rank} pid=\d+\).*NotImplementedError: No WNA16 MoE backend supports the deployment "
        rf"configuration", log)}
    assert stopped, f"{what}: another failure:\n{log[-4000:]}"
    for rank in {0, 1} - stopped:
        assert not re.search(rf"\(Worker_TP{rank} pid=\d+\) ERROR", log), \
            f"{what}, rank {rank}: another failure:\n{log[-4000:]}"
