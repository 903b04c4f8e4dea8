"""Data-parallel GPTQ: two gloo processes under torchrun give the checkpoint one process gives, up to the
order of the Hessian additions; what has no data-parallel form is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from pathlib import Path

import quantkit
from quantkit.algorithms.gptq import HessianSum
from quantkit.calibration import distributed

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _quantize(out, processes: int, recipe: str = "w4a16-gptq") -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                "--standalone"] if processes > 1 else [sys.executable]
    return subprocess.run([*launcher, "-m", "quantkit", "quantize", "ref:tiny", "--recipe", recipe, "--out", str(out),
                           "--calib-samples", "16", "--calib-seq-len", "128"],
                          capture_output=True, text=True, env=ENV, timeout=600)


def test_two_gloo_processes_give_one_process_checkpoint(tmp_path):
    from safetensors.torch import load_file

    for processes in (1, 2):
        done = _quantize(tmp_path / f"p{processes}", processes)
        assert done.returncode == 0, done.stderr[-3000:]
    one = load_file(str(tmp_path / "p1" / "model.safetensors"))
    two = load_file(str(tmp_path / "p2" / "model.safetensors"))
    assert one.keys() == two.keys()
    differing = [k for k in one if not torch.equal(one[k], two[k])]
    assert not differing, f"{len(differing)} of {len(one)} tensors differ: {differing[:3]}"  # fp64 Hessian sums
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p1", "p2"]


def test_awq_is_refused_under_torchrun(tmp_path):
    done = _quantize(tmp_path / "awq", 2, recipe="w4a16-awq")
    assert done.returncode != 0
    # each process says it in one line and exits 2 (the two processes' lines may interleave on the shared
    # pipe); torchrun then reports the failed children its own way
    message = "quantkit quantize: error: recipe w4a16-awq uses awq: only GPTQ and RTN recipes quantize data-parallel"
    assert done.stderr.count(message) == 2, done.stderr[-2000:]
    assert 'File "' + str(Path(quantkit.__file__).parent) not in done.stderr  # no traceback from quantkit
    assert not (tmp_path / "awq").exists()


def test_one_process_shares_nothing_and_adds_nothing():
    batches = [torch.arange(12).reshape(3, 4)]
    assert distributed.share(batches) is batches
    acc = HessianSum().add(torch.randn(2, 3, 4))
    before = [panel.clone() for panel in acc.panels]
    assert distributed.add_hessians(acc) is acc and acc.count == 6
    assert all(torch.equal(a, b) for a, b in zip(acc.panels, before))
    assert distributed.row_share(7) == (0, 7)
    assert distributed.refuse_unsupported("anything") is None


def _rank_checks(rank: int, size: int, port: int, out) -> None:
    import torch.distributed as dist

    from quantkit.algorithms.gptq import HessianSum

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        windows = torch.arange(7 * 5).reshape(7, 5)
        mine = distributed.share(list(windows.split(2)))
        assert torch.equal(torch.cat(mine), windows[rank::size])
        x = torch.randn(9, 5, 600, generator=torch.Generator().manual_seed(3))  # 9 windows of 5 tokens
        mine = x[:4] if rank == 0 else x[4:]  # unequal shares
        acc = distributed.add_hessians(HessianSum().add(mine))
        whole = HessianSum().add(x)
        assert acc.count == whole.count == 45 and torch.equal(acc.hessian(), whole.hessian())  # bit for bit
        start, stop = distributed.row_share(11)
        part = torch.arange(11 * 3).reshape(11, 3)[start:stop]
        assert torch.equal(distributed.gather_rows(part, 11), torch.arange(11 * 3).reshape(11, 3))
        out.put((rank, None))
    except Exception as e:  # reported to the test process
        out.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


def test_shares_sums_and_gathers_across_two_gloo_processes():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_checks, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    assert results == {0: None, 1: None}, results
