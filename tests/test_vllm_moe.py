"""quantkit's MoE checkpoints through vLLM's own model loader (vLLM's CPU build).

vLLM reads a compressed-tensors WNA16 MoE checkpoint with `CompressedTensorsWNA16MoEMethod`: each MoE
layer's `w13_weight_packed` [E, 2I, H/pack], `w13_weight_scale` [E, 2I, G], `w2_*` and the zero points are
filled expert by expert, by the family's `expert_params_mapping`, from the per-expert tensors quantkit
writes. On a CPU vLLM has a WNA16 MoE kernel only with AMX (`CPUExpertsInt4`) or zentorch; elsewhere
the method's constructor stops with "No WNA16 MoE backend supports the deployment configuration", so
vLLM cannot *run* these checkpoints on such CPUs (and quantkit's plugin supplies linear kernels only).
This test therefore checks the loading: the backend choice is forced to vLLM's CPU int4 experts, the
parameters are captured as vLLM's loader left them (before the kernel repacks them), and they must equal
quantkit's tensors exactly, for Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE, symmetric and asymmetric.
Where the machine has AMX, the engine also runs and its greedy tokens are compared with quantkit's.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (set before import)
if os.environ.get("QUANTKIT_TEST_VLLM") == "required":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'quantkit[vllm]' (CI: .ci/run)")

from vllm import LLM  # noqa: E402
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # noqa: E402
    compressed_tensors_moe_wna16 as ct_moe,
)

import quantkit  # noqa: E402
from quantkit.modules.quant_experts import QuantExperts  # noqa: E402
from fixtures.moe_fixtures import MOE_FAMILIES, make_moe_model  # noqa: E402
from tests.vllm_engines import check_amx_tile_permission, shut_down  # noqa: E402

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="bfloat16", max_model_len=128, max_num_seqs=2, kv_cache_memory_bytes=32 << 20,
              enforce_eager=True, seed=0, skip_tokenizer_init=True)  # random models have no tokenizer
RECIPES = {
    "w4a16-rtn": "w4a16-rtn",
    "w4a16-rtn-asym": "w4a16-rtn-asym",
    "w8g64": {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}},
}


class _Captured(Exception):
    """Raised once every MoE layer's parameters are captured (the engine cannot run them here)."""


def _capture_loaded_experts(monkeypatch) -> list[dict[str, torch.Tensor]]:
    """Force vLLM's CPU int4 experts (the oracle refuses every backend on a CPU without AMX) and record each
    MoE layer's parameters as vLLM's weight loader filled them, in layer order."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend

    captured: list[dict[str, torch.Tensor]] = []
    amx = torch.cpu._is_amx_tile_supported()
    original_select = ct_moe.select_wna16_moe_backend
    original_process = ct_moe.CompressedTensorsWNA16MoEMethod.process_weights_after_loading

    def select(*args, **kwargs):
        try:
            return original_select(*args, **kwargs)
        except NotImplementedError:
            return WNA16MoEBackend.CPU, CPUExpertsInt4

    def process(self, layer):
        captured.append({name: p.detach().clone() for name, p in layer.named_parameters(recurse=False)
                         if name.startswith(("w13_", "w2_"))})
        if amx:
            return original_process(self, layer)
        return None  # leave the loaded tensors as they are; the engine cannot run them on this CPU

    monkeypatch.setattr(ct_moe, "select_wna16_moe_backend", select)
    monkeypatch.setattr(ct_moe.CompressedTensorsWNA16MoEMethod, "process_weights_after_loading", process)
    return captured


def _quantkit_stacked(model, layer: int) -> dict[str, torch.Tensor]:
    """quantkit's checkpoint tensors of one MoE layer, stacked as vLLM holds them."""
    experts: QuantExperts = model.model.layers[layer].mlp.experts
    out = {}
    for prefix, picks in (("w13", (0, 1)), ("w2", (2,))):
        per_expert = [[ex.projections()[i] for i in picks] for ex in experts.experts()]
        out[f"{prefix}_weight_packed"] = torch.stack([torch.cat([p.weight_packed for p in ps]) for ps in per_expert])
        out[f"{prefix}_weight_scale"] = torch.stack([torch.cat([p.weight_scale for p in ps]) for ps in per_expert])
        if per_expert[0][0].weight_zero_point is not None:
            from quantkit.kernels.packing import pack_zero_point, unpack_zero_point

            bits = per_expert[0][0].scheme.num_bits
            zps = [torch.cat([unpack_zero_point(p.weight_zero_point, bits, p.out_features) for p in ps])
                   for ps in per_expert]
            out[f"{prefix}_weight_zero_point"] = torch.stack([pack_zero_point(z, bits) for z in zps])
    return out


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_vllms_loader_fills_the_expert_parameters_exactly(family, recipe, tmp_path, monkeypatch):
    model = make_moe_model(family)
    quantkit.quantize(model, RECIPES[recipe], progress=False)
    folder = quantkit.save(model, tmp_path / "ckpt", dtype=torch.bfloat16)
    ours = quantkit.load(folder, backend="reference")
    captured = _capture_loaded_experts(monkeypatch)
    llm = None
    try:
        llm = LLM(model=str(folder), **ENGINE)
    except Exception as e:  # noqa: BLE001  (no AMX: the first forward has no kernel; the loading is what is checked)
        if torch.cpu._is_amx_tile_supported():
            raise
        assert captured, f"vLLM failed before loading the experts: {type(e).__name__}: {e}"
    try:
        assert len(captured) == 2
        for layer, theirs in enumerate(captured):
            want = _quantkit_stacked(ours, layer)
            for name, tensor in want.items():
                got = theirs[name]
                assert got.shape == tensor.shape, (name, got.shape, tensor.shape)
                if tensor.is_floating_point():
                    assert torch.equal(got.to(tensor.dtype), tensor), name
                else:
                    assert torch.equal(got.view(tensor.dtype) if got.dtype != tensor.dtype else got, tensor), name
        if llm is not None and torch.cpu._is_amx_tile_supported():
            from vllm import SamplingParams

            check_amx_tile_permission()  # vLLM's AMX attention runs in the generate below
            ids = [3, 17, 42, 99, 7]
            out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=8, temperature=0.0))
            ref = ours.to(torch.bfloat16).generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
            assert list(out[0].outputs[0].token_ids) == ref[0, len(ids):].tolist()
    finally:
        if llm is not None:
            shut_down(llm)
