"""Peak host memory of calibration grows with the block size, not with the depth (offloaded model)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "evals" / "calibration" / "memory_benchmark.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("calibration_memory_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_peak_memory_does_not_grow_with_depth():
    shallow, deep = _benchmark().run([2, 6], hidden=256, intermediate=768, samples=2, seq_len=128, offload=True,
                                         one_process=True)
    block = shallow["block_mib"]
    # Each extra block may keep only its quantized weights (int4: ~1/8 of a float32 block); a pipeline that
    # kept float blocks (or their Hessians) alive would add at least a whole block per extra layer. The
    # bound sits halfway between, since RSS readings move by a few hundred KiB from run to run.
    extra_layers = deep["layers"] - shallow["layers"]
    allowed = extra_layers * block / 2 + block
    growth = deep["overhead_mib"] - shallow["overhead_mib"]
    assert growth < allowed, (shallow, deep)


def test_freed_pages_are_released_after_each_layer_and_block(monkeypatch):
    """RTN trims glibc's heap after each quantized linear, calibration after each decoder block."""
    import torch
    import transformers

    import quantkit
    from quantkit.calibration import offload

    calls = []
    monkeypatch.setattr(offload, "_libc_malloc_trim", lambda: calls.append)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, vocab_size=128)
    quantkit.quantize(transformers.LlamaForCausalLM(config), "w4a16-rtn", progress=False)
    assert calls == [0] * 14  # 7 linears a block (lm_head is not targeted)
    calls.clear()
    batches = [torch.randint(0, 128, (1, 128), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    quantkit.quantize(transformers.LlamaForCausalLM(config), "w4a16-gptq", calibration_data=batches, progress=False)
    assert calls == [0, 0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_malloc_trim_is_found_on_glibc():
    from quantkit.calibration import offload

    assert offload._libc_malloc_trim() is not None


def _random_llama(layers: int = 2):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=2, vocab_size=128)
    return transformers.LlamaForCausalLM(config)


def _anonymous_quantized_bytes(model) -> int:
    """Bytes of the quantized linears' tensors that live in the process's memory (not spilled to a file)."""
    from quantkit.modules.quant_linear import QuantLinear

    return sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, QuantLinear)
               for t in [*m.parameters(), *m.buffers()] if not getattr(t, "_quantkit_spilled", False))


@pytest.mark.parametrize("recipe", ["w4a16-rtn", "w4a16-gptq", "w4a16-awq"])
def test_spilled_blocks_are_the_same_model_and_leave_no_file(tmp_path, recipe):
    """With spill_folder every finished block's tensors are views of unlinked files, the quantized model
    equals the one kept in memory tensor for tensor, and the folder is left empty."""
    import torch

    import quantkit

    batches = [torch.randint(0, 128, (1, 128), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    kept = quantkit.quantize(_random_llama(), recipe, calibration_data=batches, progress=False)
    spilled = quantkit.quantize(_random_llama(), recipe, calibration_data=batches, progress=False,
                                spill_folder=tmp_path)
    assert _anonymous_quantized_bytes(kept) > 0 and _anonymous_quantized_bytes(spilled) == 0
    assert list(tmp_path.iterdir()) == []
    a, b = kept.state_dict(), spilled.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    ids = batches[0]
    assert torch.equal(kept(ids).logits, spilled(ids).logits)
    quantkit.save(spilled, tmp_path / "spilled")
    quantkit.save(kept, tmp_path / "kept")
    assert (tmp_path / "spilled" / "model.safetensors").read_bytes() == (tmp_path / "kept" / "model.safetensors").read_bytes()


def test_a_spilled_tensor_written_in_place_leaves_the_file_and_the_others_alone(tmp_path):
    """Spill files are mapped privately: an in-place edit of one view copies its page, nothing else moves."""
    import torch
    from torch import nn

    from quantkit.calibration.spill import BlockSpill

    module = nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 100))
    module[0].register_buffer("counts", torch.arange(7))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    spill = BlockSpill(tmp_path)
    written = spill.keep(module)
    assert written >= sum(v.numel() * v.element_size() for v in before.values()) and spill.bytes == written
    assert spill.keep(module) == 0  # already file-backed
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        module[0].weight.add_(1.0)
    assert torch.equal(module[0].weight, before["0.weight"] + 1.0)
    assert torch.equal(module[1].weight, before["1.weight"]) and torch.equal(module[0].counts, torch.arange(7))


def test_a_spill_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    import quantkit
    from quantkit.core.errors import QuantizationError

    with pytest.raises(QuantizationError, match="not a folder this process can write in"):
        quantkit.quantize(_random_llama(), "w4a16-rtn", progress=False, spill_folder=tmp_path / "missing")


# GPTQ's factorisation of one Hessian, in a fresh process whose large blocks are mapped one by one (as quantize
# does), RssAnon sampled every 0.2 ms: prints (peak over the entry, one [K, K] fp32 matrix), in bytes.
_FACTOR_PEAK = """
import threading, time
import torch
from quantkit.algorithms.gptq import GPTQOptions, factor_hessian
from quantkit.calibration.offload import map_large_allocations, release_freed_memory
def anon():
    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('RssAnon:'))
assert map_large_allocations()
k = 3072
x = torch.randn(2 * k, k, generator=torch.Generator().manual_seed(0))
hessian = [x.T @ x / (2 * k)]
del x
factor_hessian(hessian[0].clone(), GPTQOptions(), overwrite=True)  # libraries' first-use buffers beforehand
release_freed_memory()
entry, peak, done = anon(), [0], []
def sample():
    while not done:
        peak[0] = max(peak[0], anon())
        time.sleep(0.0002)
sampler = threading.Thread(target=sample)
sampler.start()
factor = factor_hessian(hessian.pop(), GPTQOptions(), overwrite=True)  # handed over: freed once factored
done.append(1)
sampler.join()
print(peak[0] - entry, k * k * 4)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_hessian_factorisation_holds_two_matrices_at_most():
    """Beside the Hessian handed over, the factorisation holds one more [K, K] matrix at a time (the factor
    of its reversed copy, then L^-1 in L's place, then U in L^-1's): no column-major copy behind cholesky_ex,
    no view that keeps L alive through the flip, no whole-matrix isfinite mask. Measured at K = 3072: 1.00
    matrix over the entry, 2.75 before."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _FACTOR_PEAK], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    over, matrix = map(int, done.stdout.split())
    assert over < 1.4 * matrix, f"{over / matrix:.2f} [K, K] matrices over the entry"
