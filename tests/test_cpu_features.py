"""CPU feature detection: flags, the dtype each phase is timed in, and what the report says.

CPUs without native bf16 are simulated by a fake /proc/cpuinfo and monkeypatched probe rates (the
figures of a 2-core AVX2 EPYC), so these tests pass the same on any machine."""

import argparse
import json

import pytest
import torch

from quantkit.harness import cpu_features, hardware
from quantkit.harness.cpu_features import CpuFeatures, detect_cpu_features, read_cpu_flags

AVX2_CPUINFO = "processor\t: 0\nmodel name\t: AMD EPYC 7B12\nflags\t\t: fpu sse2 avx fma avx2 bmi2\n"
ARM_CPUINFO = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve asimdbf16 bf16 i8mm\n"
# measured on an AVX2-only EPYC, 2 threads: bf16 GEMM emulated, bf16 GEMV fine
AVX2_MATMUL = {"float32": 147e9, "bfloat16": 0.3e9}
AVX2_GEMV = {"float32": 1.0e9, "bfloat16": 1.8e9}


def _avx2(tmp_path, monkeypatch) -> CpuFeatures:
    info = tmp_path / "cpuinfo"
    info.write_text(AVX2_CPUINFO)
    monkeypatch.setattr(cpu_features, "probe_dtype_rates", lambda **kw: (dict(AVX2_MATMUL), dict(AVX2_GEMV)))
    monkeypatch.setattr(cpu_features.platform, "machine", lambda: "x86_64")
    return detect_cpu_features(str(info))


