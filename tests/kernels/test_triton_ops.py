"""The Triton ops are registered on first use: a CPU process that never runs a Triton kernel imports
neither triton nor torch._inductor / torch._dynamo for quantkit's sake, and ``register_ops`` defines the
ops for code that calls ``torch.ops.quantkit.*`` directly. Each check runs in a fresh interpreter,
without TRITON_INTERPRET (this folder's conftest sets it for the kernel tests)."""

import os
import subprocess
import sys

import pytest

HEAVY = ("torch._inductor", "torch._dynamo", "triton")
# quantkit's modules that import triton (the ones holding Triton kernels, their launch rules, the compile check)
TRITON_MODULES = ("quantkit.kernels.wna16_triton", "quantkit.kernels.wna16_gemv",
                  "quantkit.kernels.decode_attention_kernels", "quantkit.kernels.decode_attention_heuristics",
                  "quantkit.kernels.kv_cache_write_kernels", "quantkit.kernels.compile_check")
OPS = ("wna16_gemm", "decode_attention_fp8", "fp8_kv_cache_write")


def run_python(code: str, cwd=None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_importing_quantkit_and_its_kernels_loads_no_triton():
    code = (
        "import sys\n"
        "import quantkit, quantkit.kernels, quantkit.api, quantkit.modules.kv_cache, quantkit.commands.quantize\n"
        "from quantkit.kernels import decode_attention, kv_cache_write, wna16\n"
        f"print(sorted(m for m in {HEAVY + TRITON_MODULES!r} if m in sys.modules))\n"
    )
    assert run_python(code) == "[]"


@pytest.mark.slow  # a GPTQ quantize of ref:tiny: ~20 s on 2 busy cores
def test_a_cpu_quantize_registers_no_triton_op(tmp_path):
    """A CPU calibration run (the command line's quantize) imports none of quantkit's Triton modules and
    defines no Triton op. (transformers' Llama imports torch._dynamo itself: masking_utils, transformers 5.)"""
    code = (
        "import sys, torch\n"
        "from quantkit.commands.cli import main\n"
        f"assert main(['quantize', 'ref:tiny', '--recipe', 'w4a16-gptq', '--out', {str(tmp_path / 'out')!r},\n"
        "             '--calib', 'ref', '--calib-samples', '4', '--calib-seq-len', '64']) == 0\n"
        f"loaded = sorted(m for m in {TRITON_MODULES!r} if m in sys.modules)\n"
        f"ops = [op for op in {OPS!r} if hasattr(torch.ops.quantkit, op)]\n"
        "print([loaded, ops])\n"
    )
    assert run_python(code) == "[[], []]"


def test_register_ops_defines_the_triton_ops():
    code = (
        "import sys, torch\n"
        "import quantkit.kernels as qk\n"
        f"before = [op for op in {OPS!r} if hasattr(torch.ops.quantkit, op)]\n"
        "qk.register_ops()\n"
        "qk.register_ops()  # idempotent\n"
        f"after = [op for op in {OPS!r} if hasattr(torch.ops.quantkit, op)]\n"
        "print([before, after, 'quantkit.kernels.wna16_triton' in sys.modules])\n"
    )
    assert run_python(code) == f"[[], {list(OPS)!r}, True]"


def test_the_triton_path_registers_its_op_on_first_use():
    """wna16_linear on the Triton layout reaches torch.ops.quantkit.wna16_gemm without an explicit
    register_ops (the interpreter runs it on CPU tensors)."""
    code = (
        "import os, sys\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "import torch\n"
        "import quantkit.kernels as qk\n"
        "assert 'triton' not in sys.modules and qk.kernels_interpreted()\n"
        "from quantkit.kernels.packing import pack_int32\n"
        "q = torch.randint(-8, 8, (16, 64), dtype=torch.int32)\n"
        "scale = torch.rand(16, 1) / 8 + 0.01\n"
        "prepared = qk.prepare_wna16(pack_int32(q, 4), scale, None, bits=4, in_features=64, backend='triton')\n"
        "x = torch.randn(3, 64)\n"
        "y = qk.wna16_linear(x, prepared, bits=4, in_features=64, out_features=16, backend='triton')\n"
        "torch.testing.assert_close(y, x @ (q.float() * scale).T, rtol=1e-5, atol=1e-5)\n"
        "print(qk.kernels_interpreted() and hasattr(torch.ops.quantkit, 'wna16_gemm'))\n"
    )
    assert run_python(code) == "True"
