"""quantkit's weight-only linear as a vLLM mixed-precision kernel, installed by a vLLM plugin.

vLLM calls ``register`` through the entry point ``quantkit`` of the group ``vllm.general_plugins``
(pyproject.toml), in every process it starts. On CPU, ``register`` puts ``QuantkitWNA16LinearKernel`` at
the head of vLLM's mixed-precision kernel list, so every compressed-tensors WNA16 layer (``pack-quantized``
int2/int4/int8, symmetric or not, per channel or in groups) that quantkit's kernels can run goes through
them (vLLM's own CPU kernel takes int4 only and its op is missing from the AVX2 builds); where
``can_implement`` says no, vLLM goes on down its own list. On CUDA it is appended behind vLLM's own
kernels (Marlin, Machete, ...): a fallback for the layers none of them takes. vLLM logs
the kernel it chose per scheme ("Using QuantkitWNA16LinearKernel for CompressedTensorsWNA16").

The layer stays vLLM's. Its loader fills parameters that have exactly the on-disk layout, whatever the
shard: ``weight_packed`` int32 [N, ceil(K*bits/32)], ``weight_scale`` [N, G] and, asymmetric,
``weight_zero_point`` int32 [ceil(N*bits/32), G] packed along N, with N the layer's outputs on this rank
(fused QKV / gate-up: the parts concatenated along N; column-parallel: a slice of N) and K its inputs
on this rank (row-parallel: a slice of K and of the groups). That is the input of
``quantkit.kernels.prepare_wna16``, so this kernel only translates: one ``prepare_wna16`` at load, one
``wna16_linear`` per call, with the backend ``quantkit.load`` would pick for the same device and dtype
(CUDA: the Triton kernels; CPU, bf16 or fp32 model: PyTorch's weight-only CPU kernels; CPU, fp16 model:
the exact reference).

Switch it off with vLLM's own settings: ``VLLM_DISABLED_KERNELS=QuantkitWNA16LinearKernel`` (this
kernel only), or ``VLLM_PLUGINS`` set to a list of plugins without ``quantkit``.

On CPUs with AMX, ``register`` also asks Linux for the tile-data permission (quantkit/engines/amx_permission.py):
vLLM's own AMX attention kernel needs it and does not ask, so a model that never reaches vLLM's oneDNN
(every unquantized linear under 1 MiB, the rest on this kernel) would otherwise die with SIGILL in
``cpu_attention_with_kv_cache``. vLLM loads general plugins in every process it starts (the engine core,
each tensor-parallel worker) before it builds the model, and the permission is per process (exec drops
it): this is the one place that reaches each of them.
"""

from __future__ import annotations

import torch
import vllm.model_executor.kernels.linear as vllm_linear
from vllm.logger import init_logger
from vllm.model_executor.kernels.linear import MPLinearKernel, MPLinearLayerConfig, register_linear_kernel
from vllm.platforms import PlatformEnum, current_platform
from vllm.scalar_type import scalar_types

from ..kernels.backend_choice import resolve_backend
from ..kernels.packing import packed_words
from ..kernels.triton_ops import register_ops
from ..kernels.wna16 import planned_layout, prepare_wna16, wna16_linear
from ..kernels.wna16_layout import ACTIVATION_DTYPES, check_wna16_weight
from .amx_permission import request_amx_tile_permission

logger = init_logger(__name__)

#: vLLM's weight type -> (bits, symmetric). Symmetric types carry the storage offset 2**(bits-1) as
#: their bias ("b8": stored u = q + 8); asymmetric ones come with zero points.
WEIGHT_TYPES = {
    scalar_types.uint2b2: (2, True),
    scalar_types.uint4b8: (4, True),
    scalar_types.uint8b128: (8, True),
    scalar_types.uint2: (2, False),
    scalar_types.uint4: (4, False),
    scalar_types.uint8: (8, False),
}
PLATFORMS = (PlatformEnum.CPU, PlatformEnum.CUDA)
FIRST_ON = (PlatformEnum.CPU,)  # the platforms where quantkit's kernel goes before vLLM's own
PREFIX = "quantkit_"  # the layer attributes holding the prepared tensors: PREFIX + prepared-dict key


def platform_device() -> str | None:
    """The device quantkit's kernels run on for vLLM's current platform, or None where they do not."""
    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return None


