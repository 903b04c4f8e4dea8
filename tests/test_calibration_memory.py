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
