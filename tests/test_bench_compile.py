"""The decode step compiles without graph breaks (quantized linears included), and `quantkit bench --compile`."""

import json

import pytest
import torch

from quantkit.harness.roofline import ModelShape
from quantkit.harness.timing import fill_cache, make_decode_cache, rewind
from quantkit.harness.variants import build_variant, load_source_model
from quantkit.modules.kv_scales import cache_keyword

from .test_bench import _bench_parser, one_thread, tiny_model_source  # noqa: F401  (one_thread: autouse fixture)


@pytest.mark.parametrize(  # the CPU kernel backends (triton, interpreted: tests/kernels); the torch backend's two ops
    "backend,recipe", [("torch", "w4a16-rtn"), ("torch", "w8a16-rtn"), ("reference", "w4a16-rtn")]
)
def test_quantized_decode_step_compiles_fullgraph(backend, recipe, tmp_path):
    assert_decode_step_compiles(backend, recipe, tmp_path)


@torch.inference_mode()
def assert_decode_step_compiles(backend: str, recipe: str, tmp_path) -> None:
    """A quantized model's decode step on a filled static cache compiles with fullgraph=True (no graph
    break) and gives the eager step's logits, twice in a row (the cache rewinds between steps)."""
    torch._dynamo.reset()
    base = load_source_model(tiny_model_source(tmp_path), dtype=torch.bfloat16, device="cpu", seed=0)
    variant = build_variant(recipe, base, dtype=torch.bfloat16, device="cpu", backend=backend)
    assert variant.backend == backend
    model, shape = variant.model, ModelShape.from_config(base.config)
    cache = make_decode_cache(variant, 17)
    fill_cache(cache, shape, 2, 16, dtype=torch.bfloat16, device=torch.device("cpu"))
    ids = torch.randint(0, shape.vocab, (2, 1), generator=torch.Generator().manual_seed(0))
    kw = cache_keyword(model)

    def step(forward):
        logits = forward(input_ids=ids, use_cache=True, **{kw: cache}).logits  # [B, 1, V]
        rewind(cache, 1)
        return logits

    eager = step(model)
    forward = torch.compile(model, fullgraph=True, backend="aot_eager")  # raises on any graph break
    compiled, again = step(forward), step(forward)
    assert torch.isfinite(eager).all()
    # bf16 logits; the compiled graph may run another implementation of the same op (the Triton op's
    # pure-torch twin when traced on CPU), so compare as the kernel tests do: relative mean error
    err = ((compiled.float() - eager.float()).abs().mean() / eager.float().abs().mean()).item()
    assert err <= 2**-6, f"compiled decode step differs from eager: relative mean error {err:.1e}"
    torch.testing.assert_close(again, compiled)
    assert int(cache.get_seq_length()) == 16


def test_bench_compile_records_mode_breaks_and_bandwidth(tmp_path):
    out = tmp_path / "bench.json"
    args = _bench_parser().parse_args([
        "bench", tiny_model_source(tmp_path), "--variants", "w4a16-rtn", "--prompt-lens", "16",
        "--context-lens", "16", "--batch-sizes", "2", "--warmup", "1", "--repeats", "2", "--backend", "torch",
        "--compile", "all", "--compile-backend", "eager", "--json", str(out), "--quiet", "--device", "cpu",
    ])
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    assert data["settings"]["compile_backend"] == "eager"
    assert "--compile all --compile-backend eager" in data["command"]
    bandwidth = data["device"]["spec"]["memory_bandwidth"]
    for r in data["prefill"] + data["decode"]:
        assert r["mode"] == "compiled (eager)"
        assert r["graph_breaks"] == 0
        assert r["achieved_bandwidth"] == pytest.approx(r["roofline"]["bytes"] / r["median_s"])
        assert r["bandwidth_fraction"] == pytest.approx(r["achieved_bandwidth"] / bandwidth)
