"""Data-parallel calibration over torch.distributed (gloo on CPUs, nccl on GPUs), as llm-compressor's DDP GPTQ.

Every rank loads the model (memory-mapped: the ranks of one machine share the page cache), takes its
share of the calibration windows and walks the blocks in step with the others:

- statistics: each rank accumulates its Hessians over its own windows; the fp64 sums are added across
  ranks (all_reduce), so every rank holds the Hessian of all the windows, the same fp32 matrix as one
  process's (algorithms.gptq.HessianSum: each window's XᵀX in fp32, summed in fp64);
- the column walk: GPTQ's rows are independent once the Hessian is factored, so each rank walks a
  contiguous share of a linear's output rows and the quantized rows are gathered (all_gather): every
  rank ends with the same quantized model;
- the block outputs that feed the next block stay on the rank that computed them.

`quantkit quantize` runs this way under torchrun (`torchrun --nproc-per-node 2 -m quantkit quantize ...`);
rank 0 writes the output. Calibration without an all-reduce rule for its statistics (AWQ's scale search,
the KV-cache observers) is refused under more than one process rather than run on a share of the data.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..algorithms.gptq import HessianSum
from ..core.errors import QuantizationError


def world() -> tuple[int, int]:
    """(rank, number of processes) of the default process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def launched_by_torchrun() -> bool:
    """True in a process torchrun (or another launcher setting WORLD_SIZE > 1, RANK and MASTER_ADDR) started."""
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return size > 1 and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def init_from_environment() -> tuple[int, int]:
    """Join the process group torchrun describes in the environment (gloo; nccl when CUDA is there), once;
    returns (rank, number of processes)."""
    if launched_by_torchrun() and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return world()


def share(batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's calibration windows: every size-th window from the rank-th, batched as given (each
    batch [B, T] int64). One process: `batches` themselves."""
    rank, size = world()
    if size == 1:
        return batches
    lengths = {b.shape[1] for b in batches}
    if len(lengths) != 1:
        raise QuantizationError("data-parallel calibration needs windows of one length; pass a CalibrationConfig "
                                "or token tensors of equal length")
    windows = torch.cat(batches)
    if windows.shape[0] < size:
        raise QuantizationError(f"{windows.shape[0]} calibration windows for {size} processes: each process needs "
                                f"one at least; use more samples (--calib-samples) or fewer processes")
    return list(windows[rank::size].split(batches[0].shape[0]))


def add_hessians(acc: HessianSum) -> HessianSum:
    """This rank's HessianSum -> the sum over every rank's windows (in place; returned): the fp64 sums and
    the row counts are added, so the Hessian is one process's up to the order of exact-or-nearly additions."""
    if world()[1] == 1:
        return acc
    total = torch.tensor([acc.count], dtype=torch.float64)
    dist.all_reduce(total)
    acc.count = int(total)
    if acc.panels is not None and acc.count:
        for panel in acc.panels:
            dist.all_reduce(panel)
    return acc


def row_share(rows: int) -> tuple[int, int]:
    """[start, stop) of the output rows this rank walks, of `rows` in all."""
    rank, size = world()
    per = -(-rows // size)
    return min(rows, rank * per), min(rows, (rank + 1) * per)


def gather_rows(part: torch.Tensor, rows: int) -> torch.Tensor:
    """Every rank's [stop - start, ...] share (row_share) -> the whole [rows, ...] tensor, on every rank."""
    size = world()[1]
    if size == 1:
        return part
    per = -(-rows // size)
    padded = torch.zeros((per, *part.shape[1:]), dtype=part.dtype)
    padded[: part.shape[0]] = part
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded.contiguous())
    return torch.cat(pieces)[:rows]


def refuse_unsupported(what: str) -> None:
    """QuantizationError when calibration of `what` would run on a share of the data."""
    if world()[1] > 1:
        raise QuantizationError(f"{what} has no data-parallel form in quantkit: its statistics would come from one "
                                f"process's share of the calibration data; run it in one process (without torchrun)")
