"""Every Triton WNA16 kernel configuration the heuristics can pick compiles for Hopper (sm_90), no GPU needed.

The real Triton compiler runs in a child process (the kernels in this process are decorated for the
interpreter) down to a cubin with Triton's bundled ptxas; shared memory must fit an sm_90 block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import quantkit.kernels as qk
from quantkit.kernels.compile_check import _jobs
from quantkit.kernels.wna16_heuristics import all_configs


def test_every_heuristic_config_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "quantkit.kernels.compile_check", "--arch", "90", "--workers", "2"],
        capture_output=True, text=True, env=env, timeout=900,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results = [r for r in lines if not r.get("summary")]
    failed = [r for r in results if not r["ok"]]
    assert proc.returncode == 0 and not failed, failed or proc.stderr[-3000:]
    assert len(results) == len(_jobs(90))
    assert all("cubin" in r["stages"] for r in results)
    compiled = {(r["bits"], json.dumps(r["config"], sort_keys=True)) for r in results if "config" in r}
    for bits in (4, 8):
        for cfg in all_configs(bits):
            assert (bits, json.dumps(cfg.as_dict(), sort_keys=True)) in compiled, (bits, cfg)
    assert {r["kind"] for r in results if r.get("bits") == 2} == {"gemv", "dot", "dequant"}


def test_heuristics_pick_from_the_compiled_set():
    """choose_config over many shapes only returns configurations all_configs lists (split-K 1 vs > 1)."""
    for bits in (2, 4, 8):
        listed = {(c.algo, c.block_m, c.block_n, c.split_k > 1, c.num_warps, c.num_stages) for c in all_configs(bits)}
        for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 65, 200, 256, 1000, 1024, 2047, 2048, 5000):
            for n, k in ((64, 128), (4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (28672, 8192),
                         (57344, 8192), (8192, 28672)):
                c = qk.choose_config(m, n, k, bits)
                key = (c.algo, c.block_m, c.block_n, c.split_k > 1, c.num_warps, c.num_stages)
                assert key in listed, (bits, m, n, k, c)


def test_decode_gemv_ptx_uses_128_bit_weight_loads():
    """The decode GEMV, compiled for sm_90 as the rules launch it, reads the packed weights with 16-byte
    ``ld.global.v4.b32`` loads (one per word row and group of 4 columns) and spends a bounded number of
    PTX instructions per weight; at M = 1 its K loop has no scalar load at all (activations and
    scales are vector loads too).

    Measured (triton 3.9 / 3.6): 4.7 / 4.8 instructions per int4 weight at M = 1, 6.8 / 8.6 at M = 2
    (3.6 loads the two activation rows with scalar loads), 5.1-5.5 for int8 or per-field scales at
    M = 1; the kernel this replaced needed 15 (M = 1) and 24 (M = 2), with 128 scalar activation
    loads per loop iteration. The bounds (6 at M = 1, 10 at M = 2) leave room for compiler drift
    while catching a return to per-element conversions or scalar loads.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-m", "quantkit.kernels.compile_check", "--ptx-facts"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {(f["bits"], f["config"]["block_m"]) for f in facts} == {(4, 1), (4, 2), (8, 1), (8, 2)}
    for f in facts:
        assert f["kind"] == "gemv", f
        assert f["ld_global_v4_b32"] >= f["weight_words_per_thread"] // 4, f  # every word row: one 16-byte load
        if f["config"]["block_m"] == 1:
            assert f["ld_global_narrow"] == 0, f
        bound = 6.0 if f["config"]["block_m"] == 1 else 10.0
        assert f["instructions_per_weight"] <= bound, f