class QuantkitWNA16LinearKernel(MPLinearKernel):
    """vLLM's WNA16 linear through ``quantkit.kernels.prepare_wna16`` / ``wna16_linear``."""

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # CUDA: the Triton kernels' bf16 dot products need sm_80; the CPU platform has no capability

    @classmethod
    def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
        """Yes exactly where ``prepare_wna16`` accepts this rank's tensors for the backend it would use.

        The tensors are described on the meta device, so nothing is allocated: the same shape checks
        (``check_wna16_weight``) and layout rule (``planned_layout``) that ``prepare_wna16`` runs.
        """
        device = platform_device()
        if device is None:
            return False, f"quantkit's kernels run on CPU and CUDA, not on {current_platform.device_type}"
        if c.weight_type not in WEIGHT_TYPES:
            return False, f"weight type {c.weight_type} is none of quantkit's {sorted(map(str, WEIGHT_TYPES))}"
        bits, symmetric = WEIGHT_TYPES[c.weight_type]
        if c.zero_points == symmetric:
            return False, f"weight type {c.weight_type} with zero_points={c.zero_points}: zero points go with asymmetric types"
        if c.act_type not in ACTIVATION_DTYPES or c.out_type not in (None, c.act_type):
            return False, (
                f"activations {c.act_type} -> output {c.out_type}: quantkit's kernels take one of "
                f"{ACTIVATION_DTYPES} and return it"
            )
        k, n = c.partition_weight_shape
        groups = 1 if c.group_size == -1 else -(-k // c.group_size)  # as vLLM sizes weight_scale
        meta = dict(device="meta", dtype=torch.int32)
        try:
            shape = check_wna16_weight(
                torch.empty(n, packed_words(k, bits), **meta),
                torch.empty(n, groups, device="meta", dtype=c.act_type),
                None if symmetric else torch.empty(packed_words(n, bits), groups, **meta),
                bits,
                k,
            )
            planned_layout(shape, resolve_backend("auto", device, c.act_type))
        except (TypeError, ValueError) as error:
            return False, f"quantkit's kernels cannot run this layer: {error}"
        return True, None

    def __init__(self, c: MPLinearLayerConfig, w_q_param_name: str, w_s_param_name: str,
                 w_zp_param_name: str | None = None) -> None:
        super().__init__(c, w_q_param_name, w_s_param_name, w_zp_param_name)
        self.bits = WEIGHT_TYPES[c.weight_type][0]
        self.in_features, self.out_features = c.partition_weight_shape  # this rank's K and N
        self.backend = resolve_backend("auto", platform_device(), c.act_type)
        self.keys: tuple[str, ...] = ()  # the prepared dict's keys, set at load

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack vLLM's loaded parameters once into the backend's layout; keep only what it reads."""
        w_q, w_s, w_zp = self._get_weight_params(layer)
        prepared = prepare_wna16(
            w_q.data, w_s.data, None if w_zp is None else w_zp.data,
            bits=self.bits, in_features=self.in_features, backend=self.backend,
        )
        for name in (self.w_q_name, self.w_s_name, self.w_zp_name):
            if name is not None and getattr(layer, name, None) is not None:
                delattr(layer, name)
        for key, tensor in prepared.items():
            layer.register_buffer(PREFIX + key, tensor, persistent=False)
        self.keys = tuple(prepared)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., K] in the model dtype -> [..., N] in x's dtype."""
        prepared = {key: getattr(layer, PREFIX + key) for key in self.keys}
        return wna16_linear(
            x, prepared, bits=self.bits, in_features=self.in_features, out_features=self.out_features,
            backend=self.backend, bias=bias,
        )


def register() -> None:
    """The plugin entry point: add quantkit's kernel to vLLM's lists for CPU and CUDA (idempotent).

    ``register_linear_kernel`` appends to vLLM's list, behind vLLM's own kernels. On CPU (``FIRST_ON``)
    the class is then moved to the head of the list, which vLLM keeps in ``_POSSIBLE_KERNELS``: vLLM's
    CPU int4 kernel would be chosen first and then fail on CPUs without AVX-512. On CUDA the Triton ops
    are registered (``quantkit.kernels.register_ops``; a CPU process never imports triton for them;
    ``prepare_wna16`` would register them at load too). Then, on CPU, the AMX
    tile-data permission for this process (see the module's docstring); a refusal on an AMX CPU is
    logged as a warning, since vLLM's AMX attention will then die with SIGILL.
    """
    for platform in PLATFORMS:
        kernels = vllm_linear._POSSIBLE_KERNELS.setdefault(platform, [])
        if QuantkitWNA16LinearKernel not in kernels:
            register_linear_kernel(QuantkitWNA16LinearKernel, platform)
        if platform in FIRST_ON:
            kernels.remove(QuantkitWNA16LinearKernel)
            kernels.insert(0, QuantkitWNA16LinearKernel)
    if current_platform.is_cuda():
        register_ops()  # torch.ops.quantkit.wna16_gemm, before vLLM compiles or captures the model
    if current_platform.is_cpu():
        permission = request_amx_tile_permission()
        if permission.granted or not permission.asked:
            logger.debug("quantkit: AMX tile-data permission %s", permission.reason)
        else:
            logger.warning("quantkit: AMX tile-data permission %s; vLLM's AMX attention kernel, which does not "
                           "ask for it, will die with SIGILL in this process", permission.reason)
