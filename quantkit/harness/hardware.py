"""What a device can do: memory bandwidth and dense matmul peak, from a table of known GPUs or a probe.

The roofline (``quantkit.harness.roofline``) needs two numbers per device: the bandwidth at which a
kernel can stream bytes from memory, and the dense bf16/fp16 matmul rate. Datasheets quote peaks
that code does not reach: a plain copy reaches ~0.9x the datasheet bandwidth and a large bf16
matmul ~0.8x the datasheet tensor rate (an H200 copies at ~4.3 of 4.8 TB/s and multiplies at
~790 of 989 TFLOP/s). Table entries therefore carry both the datasheet figure and the derated one
the roofline uses; a probe measures the achievable figures directly.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ..core.errors import UsageError
from ..kernels.cpu_flags import cpuinfo_value

# Achievable fraction of a datasheet figure, applied to table entries (not to probes).
COPY_BANDWIDTH_EFFICIENCY = 0.9
MATMUL_EFFICIENCY = 0.8


@dataclass(frozen=True)
class DeviceSpec:
    """A device as the roofline sees it.

    memory_bandwidth: bytes/s the roofline divides bytes by (achievable, not datasheet).
    peak_flops: dense bf16/fp16 flop/s the roofline divides flops by (achievable).
    memory_bytes: memory capacity in bytes (GPU memory, or host RAM for a CPU).
    source: "datasheet (derated)" (a table entry: the datasheet's figures times the achievable
        fractions above) or "probe" (measured here); results written before this distinction say "datasheet".
    """

    name: str
    memory_bandwidth: float
    peak_flops: float
    memory_bytes: float
    source: str
    datasheet_bandwidth: float | None = None
    datasheet_flops: float | None = None
    notes: str = ""

    @property
    def ridge_intensity(self) -> float:
        """Arithmetic intensity (flop/byte) above which a kernel is compute-bound on this device."""
        return self.peak_flops / self.memory_bandwidth

    @property
    def roofline_problem(self) -> str | None:
        """Why this spec cannot give a roofline (None when it can).

        A dense matmul reuses every byte it reads, so it is never slower per flop than a
        matrix-vector product, which does 1 flop per byte of 2-byte weights: a measured peak below
        bandwidth x 1 flop/byte (a ridge under 1 flop/byte) means the probe timed an emulated or
        broken path (e.g. bf16 on a CPU without native bf16), not the device's compute rate.
        """
        if not (self.memory_bandwidth > 0 and self.peak_flops > 0):
            return (f"the probe measured a bandwidth of {self.memory_bandwidth / 1e9:.3g} GB/s and a matmul rate of "
                    f"{self.peak_flops / 1e9:.3g} GFLOP/s; both must be positive")
        if self.ridge_intensity < 1.0:
            return (f"the matmul probe ({self.notes or 'dense matmul'}) measured {self.peak_flops / 1e9:.3g} GFLOP/s, "
                    f"less than a matrix-vector product reaches at the measured {self.memory_bandwidth / 1e9:.3g} GB/s "
                    "(1 flop per byte): it timed an emulated or broken path, not the device's compute rate")
        return None

    def figures(self) -> str:
        """The bandwidth and matmul rate the roofline uses, and where each comes from, in words."""
        rates = f"bandwidth {_bytes_rate(self.memory_bandwidth)}, matmul {_flop_rate(self.peak_flops)}"
        datasheet = ""
        if self.datasheet_bandwidth and self.datasheet_flops:
            datasheet = (f"{self.memory_bandwidth / self.datasheet_bandwidth:.2f}x and "
                         f"{self.peak_flops / self.datasheet_flops:.2f}x the datasheet's "
                         f"{_bytes_rate(self.datasheet_bandwidth)} and {_flop_rate(self.datasheet_flops)}")
        if self.source == "probe":
            return f"{rates}, measured on this machine ({self.notes})" + (f"; {datasheet}" if datasheet else "")
        if datasheet:
            return (f"{rates}: derated, {datasheet} (what a copy and a large bf16 matmul reach in practice; "
                    "not measured here)")
        return f"{rates} ({self.source})"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ridge_intensity"] = self.ridge_intensity
        d["roofline_problem"] = self.roofline_problem
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceSpec":
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**fields)


def _bytes_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e12:.2f} TB/s" if bytes_per_s >= 1e12 else f"{bytes_per_s / 1e9:.1f} GB/s"


def _flop_rate(flops: float) -> str:
    return f"{flops / 1e12:.0f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"


def _datasheet(name: str, tb_s: float, tflops: float, gb: float, notes: str) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        memory_bandwidth=tb_s * 1e12 * COPY_BANDWIDTH_EFFICIENCY,
        peak_flops=tflops * 1e12 * MATMUL_EFFICIENCY,
        memory_bytes=gb * 1e9,
        source="datasheet (derated)",
        datasheet_bandwidth=tb_s * 1e12,
        datasheet_flops=tflops * 1e12,
        notes=notes,
    )


# Datasheet figures: HBM/GDDR bandwidth and dense (no sparsity) bf16 tensor-core rate with fp32
# accumulation, memory capacity in GB (1e9 bytes).
KNOWN_GPUS: dict[str, DeviceSpec] = {
    "h200": _datasheet("NVIDIA H200 SXM", 4.8, 989.0, 141, "HBM3e; measured copy ~4.3 TB/s, bf16 matmul ~790 TFLOP/s"),
    "h100-sxm": _datasheet("NVIDIA H100 SXM", 3.35, 989.0, 80, "HBM3"),
    "h100-pcie": _datasheet("NVIDIA H100 PCIe", 2.0, 756.0, 80, "HBM2e"),
    "a100": _datasheet("NVIDIA A100 SXM 80GB", 2.039, 312.0, 80, "HBM2e"),
    "a100-40gb": _datasheet("NVIDIA A100 40GB", 1.555, 312.0, 40, "HBM2"),
    "a10": _datasheet("NVIDIA A10", 0.6, 125.0, 24, "GDDR6"),
    "l4": _datasheet("NVIDIA L4", 0.3, 121.0, 24, "GDDR6; 242 TFLOP/s is the sparse figure"),
    "rtx4090": _datasheet("NVIDIA GeForce RTX 4090", 1.008, 165.2, 24, "GDDR6X; fp32-accumulate rate"),
}

_ALIASES = {
    "h100": "h100-sxm",
    "h100sxm": "h100-sxm",
    "h100pcie": "h100-pcie",
    "a100-80gb": "a100",
    "a100sxm": "a100",
    "a10g": "a10",
    "4090": "rtx4090",
    "rtx-4090": "rtx4090",
}


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-").removeprefix("nvidia-").removeprefix("geforce-")


def known_gpu(name: str) -> DeviceSpec:
    """Look a GPU up by a short name ("h200", "H100-SXM", "a100", "rtx4090", ...)."""
    key = _normalise(name)
    key = _ALIASES.get(key, _ALIASES.get(key.replace("-", ""), key))
    if key not in KNOWN_GPUS:
        raise UsageError(
            f"unknown GPU {name!r}; known: {', '.join(sorted(KNOWN_GPUS))} "
            "(or pass 'probe' to measure the local device)"
        )
    return KNOWN_GPUS[key]


def match_known_gpu(device_name: str) -> DeviceSpec | None:
    """Best-effort match of a CUDA device name (torch.cuda.get_device_name) to the table."""
    n = device_name.lower()
    if "h200" in n:
        return KNOWN_GPUS["h200"]
    if "h100" in n:
        return KNOWN_GPUS["h100-pcie" if "pcie" in n else "h100-sxm"]
    if "a100" in n:
        return KNOWN_GPUS["a100-40gb" if "40g" in n else "a100"]
    if "a10" in n:
        return KNOWN_GPUS["a10"]
    if "l4" in n.split() or n.endswith(" l4"):
        return KNOWN_GPUS["l4"]
    if "4090" in n:
        return KNOWN_GPUS["rtx4090"]
    return None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capture_cuda_graph(step: Callable[[], object], *, warmup: int = 2) -> Callable[[], object]:
    """Capture ``step`` in a CUDA graph after ``warmup`` calls on the capture stream; returns its replay.

    ``step`` must leave its state (e.g. a KV cache) as it found it, since the replay repeats it, and
    every shape it uses must be warmed up first (an autotune during capture breaks it).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of ``dst.copy_(src)`` over a buffer of ``nbytes`` (counts the read and the write)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    t = _median_seconds(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * src.element_size() / t


def measure_matmul_flops(device: torch.device, n: int, dtype: torch.dtype = torch.bfloat16, repeats: int = 3) -> float:
    """Flop/s of an [n, n] @ [n, n] matmul in ``dtype``."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = _median_seconds(lambda: torch.mm(a, b), device, repeats)
    return 2.0 * n**3 / t


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (else the platform's machine name)."""
    return cpuinfo_value(("model name",)) or platform.processor() or platform.machine()


def local_device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {cpu_name()} ({torch.get_num_threads()} threads)"


def device_memory_bytes(device: torch.device) -> int:
    """The memory of `device`, this machine's: a GPU's own, or the host's RAM for a CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def probe_device(
    device: str | torch.device = "cpu",
    *,
    dtype: torch.dtype | None = None,
    copy_bytes: int | None = None,
    matmul_n: int | None = None,
) -> DeviceSpec:
    """Measure achievable copy bandwidth and dense matmul rate (a few seconds at most).

    The copy buffer is far larger than the last-level cache (256 MiB on CPU, 2 GiB on GPU) so the
    figure is memory bandwidth, not cache bandwidth. ``dtype``: of the matmul; None means bf16 on a
    GPU and, on a CPU, the faster of float32 and bf16 (bf16 is emulated, and ~100x slower, on CPUs
    without native bf16: see ``quantkit.harness.cpu_features``).
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("probe on cuda asked for, but torch.cuda.is_available() is False")
    on_gpu = device.type == "cuda"
    copy_bytes = copy_bytes or (2 << 30 if on_gpu else 256 << 20)
    matmul_n = matmul_n or (8192 if on_gpu else 1536)
    bandwidth = measure_copy_bandwidth(device, copy_bytes)
    if dtype is None and not on_gpu:
        from .cpu_features import probe_dtype_rates  # import time: it loads quantkit.kernels

        rates, _ = probe_dtype_rates(gemv_shape=(256, 256))
        dtype = getattr(torch, max(rates, key=rates.get))
    dtype = dtype or torch.bfloat16
    flops = measure_matmul_flops(device, matmul_n, dtype)
    memory = device_memory_bytes(device)
    table = match_known_gpu(local_device_name(device)) if on_gpu else None
    return DeviceSpec(
        name=local_device_name(device),
        memory_bandwidth=bandwidth,
        peak_flops=flops,
        memory_bytes=float(memory),
        source="probe",
        datasheet_bandwidth=table.datasheet_bandwidth if table else None,
        datasheet_flops=table.datasheet_flops if table else None,
        notes=f"copy of {copy_bytes >> 20} MiB; {str(dtype).removeprefix('torch.')} matmul n={matmul_n}",
    )


def resolve_device_spec(name_or_probe: str, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None) -> DeviceSpec:
    """``"probe"`` measures ``device`` (default: cuda if available, else cpu) with a matmul in ``dtype``
    (see ``probe_device``); anything else is a table name."""
    if name_or_probe.strip().lower() == "probe":
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return probe_device(device, dtype=dtype)
    return known_gpu(name_or_probe)