def test_flags_say_whether_bf16_is_native(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text(ARM_CPUINFO)
    assert {"asimdbf16", "bf16", "sve"} <= read_cpu_flags(str(info))
    monkeypatch.setattr(cpu_features.platform, "machine", lambda: "aarch64")
    arm = detect_cpu_features(str(info), probe=False)
    assert arm.native_bf16 and "asimdbf16" in arm.flags and arm.matmul_flops == {}
    assert read_cpu_flags(str(tmp_path / "missing")) is None
    unknown = CpuFeatures(arch="x86_64", flags=None, capability="AVX2")
    assert unknown.native_bf16 is None and "could not be read" in unknown.sentences()[0]


def test_without_native_bf16_prefill_runs_in_float32_and_decode_in_bf16(tmp_path, monkeypatch):
    f = _avx2(tmp_path, monkeypatch)
    assert f.flags == ("avx2", "fma") and f.native_bf16 is False
    assert (f.prefill_dtype, f.decode_dtype) == ("float32", "bfloat16")
    text = " ".join(f.sentences({"prefill": "float32", "decode": "bfloat16"}))
    assert "emulates bf16 matrix products" in text and "490x slower than float32" in text
    assert "This run timed prefill in float32 and decode in bfloat16 (quantized" in text
    forced = " ".join(f.sentences({"prefill": "bfloat16", "decode": "bfloat16"}))
    assert "for prefill that is not the faster dtype here" in forced
    again = CpuFeatures.from_dict(json.loads(json.dumps(f.to_dict())))
    assert again == f and again.to_dict()["prefill_dtype"] == "float32"


def test_native_bf16_runs_both_phases_in_bf16():
    f = CpuFeatures(arch="x86_64", flags=("avx2", "avx512_bf16", "amx_bf16"), capability="AVX512",
                    matmul_flops={"float32": 150e9, "bfloat16": 900e9}, gemv_flops={"float32": 1e9, "bfloat16": 2e9})
    assert f.native_bf16 and (f.prefill_dtype, f.decode_dtype) == ("bfloat16", "bfloat16")
    assert not any("slower than float32" in s for s in f.sentences())
    # a loaded machine's wobble (float32 1.3x faster in one probe) does not flip the choice
    noisy = CpuFeatures(arch="x86_64", flags=("avx2", "amx_bf16"), capability="AVX512",
                        matmul_flops={"float32": 4e9, "bfloat16": 237e9}, gemv_flops={"float32": 0.6e9, "bfloat16": 0.45e9})
    assert (noisy.prefill_dtype, noisy.decode_dtype) == ("bfloat16", "bfloat16")


def test_cpu_probe_measures_the_faster_dtype(monkeypatch):
    seen = []
    monkeypatch.setattr(cpu_features, "probe_dtype_rates", lambda **kw: (dict(AVX2_MATMUL), dict(AVX2_GEMV)))
    monkeypatch.setattr(hardware, "measure_matmul_flops", lambda device, n, dtype: seen.append(dtype) or 100e9)
    # a fixed bandwidth too: a real copy of 8 MiB stays in cache and can exceed 100e9 bytes/s, which the
    # roofline check would then (rightly) flag, making the test depend on this machine's speed
    monkeypatch.setattr(hardware, "measure_copy_bandwidth", lambda device, nbytes, repeats=5: 20e9)
    spec = hardware.probe_device("cpu", copy_bytes=8 << 20, matmul_n=64)
    assert seen == [torch.float32] and "float32 matmul" in spec.notes and spec.roofline_problem is None
    # the emulated bf16 figure would be no roofline at all
    bad = hardware.DeviceSpec(name="x", memory_bandwidth=11e9, peak_flops=0.3e9, memory_bytes=1e9, source="probe")
    assert "emulated or broken" in bad.roofline_problem


def _bench_parser():
    from quantkit.commands import bench

    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    return parser


@pytest.fixture
def tiny_config(tmp_path):
    from tests.test_bench import TINY_LLAMA

    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


def test_bench_times_each_phase_in_the_fastest_dtype(tmp_path, monkeypatch, tiny_config, capsys):
    from quantkit.harness.report import render_report

    features = _avx2(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu_features, "detect_cpu_features", lambda: features)
    monkeypatch.setattr(hardware, "measure_copy_bandwidth", lambda device, nbytes, repeats=5: 10e9)
    monkeypatch.setattr(hardware, "measure_matmul_flops", lambda device, n, dtype: 100e9)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "bench.json"
        args = _bench_parser().parse_args([
            "bench", tiny_config, "--variants", "w4a16-rtn", "--prompt-lens", "8", "--context-lens", "8",
            "--batch-sizes", "1", "--warmup", "0", "--repeats", "1", "--device", "cpu", "--quiet",
            "--json", str(out)])
        assert args.func(args) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads(out.read_text())
    assert data["dtypes"] == {"prefill": "float32", "decode": "bfloat16"}
    assert {r["dtype"] for r in data["prefill"]} == {"float32"} and {r["dtype"] for r in data["decode"]} == {"bfloat16"}
    assert data["baseline"] == "float" and {r["variant"] for r in data["prefill"]} == {"float", "w4a16-rtn"}
    assert data["device"]["cpu_features"]["native_bf16"] is False
    # quantized variants run PyTorch's CPU kernels, not the float32 reference path
    assert data["variants"][1]["backend"] == "torch"
    # the roofline's float prefill reads 4-byte weights, its decode 2-byte ones
    pf = next(r for r in data["prefill"] if r["variant"] == "float")
    dc = next(r for r in data["decode"] if r["variant"] == "float")
    assert pf["roofline"]["bytes_breakdown"]["weights"] == 2 * dc["roofline"]["bytes_breakdown"]["weights"]
    md = render_report(data, [], tmp_path / "report").read_text()
    assert ("prefill timed in float32 (matmul probe: float32 measured 490x bfloat16's rate (the margin is 2x)), "
            "decode timed in bfloat16 (matrix-vector product probe: bfloat16 measured 1.8x float32's rate)") in md
    assert "PyTorch emulates bf16 matrix products" in md and "This run timed prefill in float32" in md
    capsys.readouterr()


def test_bench_warns_when_bf16_is_forced_without_native_bf16(tmp_path, monkeypatch, tiny_config, capsys):
    features = _avx2(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu_features, "detect_cpu_features", lambda: features)
    monkeypatch.setattr(hardware, "measure_copy_bandwidth", lambda device, nbytes, repeats=5: 10e9)
    monkeypatch.setattr(hardware, "measure_matmul_flops", lambda device, n, dtype: 0.3e9)
    out = tmp_path / "bench.json"
    args = _bench_parser().parse_args([
        "bench", tiny_config, "--prompt-lens", "8", "--context-lens", "8", "--batch-sizes", "1", "--warmup", "0",
        "--repeats", "1", "--device", "cpu", "--dtype", "bf16", "--quiet", "--json", str(out)])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert json.loads(out.read_text())["variants"][0]["name"] == "bf16"
    assert "bf16 matmul measured 0.3 GFLOP/s against 147 in float32" in captured.err
    assert "of roofline" not in captured.out and "no roofline: the matmul probe" in captured.out


def test_dtype_probe_alternates_the_dtypes_and_says_why():
    """The probe times the dtypes in rounds (A B A B ...), so a shared machine's load falls on both
    alike, and each phase's choice comes with its reason."""
    order = []
    medians = cpu_features._interleaved_seconds({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                                budget_s=0.0)
    assert order == ["a", "b"] * 4 and set(medians) == {"a", "b"}  # a warm-up call each, then 3 rounds
    f = CpuFeatures(arch="x86_64", flags=("avx2",), capability="AVX2", matmul_flops=dict(AVX2_MATMUL),
                    gemv_flops=dict(AVX2_GEMV))
    assert f.choice_reason("prefill") == "matmul probe: float32 measured 490x bfloat16's rate (the margin is 2x)"
    assert f.choice_reason("decode") == "matrix-vector product probe: bfloat16 measured 1.8x float32's rate"
