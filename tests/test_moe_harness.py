"""`quantkit eval`, `bench`, `report` and `advise` on a quantized mixture-of-experts checkpoint, through the CLI.

A small random MoE model (fixtures/moe_fixtures.py; vocab 4096 with ref:tiny's tokenizer beside it, so that
eval reads the reference held-out text) is quantized with the RTN W4 recipe by `quantkit quantize`; then:

- eval: finite perplexities, KL and top-1 agreement, and the JSON names the checkpoint and its baseline;
- bench: the record and the printed table say the roofline counts only the experts a step's tokens reach
  (the MoE note, with its expected-experts numbers), and every decode record's weight bytes are what the
  checkpoint's own modules hold for the dense linears, the routers and that many experts (k = top-k for
  one token, E * (1 - (1 - k/E)^B) for a batch of B), computed here from the loaded model's layers;
- report: renders from bench and eval, its Markdown names the variant, its experts and the MoE note;
- advise: compares the schemes for the MoE config, matches the eval result to the W4 g128 scheme, and
  keeps every expert resident in the memory column.

Qwen3-MoE (routed experts only) and Qwen2-MoE (plus a shared expert every token runs).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shutil

import pytest

from quantkit.commands.cli import main
from quantkit.harness.roofline import ModelShape, RooflineScheme, linear_weight_bytes, moe_roofline_note
from fixtures.moe_fixtures import save_moe_model

FAMILIES = ("qwen3_moe", "qwen2_moe")
BATCHES = (1, 4)


@pytest.fixture(scope="module", params=FAMILIES)
def moe_run(request, tmp_path_factory):
    """Source model, checkpoint, and eval / bench / report / advise outputs (with what each printed)."""
    from quantkit.refmodels.registry import reference_model_path

    family = request.param
    root = tmp_path_factory.mktemp(family)
    src = save_moe_model(family, root / "src", vocab_size=4096)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(reference_model_path("tiny") / name, src / name)
    ckpt = root / f"{family}-w4"
    run = {"family": family, "src": src, "ckpt": ckpt, "root": root, "printed": {}}

    def cli(command: str, *args: str) -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main([command, *args])
        assert rc == 0, f"quantkit {command} failed (exit {rc}):\n{out.getvalue()[-2000:]}"
        run["printed"][command] = out.getvalue()

    cli("quantize", str(src), "--recipe", "w4a16-rtn", "--out", str(ckpt))
    cli("eval", str(ckpt), "--baseline", str(src), "--window", "128", "--max-tokens", "1024",
        "--json", str(root / "eval.json"))
    cli("bench", str(src), "--variants", str(ckpt), "--prompt-lens", "16", "--context-lens", "32",
        "--batch-sizes", ",".join(map(str, BATCHES)), "--warmup", "0", "--repeats", "1", "--device", "cpu",
        "--gpu", "h200", "--json", str(root / "bench.json"))
    cli("report", "--bench", str(root / "bench.json"), "--quality", str(root / "eval.json"),
        "--out", str(root / "report"))
    cli("advise", str(src), "--gpu", "h200", "--prompt-len", "128", "--output-len", "64",
        "--quality", str(root / "eval.json"), "--json", str(root / "advise.json"))
    for name in ("eval", "bench", "advise"):
        run[name] = json.loads((root / f"{name}.json").read_text())
    return run


def test_eval_names_the_checkpoint_and_is_finite(moe_run):
    result = moe_run["eval"]
    assert result["model"] == str(moe_run["ckpt"]) and result["baseline"] == str(moe_run["src"])
    assert result["windows"] == 8 and result["tokens"] == 8 * 127
    for key in ("perplexity", "baseline_perplexity", "kl_divergence", "top1_agreement"):
        assert math.isfinite(result[key]), (key, result[key])
    assert result["kl_divergence"] > 0 and 0 < result["top1_agreement"] <= 1
    assert f"KL          {result['kl_divergence']:.6f}" in moe_run["printed"]["eval"]


def _checkpoint_bytes(ckpt, scheme: RooflineScheme) -> dict[str, float]:
    """From the checkpoint's own modules, under the roofline's byte rule per linear: the quantized linears
    every token runs (attention, a shared expert), one routed expert per layer (expert 0; all are alike),
    and the routers (float [E, hidden])."""
    import quantkit
    from quantkit.modules.quant_experts import QuantExperts
    from quantkit.modules.quant_linear import QuantLinear

    model = quantkit.load(ckpt, backend="reference")
    in_experts = {id(m) for e in model.modules() if isinstance(e, QuantExperts) for m in e.modules()}
    dense = expert = routers = 0.0
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            size = linear_weight_bytes(module.in_features, module.out_features, scheme)
            if id(module) not in in_experts:
                dense += size
            elif ".experts.0." in name:
                expert += size
        elif name.endswith(".mlp.gate"):  # the router (Qwen2-MoE's shared_expert_gate, hidden -> 1: not modelled)
            routers += module.weight.numel() * scheme.dtype_bytes
    return {"dense": dense, "expert": expert, "routers": routers}


def test_bench_counts_the_routed_experts_only(moe_run):
    bench = moe_run["bench"]
    config = json.loads((moe_run["src"] / "config.json").read_text())
    shape = ModelShape.from_config(config)
    experts, top_k = 8, 2
    assert (shape.experts, shape.experts_per_token) == (experts, top_k)
    note = moe_roofline_note(shape)
    assert bench["model"]["moe_note"] == note and f"roofline: {note}" in moe_run["printed"]["bench"]
    assert f"({experts} experts, top-{top_k})" in note
    by_hand = {b: top_k if b == 1 else experts * (1 - (1 - top_k / experts) ** b) for b in (1, 4, 16, 64)}
    said = dict(re.findall(r"(\d+): (\d+\.\d)", note.split("at batch ", 1)[1]))
    assert {int(b): float(n) for b, n in said.items()} == {b: round(n, 1) for b, n in by_hand.items()}

    variant = next(v for v in bench["variants"] if v["source"] == f"checkpoint:{moe_run['ckpt']}")
    assert variant["scheme"]["weight_bits"] == 4 and variant["scheme"]["group_size"] == 128
    scheme = RooflineScheme(**variant["scheme"])
    parts = _checkpoint_bytes(moe_run["ckpt"], scheme)
    decode = {r["batch"]: r for r in bench["decode"] if r["variant"] == variant["name"]}
    assert sorted(decode) == list(BATCHES)
    for batch, record in decode.items():
        want = parts["dense"] + by_hand[batch] * parts["expert"] + parts["routers"]
        assert record["roofline"]["bytes_breakdown"]["weights"] == pytest.approx(want, rel=1e-9), batch
    # and fewer than every expert: a decode step of one token reads k of E
    all_experts = parts["dense"] + experts * parts["expert"] + parts["routers"]
    assert decode[1]["roofline"]["bytes_breakdown"]["weights"] < all_experts


def test_report_renders_the_moe_variant(moe_run):
    report = moe_run["root"] / "report"
    md = (report / "report.md").read_text()
    ckpt = moe_run["ckpt"].name
    assert f"| {ckpt} | checkpoint:{moe_run['ckpt']} |" in md
    assert "8 experts of intermediate 128, top-2" in md
    assert ("shared expert 256" in md) == (moe_run["family"] == "qwen2_moe")
    assert f"- Roofline: {moe_run['bench']['model']['moe_note']}" in md
    quality = md.split("## Quality", 1)[1]
    row = rf"^\| {re.escape(ckpt)} \| .* \| {moe_run['eval']['kl_divergence']:.4g} \|"  # the variant's KL
    assert re.search(row, quality, re.M), quality[:800]
    assert json.loads((report / "report.json").read_text())
    for plot in ("speedups.png", "roofline.png", "quality.png"):
        assert (report / plot).stat().st_size > 0


def test_advise_takes_the_moe_shape_and_the_eval_result(moe_run):
    from quantkit.harness.roofline import weight_memory_bytes

    advice = moe_run["advise"]
    config = json.loads((moe_run["src"] / "config.json").read_text())
    shape = ModelShape.from_config(config)
    rows = {c["name"]: c for c in advice["candidates"]}
    w4 = rows["w4g128"]
    assert w4["kl_divergence"] == pytest.approx(moe_run["eval"]["kl_divergence"])
    for row in rows.values():  # memory: every expert stays resident
        assert row["weights_bytes"] == pytest.approx(weight_memory_bytes(shape, RooflineScheme(**row["scheme"])))
    assert advice["recommended"] in rows and "recommendation:" in moe_run["printed"]["advise"]
