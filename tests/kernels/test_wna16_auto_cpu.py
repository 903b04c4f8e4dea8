"""backend="auto" on CPU for fp32 models: the fast CPU kernels, within bf16's error of the fp32 float reference.

"auto" gives an fp32 model's quantized linears the "torch" backend: below ``DEQUANT_MIN_ROWS`` rows
x, the scales and the output are rounded to bf16 around PyTorch's fused kernels (fp32 accumulation);
from it on, the weight is dequantized once with the bf16 scales and multiplied in fp32. Each rounding
moves a value by at most 2^-8 relative (half a bf16 ulp), the x and scale roundings average out over K,
so the relative mean error stays below bf16's eps 2^-7 = 7.8e-3, the house bf16 tolerance
(``wna16_cases.tolerance``): measured 1e-3 to 3e-3. A wrong nibble, scale or zero moves outputs by
O(1), far beyond it.
"""

from __future__ import annotations

import pytest
import torch

import quantkit.kernels as qk
from quantkit.kernels import cpu_kernel_choice
from quantkit.modules.quant_linear import QuantLinear
from quantkit.core.quantized_weight import QuantizedWeight
from quantkit.core.scheme import QuantScheme

from .wna16_cases import Scheme, random_weight, reference_output, rel_mean_error, tolerance

# PyTorch's CPU kernels: the "torch" backend's fallback (quantkit's C++ kernel: test_wna16_cpu_q8.py).
pytestmark = pytest.mark.usefixtures("aten_cpu_path")

AUTO_FP32_TOL = tolerance(torch.bfloat16)  # 2^-7; reasoning in the module docstring

SCHEMES = {  # scheme -> the layout "auto" must pick on CPU for an fp32 model
    Scheme(4, 128, True): "cpu_int4",
    Scheme(4, 128, False): "cpu_int4",
    Scheme(8, None, True): "cpu_int8",
    Scheme(8, None, False): "cpu_int8",
}
SHAPES = [(96, 256), (208, 384), (48, 512)]  # (N, K): full and ragged row blocks of the int4 layout
# decode (1, a few), int8's switch to dequantize-once, both formats on it
ROWS = (1, 3, cpu_kernel_choice.DEQUANT_MIN_ROWS["cpu_int8"], cpu_kernel_choice.DEQUANT_MIN_ROWS["cpu_int4"] + 5)


@pytest.fixture
def gen():
    g = torch.Generator()
    g.seed()
    return g


@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("scheme", list(SCHEMES), ids=lambda s: s.id)
def test_auto_fp32_matches_the_float_reference(scheme, n, k, gen):
    weight = random_weight(scheme, n, k, torch.float32, gen)
    backend = qk.resolve_backend("auto", weight.weight_packed.device, weight.weight_scale.dtype)
    prep = qk.prepare_wna16(weight.weight_packed, weight.weight_scale, weight.weight_zero_point,
                            bits=scheme.bits, in_features=k, backend="auto")
    assert qk.prepared_layout(prep) == SCHEMES[scheme]
    bias = torch.randn(n, generator=gen)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        with_bias = bias if m % 2 else None
        y = qk.wna16_linear(x, prep, bits=scheme.bits, in_features=k, out_features=n, backend=backend, bias=with_bias)
        assert y.shape == (m, n) and y.dtype == torch.float32
        err = rel_mean_error(y, reference_output(x, weight, with_bias))
        assert err <= AUTO_FP32_TOL, f"seed={gen.initial_seed()} M={m}: relative mean error {err:.2e}"


@pytest.mark.parametrize("symmetric", [True, False], ids=("sym", "asym"))
def test_an_fp32_quant_linear_on_auto_matches_its_dequantized_float_linear(symmetric, gen):
    """The module path users take (QuantLinear.prepare("auto"), as quantkit.load does), on [B, T, K] inputs."""
    n, k = 160, 256
    scheme = QuantScheme(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=128)
    groups = k // 128
    q = torch.randint(-8, 8, (n, k), generator=gen).to(torch.int8)
    scale = torch.rand(n, groups, generator=gen) * 0.02 + 0.005
    zero = None if symmetric else torch.randint(-8, 8, (n, groups), generator=gen).to(torch.int32)
    layer = QuantLinear.from_weight(QuantizedWeight(q, scale, zero, scheme), torch.randn(n, generator=gen))
    assert layer.prepare("auto") == "torch"
    w = layer.dequantized_weight()  # fp32 [N, K], exact
    for shape in ((1, 1, k), (2, 3, k), (1, 150, k)):
        x = torch.randn(*shape, generator=gen)
        ref = torch.nn.functional.linear(x.double(), w.double(), layer.bias.double())
        err = rel_mean_error(layer(x), ref)
        assert err <= AUTO_FP32_TOL, f"seed={gen.initial_seed()} x {shape}: relative mean error {err:.2e}"
